"""Launch-shape and variant sweep of the Triton sparse attention kernel (mini/kernels/sparse_attention.py) at decode
and prefill shapes of one V4.1-Flash rank (issue 13 item 5: at B = 256 x 32K the decode step spends 18.0 ms of 90
in it).

BLOCK_N stays 64: it is the official kernel's online-softmax block, so it fixes the numbers. What varies: the
warps and pipeline stages, and `d_split` (2, the default since 7298590's measurement: two programs per token and
head tile, each computing all the scores and accumulating half of the output's D columns: half the fp32
accumulator, no register spills on sm_90a; 1: one program, ~2 KB spilled per thread, the same bits). BLOCK_H stays
64: 32 and 16 changed bits at 0ab9964 (mma.sync-sized tiles).
The inputs carry the model's RoPE table (RD = 64: the epilogue the model runs). Each config's output is compared
bit for bit with the default's on the same inputs: a config that changes a bit may not become a default.

`python3 tools/attn_sweep.py [--json FILE]` (scripts/gpu.sh phase attn_sweep). Prints one line per (case, config):
median ms (triton.testing.do_bench), speed-up over the default, bits equal to the default (True / False); then per
case the best same-bits config and the d_split=1 line (the previous default) at the default's warps and stages.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini.bench.kernels import BLOCK_TOKENS, D, H, RATIO, TOPK, W, _bench, _decode_batch, _prefill_batch  # noqa: E402
from mini.ops.rope import rope_frequencies, rope_table  # noqa: E402

DEVICE = "cuda"
ROPE_DIM = 64  # V4.1's rotated channels: the output un-rotation runs in the kernel's epilogue, as in the model

CASES = {"decode B=256 ctx 32K": (256, lambda dev: _decode_batch(256, 32767, dev)),
         "decode B=64 ctx 32K": (64, lambda dev: _decode_batch(64, 32767, dev)),
         "prefill 4096": (4096, lambda dev: _prefill_batch(4096, 4096, RATIO, dev))}
DEFAULT = dict(block_h=64, num_warps=8, num_stages=2, d_split=2)
CONFIGS = ([dict(DEFAULT, d_split=1, num_warps=nw, num_stages=ns) for nw, ns in ((8, 2), (8, 3), (16, 2))]
           + [dict(DEFAULT, num_warps=nw, num_stages=ns) for nw, ns in ((8, 1), (8, 3), (4, 2), (16, 2), (16, 3))])


def inputs(T: int, b: dict, dev: str, seed: int = 0):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(T, H, D, device=dev, generator=g).bfloat16()
    kv_new = torch.randn(T, D, device=dev, generator=g).bfloat16()
    window = torch.randn(int(b["slots"].max()) + 1, W, D, device=dev, generator=g).bfloat16()
    comp = torch.randn(b["n_blocks"], BLOCK_TOKENS // RATIO, D, device=dev, generator=g).bfloat16()
    sink = torch.randn(H, device=dev, generator=g)
    vis = (b["positions"] + 1) // RATIO
    comp_idx = (torch.rand(T, TOPK, device=dev, generator=g) * vis[:, None]).long().sort(-1).values
    args = (q, kv_new, window, sink, b["positions"], b["seq_of"], b["slots"], b["start_pos"], D ** -0.5)
    rope = rope_table(b["positions"], rope_frequencies(ROPE_DIM, 160000.0, 256, 4.0).to(dev))
    return args, dict(comp=comp, block_table=b["block_table"], comp_idx=comp_idx, ratio=RATIO, rope_out=rope)


def main(argv=None) -> int:
    from mini.kernels.sparse_attention import sparse_mla_attention
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json")
    a = p.parse_args(argv)
    rows, default_ms = [], {}
    for name, (T, make) in CASES.items():
        args, kw = inputs(T, make(DEVICE), DEVICE)
        base = sparse_mla_attention(*args, **kw, **DEFAULT)
        base_ms = default_ms[name] = _bench(lambda: sparse_mla_attention(*args, **kw, **DEFAULT))
        for cfg in CONFIGS:
            try:
                out = sparse_mla_attention(*args, **kw, **cfg)
                ms = _bench(lambda: sparse_mla_attention(*args, **kw, **cfg))
                row = dict(case=name, **cfg, ms=ms, speedup=base_ms / ms, same_bits=bool(torch.equal(out, base)))
            except Exception as e:  # noqa: BLE001 - a config the compiler refuses (registers, shared memory)
                row = dict(case=name, **cfg, error=f"{type(e).__name__}: {str(e)[:120]}")
            rows.append(row)
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
    for name in CASES:
        ok = [r for r in rows if r["case"] == name and r.get("same_bits")]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            print(f"best same-bits config for {name}: {best}")
        prev = [r for r in rows if r["case"] == name and r.get("d_split") == 1 and r["num_warps"] == 8
                and r["num_stages"] == 2]
        for r in prev:
            print(f"d_split=1 (8 warps, 2 stages) {name}: speedup={r.get('speedup', float('nan')):.3f} "
                  f"same_bits={r.get('same_bits')} ms={r.get('ms', float('nan')):.4g} default_ms={default_ms[name]:.4g} "
                  f"{r.get('error', '')}")
    if a.json:
        Path(a.json).write_text(json.dumps({"suite": "attn_sweep", "default": DEFAULT, "default_ms": default_ms,
                                            "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
