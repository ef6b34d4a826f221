"""The mHC site input's split-K pass (mhc_norm, V4.1 delayed pre), default vs candidate layouts (issue 13 item 4;
docs/kernels.md, mHC; phase `mhc_ab` of scripts/gpu.sh): `python3 tools/mhc_split.py [--json FILE]`, printed and
written as `python -m mini.bench.kernels` does (one row per config).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini.bench import kernels  # noqa: E402
from mini.bench.kernels import DIM, HC, _bench, _bench_graph  # noqa: E402

HBM_TBS = 4.8  # the H200's nominal memory bandwidth (COPY_TBS is what a device copy reaches)


def _site(T: int, dim: int, dev: str):
    """One V4.1 site's inputs for T rows (delayed pre): mhc_norm's positional and keyword arguments, and the
    floor's bytes (h read once + y written once)."""
    h = torch.randn(T, HC, dim, device=dev).bfloat16()
    fn = torch.randn((2 + HC) * HC, HC * dim, device=dev) * 0.01
    scale, base = torch.rand(3, device=dev), torch.randn((2 + HC) * HC, device=dev)
    nw = torch.rand(dim, device=dev).bfloat16()
    kw = dict(pre_in=torch.rand(T, HC, device=dev), iters=20, hc_eps=1e-6, norm_eps=1e-20)
    return (h, fn, scale, base, nw), kw, h.numel() * 2 + T * dim * 2


def _time_configs(rows: list, kernel: str, site, configs: list, timer, label) -> None:
    """Each config of mhc_norm on one site: ms by `timer`, the floor's bytes over it, and `bits` against the
    defaults' outputs (y elements that differ, the mixes' largest relative change). Printed as it comes: a run cut
    short by its time cap keeps these."""
    from mini.kernels.mhc_norm import mhc_norm
    args, kw, nbytes = site
    base_out = mhc_norm(*args, **kw)
    for cfg in configs:
        try:
            ms = timer(lambda: mhc_norm(*args, **kw, **cfg))
            out = mhc_norm(*args, **kw, **cfg)
        except Exception as e:  # a configuration the compiler refuses must not hide the others
            rows.append(dict(kernel=kernel, config=cfg, error=str(e)[:200]))
            continue
        rows.append(dict(kernel=kernel, config=label(cfg), ms=ms, us=ms * 1e3, tbs=nbytes / ms / 1e9,
                         frac_hbm_peak=nbytes / ms / 1e9 / HBM_TBS,
                         bits=dict(y_differ=int((out[0] != base_out[0]).sum()),
                                   mixes_max_rel=max(float(((a - b).abs() / b.abs().clamp_min(1e-30)).max())
                                                     for a, b in zip(out[1:], base_out[1:])))))
        print(json.dumps(rows[-1]), flush=True)


def bench_mhc_split(rows: list, sweep=(), dev="cuda", sizes=(4096, 256, 64), dim: int = DIM):
    """The mHC site input (mhc_norm, V4.1 delayed pre) at a prefill step and two decode batches: the default
    (copies side by side in one tile, 8 split-K chunks) against one tile per copy (layout="copies": fewer
    instructions and registers, so more programs per SM) and more chunks (few 64-token blocks leave the default
    few programs: 8 at 64 tokens, 32 at 256; 39 us per site at B = 256 in rank4-decode's split). Both regroup the
    mixes' fp32 sums, so a new default would move their last bits (and need the deterministic mode kept fixed):
    `bits` says by how much against the default. Floor: h read once + y written once; tbs = those bytes over the
    time, frac_hbm_peak against 4.8 TB/s."""
    copies = dict(layout="copies")
    for T in sizes:
        if T >= 1024:  # 2 stages: 33 KB of shared memory, 56 registers: 6 programs per SM, so 12 chunks or
            # 32-token blocks fill them (768 / 1,024 programs)
            configs = [{}, copies, dict(copies, num_stages=2), dict(copies, num_stages=2, split=12),
                       dict(copies, num_stages=2, block_t=32), dict(copies, num_stages=2, block_k=32)]
        else:
            configs = [{}, dict(split=40), copies, dict(copies, split=40), dict(copies, num_stages=2, split=40)]
        _time_configs(rows, f"mhc_norm [{T},{HC},{dim}]", _site(T, dim, dev), configs, _bench,
                      lambda cfg: cfg or "default")


# (block_t, split) grids tried at a decode / verify step's rows, beside partial_tiles' own choice: at 384 rows (a B =
# 64 x 6 verify step) it takes 64-token blocks in 20 chunks, 120 programs, which re-read fn's pieces 6 times
ROWS_GRIDS = [(16, 16), (16, 32), (32, 16), (32, 32), (32, 64), (64, 32), (64, 64), (128, 32), (128, 64)]


def bench_mhc_rows(rows: list, sweep=(), dev="cuda", sizes=(384, 96, 64, 6), dim: int = DIM):
    """mhc_norm (V4.1 delayed pre) at a verify step's rows (B x 6: 384, 96, 6) and a decode step's (64), in a CUDA
    graph as a step replays it: the default tiles (`partial_tiles`, `finish_tiles`) against ROWS_GRIDS' (block_t,
    split) grids in both layouts. Floor: h read once + y written once (tbs); bits against the default."""
    from mini.kernels.mhc_norm import partial_tiles
    for T in sizes:
        configs = [{}] + [dict(block_t=bt, split=sp, layout=lay) for bt, sp in ROWS_GRIDS
                          for lay in ("side_by_side", "copies")]
        _time_configs(rows, f"mhc_norm rows [{T},{HC},{dim}]", _site(T, dim, dev), configs, _bench_graph,
                      lambda cfg, T=T: cfg or f"default {partial_tiles(T, dim, 16, False)}")


BENCHES = {"mhc_split": bench_mhc_split, "mhc_rows": bench_mhc_rows}

if __name__ == "__main__":
    kernels.main(benches=BENCHES, prog="tools/mhc_split.py")
