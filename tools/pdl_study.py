"""Programmatic dependent launch (PDL) at decode's kernel sizes: would a weight read that starts while the small
kernel before it runs make a CUDA-graph step shorter?

At B = 1 a decode step is ~1,800 kernels whose durations make its time (docs/perf/049), and the FP8 reads of the
dense weights (9-47 MB each) take ~3x their byte floor: a read ramps up only after the kernel before it (a norm, a
quant, a split-K sum, a few us on one or a few SMs) has drained. With PDL (Hopper's griddepcontrol) a kernel
launched with `launch_pdl=True` may start once every program of the kernel before it has called
`gdc_launch_dependents` (or exited), and must call `gdc_wait` before it reads what that kernel wrote (or writes
what it may still read). Its weights do not depend on the kernel before it: it can pull them toward L2 first.

This study measures that before any model kernel changes: a chain that looks like a layer's reads, LAYERS x the five
V4.1-Flash FP8 read shapes, each read preceded by a one-program "norm" over the previous read's output (a true
dependency), every weight its own copy (5.3 GB: from HBM, as in a step), in one CUDA graph, three ways:

- `base`: plain launches;
- `pdl`: every kernel launched with PDL, `gdc_launch_dependents` first and `gdc_wait` before its reads;
- `pdl_prefetch`: `pdl`, and each read program first issues `prefetch.global.L2` over its weight slab, then waits.

It prints us per step and per read against the reads' byte floor at the card's nominal bandwidth, and checks that
the three give the same bits (same sums in the same order: they differ only in when each kernel starts).

    python3 tools/pdl_study.py [--layers 40] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parent))

from looped_rows_study import nominal_tbs  # noqa: E402

# V4.1-Flash's dense FP8 reads at decode, [N, K]: wq_a|wkv, wq_b|indexer wq_b, wo_b, the shared w1|w3 and w2
SHAPES = [(1792, 5120), (36864, 1280), (5120, 8192), (4608, 5120), (5120, 2304)]
D = 5120  # the norm's width (the model's dim): each read's first D outputs (zero-padded) feed the next norm
BLOCK_N, BLOCK_K, LINE = 64, 128, 128  # a read program's tile; an L2 line is 128 bytes (128 e4m3 weights)
VARIANTS = {"base": (False, False), "pdl": (True, False), "pdl_prefetch": (True, True)}  # (pdl, prefetch)


@triton.jit
def _prefetch_l2(ptrs):
    """prefetch.global.L2 at each address (one per 128-byte line): the lines start coming from HBM now."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _norm_kernel(y_ptr, n_valid, x_ptr, D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program: x = y[:D] * rsqrt(mean(y[:D]^2) + 1e-6), y's entries past n_valid read as 0 (a norm's shape of
    work: one SM, a few us)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    i = tl.arange(0, BLOCK)
    ok = i < D
    y = tl.load(y_ptr + i, mask=ok & (i < n_valid), other=0.0)
    r = tl.rsqrt(tl.sum(y * y, axis=0) / D + 1e-6)
    tl.store(x_ptr + i, y * r, mask=ok)


@triton.jit
def _read_kernel(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, K_PIECE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, LINE: tl.constexpr, LINES: tl.constexpr, PDL: tl.constexpr,
                 PREFETCH: tl.constexpr):
    """Program (n block, K piece): y[piece, n] = sum over the piece of w[n, k] x[k] (w e4m3, x fp32)."""
    pid_n, piece = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k_lo = piece * K_PIECE
    if PREFETCH:  # the slab's lines toward L2 while the kernel before this one still runs
        lines = tl.minimum(tl.arange(0, LINES), K_PIECE // LINE - 1) * LINE  # (repeats of the last line: no-ops)
        _prefetch_l2(w_ptr + tl.minimum(n, N - 1)[:, None].to(tl.int64) * K + k_lo + lines[None, :])
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # x is the norm's output: read only after it has completed
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + K_PIECE, BLOCK_K):
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k0 + kk[None, :], mask=n_ok[:, None], other=0.0)
        x = tl.load(x_ptr + k0 + kk)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(y_ptr + piece.to(tl.int64) * N + n, acc, mask=n_ok)


