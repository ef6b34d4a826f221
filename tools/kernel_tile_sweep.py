"""The attention-side kernels of `mini bench kernels` under alternative tile configurations beside their defaults
(docs/kernels.md; phase `kernels` of scripts/gpu.sh with KERNELS_SWEEP=1): each config a row, run and printed as
`python -m mini.bench.kernels` does. The lists are the neighbours of each default that its tuning tried (the
defaults were fastest at real V4.1-Flash shape):

    python3 tools/kernel_tile_sweep.py [--only attention indexer mhc] [--json FILE]
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini.bench import kernels  # noqa: E402

SWEEPS = {  # further configs per bench, timed after its default
    "attention": [dict(block_h=64, block_n=32, num_warps=8, num_stages=2),
                  dict(block_h=64, block_n=32, num_warps=8, num_stages=3),
                  dict(block_h=64, block_n=16, num_warps=8, num_stages=3)],
    "indexer": [dict(block_t=2, block_n=128), dict(block_t=4, block_n=128, num_stages=3),
                dict(block_t=2, block_n=64, num_stages=3)],
    # the neighbours of the default among the 35 configurations of docs/perf/raw/mhc2 (the default was fastest)
    "mhc": [dict(block_k=16, num_stages=4, split=6), dict(block_k=16, num_stages=2, split=10),
            dict(block_k=16, split=20), dict(block_k=32), dict(finish_block_t=4)],
}


def _swept(name: str, rows: list, sweep=(), dev="cuda"):
    kernels.BENCHES[name](rows, SWEEPS[name], dev)


BENCHES = {name: partial(_swept, name) for name in SWEEPS}

if __name__ == "__main__":
    kernels.main(benches=BENCHES, prog="tools/kernel_tile_sweep.py")
