"""Tile sweep of the Triton sparse attention kernel (mini/kernels/sparse_attention.py) at decode and prefill shapes
of one V4.1-Flash rank (issue 13 item 5: at B = 256 x 32K the decode step spends 18.0 ms of 90 in it).

Only the launch shape varies: BLOCK_H (query heads per program), warps and pipeline stages. BLOCK_N stays 64: it is
the official kernel's online-softmax block, so it fixes the numbers. Each config's output is compared bit for bit
with the default's on the same inputs: a config that changes a bit is reported and may not become a default.

`python3 tools/attn_sweep.py [--json FILE]` (scripts/gpu.sh phase attn_sweep). Prints one line per (case, config):
median ms (triton.testing.do_bench), speed-up over the default, bits equal to the default (True / False).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini.bench.kernels import BLOCK_TOKENS, D, H, RATIO, TOPK, W, _bench, _decode_batch, _prefill_batch  # noqa: E402

CASES = {"decode B=256 ctx 32K": (256, lambda dev: _decode_batch(256, 32767, dev)),
         "decode B=64 ctx 32K": (64, lambda dev: _decode_batch(64, 32767, dev)),
         "prefill 4096": (4096, lambda dev: _prefill_batch(4096, 4096, RATIO, dev))}
CONFIGS = [dict(block_h=bh, num_warps=nw, num_stages=ns)
           for bh, nw, ns in itertools.product((64, 32, 16), (4, 8), (1, 2, 3))]


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
    return args, dict(comp=comp, block_table=b["block_table"], comp_idx=comp_idx, ratio=RATIO)


def main(argv=None) -> int:
    from mini.kernels.sparse_attention import sparse_mla_attention
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json")
    a = p.parse_args(argv)
    rows = []
    for name, (T, make) in CASES.items():
        args, kw = inputs(T, make("cuda"), "cuda")
        base = sparse_mla_attention(*args, **kw)
        base_ms = _bench(lambda: sparse_mla_attention(*args, **kw))
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
    if a.json:
        Path(a.json).write_text(json.dumps({"suite": "attn_sweep", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