def pieces_for(N: int, K: int, sms: int) -> int:
    """K pieces: the fewest that give the read ~4 programs an SM, each piece whole tiles (and so whole lines)."""
    want = -(-4 * sms // -(-N // BLOCK_N))
    return next((p for p in range(max(1, want), K // BLOCK_K + 1) if K % (p * BLOCK_K) == 0), K // BLOCK_K)


class Chain:
    """LAYERS x SHAPES (norm, read) pairs on their own weights, x and y buffers, as one callable step."""

    def __init__(self, layers: int, dev: str, seed: int = 0):
        g = torch.Generator(device=dev).manual_seed(seed)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.reads = []
        for _ in range(layers):
            for N, K in SHAPES:
                w = (torch.randn(N, K, device=dev, generator=g) * 0.05).to(torch.float8_e4m3fn)
                p = pieces_for(N, K, sms)
                self.reads.append((w, N, K, p, torch.empty(p, N, device=dev)))
        self.x = torch.zeros(max(K for _, K in SHAPES), device=dev)  # past D: zeros
        self.y0 = torch.randn(D, device=dev, generator=g)
        self.bytes = sum(w.numel() for w, *_ in self.reads)

    def step(self, pdl: bool, prefetch: bool) -> None:
        y, n_valid = self.y0, D
        for w, N, K, p, out in self.reads:
            _norm_kernel[(1,)](y, n_valid, self.x, D=D, BLOCK=triton.next_power_of_2(D), PDL=pdl, launch_pdl=pdl,
                               num_warps=8)
            _read_kernel[(triton.cdiv(N, BLOCK_N), p)](self.x, w, out, N, K=K, K_PIECE=K // p, BLOCK_N=BLOCK_N,
                                                        BLOCK_K=BLOCK_K, LINE=LINE,
                                                        LINES=triton.next_power_of_2(K // p // LINE), PDL=pdl,
                                                        PREFETCH=prefetch,
                                                        launch_pdl=pdl, num_warps=4)
            y, n_valid = out, N  # the next norm reads this read's piece 0

    def outputs(self) -> list[torch.Tensor]:
        return [out.clone() for *_, out in self.reads]


def run(layers: int, replays: int = 20) -> dict:
    dev = "cuda"
    chain = Chain(layers, dev)
    floor_us = 1e6 * chain.bytes / (nominal_tbs() * 1e12)
    result = {"layers": layers, "reads": len(chain.reads), "bytes": chain.bytes, "floor_us": floor_us,
              "device": torch.cuda.get_device_name(0)}
    ref = None
    for name, (pdl, prefetch) in VARIANTS.items():
        chain.step(pdl, prefetch)  # compile, warm
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain.step(pdl, prefetch)
        for out in chain.outputs():
            out.fill_(float("nan"))
        times = []
        for _ in range(replays + 3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        us = statistics.median(times[3:])
        outs = chain.outputs()
        same = None if ref is None else all(torch.equal(a, b) for a, b in zip(ref, outs))
        ref = ref or outs
        result[name] = {"step_us": us, "us_per_read": us / len(chain.reads), "vs_floor": us / floor_us,
                        "same_bits_as_base": same}
        print(f"pdl-study {name:13s} {us:9.1f} us a step ({us / len(chain.reads):6.2f} a norm + read), "
              f"{us / floor_us:5.2f}x the reads' byte floor ({floor_us:.1f} us)"
              + ("" if same is None else f", same bits as base: {same}"))
        del graph
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("pdl_study: needs a CUDA device (Hopper: griddepcontrol)", file=sys.stderr)
        return 2
    result = run(args.layers)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
