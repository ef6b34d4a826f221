"""The vision encoder's elementwise kernels (mini/kernels/vision_{norm,rope,swiglu}.py) against the reference's own
torch ops (mini/ops/vision.py's add_norm, split_rope and swiglu with fused=False: what vit_one runs). Fresh
random bf16 data, odd row counts and widths that are not powers of two, outputs NaN-poisoned. The residual sum and
the rotation (built without FMA contraction) are the reference's bits; the norm sums its squares in another order
(each value within one bf16 step of the reference's) and SwiGLU's exp is the GPU's own (two steps: see
check_swiglu), a value off at all is rare (under 1e-3 of them). CPU: Triton's
interpreter at small sizes; gpu: the compiled kernels at V4.1-Flash's vision shape (8,649 patches of width 1,024,
16 heads, MLP 2,816)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mini.kernels.vision_norm import add_rms_norm
from mini.kernels.vision_rope import split_rope
from mini.kernels.vision_swiglu import swiglu
from mini.ops import vision as ops
from mini.ops.vision import VIT_NORM_EPS, rope_table


def within_bf16_steps(got: torch.Tensor, want: torch.Tensor, steps: int = 1) -> None:
    """Each value within `steps` bf16 steps of the reference's (a step is at most 2^-7 of the value), and at most
    one in a thousand off at all."""
    assert not got.isnan().any()
    g, w = got.float(), want.float()
    assert ((g - w).abs() <= w.abs() * steps * 2.0 ** -7 + 1e-30).all(), (g - w).abs().max()
    assert (g != w).float().mean() < 1e-3


def check_norm(R, D, device, add=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, d = (torch.randn(R, D, generator=g) * 3).bfloat16().to(device), torch.randn(R, D, generator=g).bfloat16()
    w = (torch.rand(D, generator=g) + 0.5).bfloat16().to(device)
    d = d.to(device) if add else None
    s, out = add_rms_norm(x, d, w, VIT_NORM_EPS)
    want_s, want = ops.add_norm(x, d, w, fused=False)
    assert torch.equal(s, want_s)
    within_bf16_steps(out, want)


def check_rope(n_h, n_w, heads, hd, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n_h * n_w, 3 * heads * hd, generator=g).bfloat16().to(device)
    cos, sin = rope_table(n_h, n_w, hd, 10000.0, device)
    got = split_rope(qkv, cos.flatten(1), sin.flatten(1), heads)
    assert not got.isnan().any()
    q, k, v = ops.split_rope(qkv, heads, cos, sin, fused=False)
    assert torch.equal(got[0], q) and torch.equal(got[1], k) and torch.equal(got[2], v)


def check_swiglu(R, inter, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(R, 2 * inter, generator=g) * 4).bfloat16().to(device)
    # two steps: an activation one step off (the GPU's exp) moves the rounded product by up to two
    within_bf16_steps(swiglu(gu), ops.swiglu(gu, fused=False), steps=2)


@pytest.mark.parametrize("R,D,add", [(1, 64, True), (13, 96, True), (7, 72, False), (33, 1024, True)])
def test_add_rms_norm_interpreter(R, D, add, interpreter, poisoned):
    check_norm(R, D, "cpu", add)


@pytest.mark.parametrize("n_h,n_w,heads,hd", [(1, 1, 1, 4), (3, 5, 3, 20), (6, 6, 2, 32), (2, 7, 16, 64)])
def test_split_rope_is_the_reference_interpreter(n_h, n_w, heads, hd, interpreter, poisoned):
    check_rope(n_h, n_w, heads, hd, "cpu")


@pytest.mark.parametrize("R,inter", [(1, 64), (11, 72), (5, 2816)])
def test_swiglu_interpreter(R, inter, interpreter, poisoned):
    check_swiglu(R, inter, "cpu")


def test_bad_shapes_are_named():
    x = torch.zeros(4, 8).bfloat16()
    with pytest.raises(ValueError, match="add_rms_norm"):
        add_rms_norm(x, torch.zeros(4, 6).bfloat16(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="split_rope"):
        split_rope(torch.zeros(4, 3 * 2 * 8).bfloat16(), torch.zeros(4, 3), torch.zeros(4, 3), heads=2)
    with pytest.raises(ValueError, match="swiglu"):
        swiglu(torch.zeros(4, 7).bfloat16())


SM90_BUILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mini.kernels.vision_norm import _add_rms_norm_kernel
from mini.kernels.vision_rope import _split_rope_kernel
from mini.kernels.vision_swiglu import _swiglu_kernel

def build(kernel, consts, fp32=(), floats=(), **options):
    names = kernel.arg_names
    types = {n: "constexpr" if n in consts else ("*fp32" if n in fp32 else "*bf16") if n.endswith("_ptr")
             else "fp32" if n in floats else "i32" for n in names}
    src = ASTSource(fn=kernel, signature=types, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, **options)).asm["ptx"]

for d in (1024, 64):
    for add in (True, False):
        build(_add_rms_norm_kernel, dict(D=d, BLOCK_D=d, BLOCK_R=max(1, min(16, 4096 // d)), ADD=add), floats=("eps",))
for heads, half in ((16, 32), (2, 16)):
    p = 2 * heads * half
    ptx = build(_split_rope_kernel, dict(HEADS=heads, HALF=half, BLOCK_P=p, BLOCK_R=max(1, min(16, 2048 // p))),
                fp32=("cos_ptr", "sin_ptr"), enable_fp_fusion=False)
    print("rope fma", ptx.count("fma.rn.f32"))
for i in (2816, 64):
    c = min(512, 1 << (i - 1).bit_length())
    build(_swiglu_kernel, dict(I=i, BLOCK_R=2048 // c, BLOCK_C=c))
print("built")
"""


@pytest.mark.slow
def test_kernels_build_for_sm90_rope_without_fma():
    """The three kernels compile for Hopper at V4.1's and the fixtures' vision shapes (no GPU needed; the
    interpreter accepts more than the compiler), and the RoPE's PTX has no fused multiply-add: its products are
    rounded as the reference's separate torch ops round them. A subprocess: this session may be on the
    interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", SM90_BUILD], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["rope", "fma", "0", "rope", "fma", "0", "built"], run.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("add", [True, False])
def test_add_rms_norm_gpu(add, poisoned):
    check_norm(93 * 93, 1024, "cuda", add)
    check_norm(1001, 64, "cuda", add, seed=1)


@pytest.mark.gpu
def test_split_rope_is_the_reference_gpu(poisoned):
    check_rope(93, 93, 16, 64, "cuda")
    check_rope(37, 11, 2, 32, "cuda", seed=1)


@pytest.mark.gpu
def test_swiglu_gpu(poisoned):
    check_swiglu(93 * 93, 2816, "cuda")
    check_swiglu(1001, 64, "cuda", seed=1)
