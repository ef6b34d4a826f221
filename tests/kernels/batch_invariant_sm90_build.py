"""Builds the batch-invariant GEMM kernels (mini/kernels/batch_invariant.py) for sm_90a (Triton -> PTX -> cubin, no
GPU needed): the pointer kernel at the default, tuned and fp32 small-row tiles, the TUNED TMA tiles and the other
TMA variants of tools/det_profile.py's sweep, and the fp32 few-rows FMA kernel at SMALL_FP32's row buckets, so
that a kernel that only fails to compile for Hopper (the interpreter accepts more) is caught on CPU. Run as a
script without TRITON_INTERPRET; one line each."""
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mini.kernels import batch_invariant as bi


def build(kernel, types: dict, consts: dict, num_warps: int, num_stages: int) -> None:
    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr")}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    print(kernel.__name__, {k: v for k, v in consts.items() if k in ("BM", "BN", "BK", "A_COLS", "B_NK", "PROGRAMS",
                                                                       "FLATTEN")},
          num_warps, num_stages, "ok", flush=True)


def main() -> int:
    scalars = {"alpha": "fp32", "beta": "fp32"}
    flags = dict(HAS_ADD=False, SCALE=False)
    for dt, cfgs in (("bf16", [bi.CONFIGS[bi.torch.bfloat16], bi.TileConfig(256, 128, 64, 8, 3)]),
                     ("fp32", [bi.CONFIGS[bi.torch.float32], bi.SMALL_FP32_DOT])):
        for cfg in cfgs:
            ptrs = {"a_ptr": f"*{dt}", "b_ptr": f"*{dt}", "c_ptr": f"*{dt}", "add_ptr": f"*{dt}"}
            build(bi._mm_kernel, {**ptrs, **scalars},
                  dict(flags, PRECISION="ieee" if dt == "fp32" else "tf32",
                       DOT_DTYPE=tl.float32 if dt == "fp32" else tl.bfloat16, EVEN_K=True, BM=cfg.BM, BN=cfg.BN,
                       BK=cfg.BK, GROUP_M=cfg.GROUP_M), cfg.num_warps, cfg.num_stages)
    # every TMA tile of TUNED (with a's groups side by side in its rows too, as attention's grouped output
    # projection passes them) and the other TMA variants tools/det_profile.py sweeps, with the weight as stored
    # (B_NK) and once per kernel as [K, N]
    tuned = sorted({(c.BM, c.BN, c.BK, c.num_warps, c.num_stages, c.GROUP_M, c.kernel) for c in bi.TUNED.values()
                    if c.kernel.startswith("tma")})
    swept = [(128, 128, 64, 8, 3, 8, "tma"), (128, 128, 64, 8, 3, 8, "tma-persistent"),
             (128, 128, 64, 4, 4, 8, "tma-persistent-flat")]
    cases = [(v, True, a_cols) for v in tuned for a_cols in (False, True)]
    cases += [(v, b_nk, False) for v in swept for b_nk in (True, False)]
    for (bm, bn, bk, warps, stages, group, kernel), b_nk, a_cols in cases:
        types = {"a_desc": f"tensordesc<bf16[{bm}, {bk}]>",
                 "b_desc": f"tensordesc<bf16[{bn}, {bk}]>" if b_nk else f"tensordesc<bf16[{bk}, {bn}]>",
                 "c_ptr": "*bf16", "add_ptr": "*bf16", **scalars}
        build(bi._mm_tma_kernel, types,
              dict(flags, A_COLS=a_cols, B_NK=b_nk, BM=bm, BN=bn, BK=bk, GROUP_M=group,
                   PROGRAMS=0 if kernel == "tma" else 132, FLATTEN=kernel == "tma-persistent-flat",
                   INTERPRET=False), warps, stages)
    # the fp32 few-rows kernel: SMALL_FP32 at each row bucket, and two wider programs
    small = bi.SMALL_FP32
    for bm, bn, warps in [(m, small.BN, small.num_warps) for m in (1, 2, 4, 8, 16)] + [(1, 128, 4), (16, 256, 8)]:
        ptrs = {"a_ptr": "*fp32", "b_ptr": "*fp32", "c_ptr": "*fp32", "add_ptr": "*fp32"}
        build(bi._mm_fma_rows_kernel, {**ptrs, **scalars}, dict(flags, EVEN_K=True, BM=bm, BN=bn), warps, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
