"""Micro-benchmarks of the attention-side kernels at real V4.1-Flash shape (one EP4/DP4 rank: 4,096 tokens).

`python -m mini.bench.kernels [--json FILE] [--only NAME ...]` prints, per kernel, the median time
(triton.testing.do_bench on random data) and the achieved rate against the measured H200 ceilings (bf16 GEMM
804 TFLOP/s, device copy 4.26 TB/s; /work/shared/perf/README.md), plus the torch reference op where it fits.
Counting: attention 4·H·D FLOP per (query, key) (QK and PV); indexer 2·H·di per visible (query, group); the
memory-bound kernels count each input read once and each output written once. Every bench takes `sweep`, tile
configurations timed beside its default (none here; tools/kernel_tile_sweep.py passes its lists).
"""
from __future__ import annotations

import argparse
import json

import torch

GEMM_TFLOPS, COPY_TBS = 804.0, 4.26
H, D, W, RATIO, TOPK, BLOCK_TOKENS = 64, 512, 128, 2, 512, 256
IH, IDI = 32, 128
HC, DIM = 4, 5120


def _bench(fn) -> float:
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # ms


def _reference(fn):
    """Time the plain reference op: mini.ops would dispatch to the kernels themselves on CUDA."""
    import mini.ops

    def call():
        mini.ops.set_backend("reference")
        try:
            return fn()
        finally:
            mini.ops.set_backend("fast")
    return call


def _prefill_batch(T: int, start: int, ratio: int, dev):
    """One sequence: a chunk of T tokens starting at `start`, blocks in shuffled order."""
    end = start + T
    nb = -(-end // BLOCK_TOKENS)
    return dict(positions=torch.arange(start, end, device=dev), seq_of=torch.zeros(T, dtype=torch.long, device=dev),
                slots=torch.tensor([1], device=dev), start_pos=torch.tensor([start], device=dev),
                block_table=torch.randperm(nb + 5, device=dev)[:nb].to(torch.int32)[None], n_blocks=nb + 5)


def _decode_batch(B: int, pos: int, dev):
    nb = -(-(pos + 1) // BLOCK_TOKENS)
    return dict(positions=torch.full((B,), pos, device=dev), seq_of=torch.arange(B, device=dev),
                slots=torch.randperm(B, device=dev), start_pos=torch.full((B,), pos, device=dev),
                block_table=torch.randperm(B * nb, device=dev).view(B, nb).to(torch.int32), n_blocks=B * nb)


def attention_cases(dev="cuda"):
    """The sparse attention's inputs at a prefill chunk and a decode batch: (name, positions, args, kw, flops);
    the suite times the kernel on them, tools/attention_before_after.py its RoPE epilogue."""
    for name, T, b in (("prefill", 4096, _prefill_batch(4096, 4096, RATIO, dev)),
                       ("decode", 128, _decode_batch(128, 9000, dev))):
        q = torch.randn(T, H, D, device=dev).bfloat16()
        kv_new = torch.randn(T, D, device=dev).bfloat16()
        window = torch.randn(int(b["slots"].max()) + 1, W, D, device=dev).bfloat16()
        comp = torch.randn(b["n_blocks"], BLOCK_TOKENS // RATIO, D, device=dev).bfloat16()
        sink = torch.randn(H, device=dev)
        vis = (b["positions"] + 1) // RATIO
        comp_idx = (torch.rand(T, TOPK, device=dev) * vis[:, None]).long().sort(-1).values  # all valid
        args = (q, kv_new, window, sink, b["positions"], b["seq_of"], b["slots"], b["start_pos"], D ** -0.5)
        kw = dict(comp=comp, block_table=b["block_table"], comp_idx=comp_idx, ratio=RATIO)
        yield name, b["positions"], args, kw, 4 * H * D * T * (W + TOPK)


def bench_attention(rows: list, sweep=(), dev="cuda"):
    from mini.kernels.sparse_attention import sparse_mla_attention
    from mini.ops.attention import sparse_attention as reference
    configs = [{}, *sweep]  # the defaults: block_h 64, block_n 64, 8 warps, 2 stages
    for name, positions, args, kw, flops in attention_cases(dev):
        key_bytes = flops // (4 * H) * 2  # keys as gathered per query (mostly L2 hits): T * (W + TOPK) * D bf16
        for cfg in configs:
            ms = _bench(lambda: sparse_mla_attention(*args, **kw, **cfg))
            rows.append(dict(kernel=f"sparse_attention/{name}", config=cfg or "default", ms=ms,
                             tflops=flops / ms / 1e9, frac_gemm_peak=flops / ms / 1e9 / GEMM_TFLOPS,
                             gathered_tbs=key_bytes / ms / 1e9))
        if name == "prefill":
            ms = _bench(_reference(lambda: reference(*args, **kw)))
            rows.append(dict(kernel=f"sparse_attention/{name}", config="torch reference", ms=ms,
                             tflops=flops / ms / 1e9))


def bench_attention_decode(rows: list, sweep=(), dev="cuda"):
    """Decode steps of B = 1..256 rows at 4K and 32K context (RoPE epilogue on, as the model runs it): the
    one-program walk (k_split=1) against the split-key walk (the count `split_pieces` suggests, the default, then
    fixed counts: what a fixed count, the deterministic mode's option, costs at every B). The byte floor: q, each row's W + TOPK keys and its indices read once, the output written once."""
    from mini.kernels.sparse_attention import sparse_mla_attention, split_pieces
    from mini.ops.rope import rope_frequencies, rope_table
    for ctx in (4096, 32768):
        for B in (1, 4, 16, 64, 256):
            b = _decode_batch(B, ctx, dev)
            torch.manual_seed(B)
            q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
            kv_new = torch.randn(B, D, device=dev, dtype=torch.bfloat16)
            window = torch.randn(B, W, D, device=dev, dtype=torch.bfloat16)
            comp = torch.randn(b["n_blocks"], BLOCK_TOKENS // RATIO, D, device=dev, dtype=torch.bfloat16)
            comp_idx = (torch.rand(B, TOPK, device=dev) * (ctx + 1) // RATIO).long().sort(-1).values
            args = (q, kv_new, window, torch.randn(H, device=dev), b["positions"], b["seq_of"], b["slots"],
                    b["start_pos"], D ** -0.5)
            kw = dict(comp=comp, block_table=b["block_table"], comp_idx=comp_idx, ratio=RATIO,
                      rope_out=rope_table(b["positions"], rope_frequencies(64, 160000.0, 65536, 16.0)))
            nbytes = B * (2 * H * D * 2 + (W + TOPK) * D * 2 + TOPK * 8)
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            auto = split_pieces(B * 2, -(-(W + TOPK) // 64), sms)
            suggested = {"k_split": auto, "note": "split_pieces"}
            for cfg in (*({"k_split": S} for S in (1, 2, 4, 10) if S != auto), suggested, *sweep):
                run_kw = {k: v for k, v in cfg.items() if k != "note"}
                ms = _bench(lambda: sparse_mla_attention(*args, **kw, **run_kw))
                rows.append(dict(kernel=f"sparse_attention/decode B={B} ctx={ctx}", config=cfg, ms=ms,
                                 gbs=nbytes / ms / 1e6, frac_copy_peak=nbytes / ms / 1e9 / COPY_TBS,
                                 floor_ms=nbytes / COPY_TBS / 1e9))
            del comp


def indexer_case(dev="cuda"):
    """The indexer's inputs at a 4,096-token chunk after 4,096 (ratio 1): (args, flops, visible groups N); the
    suite times the scores on them, tools/attention_before_after.py the top-k that follows."""
    T, start, ratio = 4096, 4096, 1
    b = _prefill_batch(T, start, ratio, dev)
    rpb = BLOCK_TOKENS // ratio
    N = (start + T) // ratio
    j = torch.arange(N, device=dev)
    seq_rows = (b["block_table"][0, j // rpb].long() * rpb + j % rpb)[None]
    keys = torch.randn(b["n_blocks"] * rpb, IDI, device=dev).bfloat16()
    q = torch.randn(T, IH, IDI, device=dev).bfloat16()
    w = (torch.randn(T, IH, device=dev) * 0.02).bfloat16()
    n_vis = (b["positions"] + 1) // ratio
    return (q, w, keys, seq_rows, b["seq_of"], n_vis), 2 * IH * IDI * float(n_vis.sum()), N


def bench_indexer(rows: list, sweep=(), dev="cuda"):
    from mini.kernels.indexer_scores import index_scores
    from mini.ops.indexer import index_scores as reference
    args, flops, _ = indexer_case(dev)
    configs = [{}, dict(tiles=1), dict(block_t=4, block_n=64), *sweep]  # {}: the model's call (tiles_per_program)
    for cfg in configs:
        ms = _bench(lambda: index_scores(*args, **cfg))
        rows.append(dict(kernel="indexer/scores", config=cfg, ms=ms, tflops=flops / ms / 1e9,
                         frac_gemm_peak=flops / ms / 1e9 / GEMM_TFLOPS))
    ms = _bench(_reference(lambda: reference(*args)))
    rows.append(dict(kernel="indexer/scores", config="torch reference", ms=ms, tflops=flops / ms / 1e9))


def bench_indexer_decode(rows: list, sweep=(), dev="cuda"):
    """The indexer's scores at decode: one row per sequence against all its groups, keys gathered from a shuffled
    pool; one key tile a program against the tile loop (`same`: bits against one tile). The byte floor: the keys
    read, the row map and the scores once. At 256 x 32K also `in order` (each sequence's blocks consecutive, as
    rank4-decode allocates them: the loop sped the shuffled call 1.6x and not that step, docs/perf/030) and
    `candidates` (V4.1's later index layers: half of the 8-group blocks kept; their keys alone are read)."""
    from mini.kernels.indexer_scores import index_scores, tiles_per_program
    cases = [(B, ctx, ratio, "shuffled") for B, ctx, ratio in ((1, 4096, 1), (64, 4096, 1), (64, 32768, 2),
                                                               (256, 4096, 1), (256, 32768, 2), (256, 32768, 1))]
    cases += [(256, 32768, 1, "in order"), (256, 32768, 1, "candidates")]
    for B, ctx, ratio, layout in cases:
        b = _decode_batch(B, ctx, dev)
        rpb, N = BLOCK_TOKENS // ratio, (ctx + 1) // ratio
        j = torch.arange(N, device=dev)
        table = b["block_table"] if layout == "shuffled" else torch.arange(b["n_blocks"], device=dev).view(B, -1)
        seq_rows = table[:, j // rpb].long() * rpb + j % rpb
        keys = torch.randn(b["n_blocks"] * rpb, IDI, device=dev).bfloat16()
        q = torch.randn(B, IH, IDI, device=dev).bfloat16()
        w = (torch.randn(B, IH, device=dev) * 0.02).bfloat16()
        args = (q, w, keys, seq_rows, b["seq_of"], (b["positions"] + 1) // ratio)
        read = N
        if layout == "candidates":  # half the 8-group blocks, drawn per sequence
            keep = torch.rand(B, -(-N // 8), device=dev).argsort(-1) < -(-N // 16)
            args += (keep.repeat_interleave(8, -1)[:, :N],)
            read = int(args[-1].sum()) / B
        nbytes = B * (read * IDI * 2 + N * (seq_rows.element_size() + 2 + (layout == "candidates")))
        one = index_scores(*args, tiles=1)
        auto = tiles_per_program(B + -(-B // 2), -(-N // 128))
        configs = [{"tiles": 1}, {"tiles": auto, "note": "tiles_per_program"}]
        if layout == "candidates":  # the model's call before: every visible key read, the mask applied after
            configs.append({"tiles": auto, "note": "all keys, masked after"})
        for cfg in configs + list(sweep):  # the tile counts', stages' and warps' study: docs/perf/030
            run_kw = {k: v for k, v in cfg.items() if k != "note"}
            call = lambda: index_scores(*args, **run_kw)
            if cfg.get("note") == "all keys, masked after":
                call = lambda: index_scores(*args[:-1], **run_kw).masked_fill_(~args[-1], float("-inf"))
            ms = _bench(call)
            same = float((call() == one).float().mean())
            rows.append(dict(kernel=f"indexer/decode B={B} ctx={ctx} ratio={ratio} {layout}", config=cfg, ms=ms,
                             gbs=nbytes / ms / 1e6, frac_copy_peak=nbytes / ms / 1e9 / COPY_TBS,
                             floor_ms=nbytes / COPY_TBS / 1e9, same=same))
            print(json.dumps(rows[-1]), flush=True)
        del keys, one


def bench_mhc(rows: list, sweep=(), dev="cuda"):
    """mhc_norm at one V4.1 site (delayed pre): the floor is h read once + y written once (~210 MB, ~49 us at the
    copy ceiling). The kernel itself moves h once, y three times (written by the split-K pass, read and written
    by the normalisation): `moved_tbs` counts those bytes."""
    from mini.kernels.mhc_norm import mhc_norm
    from mini.ops import mhc
    from mini.ops.norm import rms_norm
    T = 4096
    h = torch.randn(T, HC, DIM, device=dev).bfloat16()
    fn = torch.randn((2 + HC) * HC, HC * DIM, device=dev) * 0.01
    scale, base = torch.rand(3, device=dev), torch.randn((2 + HC) * HC, device=dev)
    nw = torch.rand(DIM, device=dev).bfloat16()
    pre_prev = torch.rand(T, HC, device=dev)
    kw = dict(pre_in=pre_prev, iters=20, hc_eps=1e-6, norm_eps=1e-20)
    nbytes = h.numel() * 2 + T * DIM * 2 + fn.numel() * 4  # h once, y once, fn once
    moved = nbytes + 2 * T * DIM * 2
    configs = [{}, *sweep]  # the defaults: block_t=64, block_k=16, split=8, 4 warps, 3 stages; finish 8 x 512
    for cfg in configs:
        for quant in ((None, "fp8") if cfg is configs[0] else (None,)):
            ms = _bench(lambda: mhc_norm(h, fn, scale, base, nw, **kw, quant=quant, **cfg))
            rows.append(dict(kernel=f"mhc_norm/quant={quant}", config=cfg or "default", ms=ms,
                             tbs=nbytes / ms / 1e9, frac_copy_peak=nbytes / ms / 1e9 / COPY_TBS,
                             moved_tbs=moved / ms / 1e9))
    ms = _bench(lambda: mhc_norm(h, fn, scale, base, nw, **dict(kw, pre_in=None)))
    rows.append(dict(kernel="mhc_norm/V4 own pre (h read twice)", config="default", ms=ms,
                     tbs=nbytes / ms / 1e9, frac_copy_peak=nbytes / ms / 1e9 / COPY_TBS))
    ms = _bench(lambda: mhc_norm(h, fn, scale, base, None, pre_in=None, iters=20, hc_eps=1e-6, norm_eps=1e-20,
                                 collapse=False))
    rows.append(dict(kernel="mhc_norm/mixes only", config="default", ms=ms, tbs=h.numel() * 2 / ms / 1e9,
                     frac_copy_peak=h.numel() * 2 / ms / 1e9 / COPY_TBS))
    ms = _bench(_reference(lambda: mhc.mixes(h, fn, scale, base, hc_mult=HC, iters=20, hc_eps=1e-6,
                                                norm_eps=1e-20)))
    rows.append(dict(kernel="mhc_norm/mixes only", config="torch reference", ms=ms, tbs=h.numel() * 2 / ms / 1e9))

    def ref():
        mhc.mixes(h, fn, scale, base, hc_mult=HC, iters=20, hc_eps=1e-6, norm_eps=1e-20)
        return rms_norm(mhc.collapse(h, pre_prev), nw, 1e-20)
    ms = _bench(_reference(ref))
    rows.append(dict(kernel="mhc_norm", config="torch reference", ms=ms, tbs=nbytes / ms / 1e9))


def _bench_graph(fn) -> float:
    """ms per call of a small kernel sequence, replayed in a CUDA graph as a decode step runs it (launch gaps but
    no host time). One eager call first fills the caches a capture must not (mhc_norm's fn pieces)."""
    import triton
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")


def bench_decode_gate(rows: list, sweep=(), dev="cuda"):
    """The gate at decode sizes, V4.1's shape (384 experts x D 5120, top 6; us per call in a CUDA graph, hot L2):
    the few-rows kernels in each candidate tiling (mini/kernels/moe_gate.py FEW_ROWS_CANDIDATES, "few rows <name>")
    against the unfused gate's torch ops (mini.ops.moe.gate_unfused: what a step runs where the few-rows path
    does not) and, at B = 1, 16, 64, the fused kernel; beyond 64 rows (verify steps, B = 128-256) the
    tensor-core tilings only. `ids_same`: the fraction of ids equal to the unfused gate's,
    `max_dw`: the largest weight difference (summation order only; a broken tiling shows here)."""
    import torch.nn.functional as F

    from mini.kernels.moe_gate import FEW_ROWS_CANDIDATES, few_rows_tiles, gate_topk
    gate_w = (torch.randn(384, DIM, device=dev) / DIM ** 0.5).bfloat16()
    gate_bias = torch.randn(384, device=dev) * 0.1
    # 96-1,023 rows: verify steps (B x 6) and decode at B = 128-256, between the decode sizes and the fused kernel's
    for B in (1, 2, 4, 8, 16, 32, 64, 96, 128, 256, 384, 1023):
        x = (torch.randn(B, DIM, device=dev) * 3).bfloat16()

        def gate_torch():  # the unfused gate's ops (mini.ops.moe.gate_unfused at V4.1)
            scores = F.softplus(x.float() @ gate_w.float().t()).sqrt()
            picked = (scores + gate_bias).topk(6, dim=-1).indices
            s = scores.gather(1, picked)
            return s / (s.sum(dim=-1, keepdim=True) + 1e-20) * 2.5, picked
        ref_w, ref_ids = gate_torch()
        runs = [("unfused (torch ops)", gate_torch)]
        if B in (1, 16, 64):
            runs.append(("fused", lambda: gate_topk(x, gate_w, gate_bias, 6, 2.5, eps=1e-20)))
        for name, tiles in FEW_ROWS_CANDIDATES.items():
            if B > 64 and not tiles.tensor_cores:  # the CUDA-core tilings take 4 rows a program: B / 4 row blocks
                continue
            runs.append((f"few rows {name}" + (" (by T)" if tiles == few_rows_tiles(B) else ""),
                         lambda t=tiles: gate_topk(x, gate_w, gate_bias, 6, 2.5, eps=1e-20, few_rows=t)))
        for label, f in runs:
            try:
                w, ids = f()
                ms = _bench_graph(f)
                row = dict(ms=ms, us=ms * 1e3, ids_same=(ids == ref_ids).float().mean().item(),
                           max_dw=(w - ref_w).abs().max().item())
            except Exception as e:  # a tiling that does not build here: its row says so, the others still run
                row = dict(error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row := dict(kernel=f"gate/B={B}", config=label, **row))
            print(json.dumps(row), flush=True)  # as it comes: a phase cut short by its cap keeps the rows so far
        # the verdict FEW_ROWS_GATE_MAX_TOKENS / FEW_ROWS_BY_TOKENS follow: the fastest tiling vs the unfused gate
        timed = [r for r in rows if r["kernel"] == f"gate/B={B}" and "us" in r]
        few = [r for r in timed if r["config"].startswith("few rows") and r["ids_same"] > 0.99]  # near-ties may differ
        if few and timed[0]["config"].startswith("unfused"):
            best = min(few, key=lambda r: r["us"])
            print(f"gate/B={B}: fastest {best['config']} {best['us']:.1f} us vs unfused "
                  f"{timed[0]['us']:.1f} us: {'faster' if best['us'] < timed[0]['us'] else 'slower'}", flush=True)


def bench_decode_small(rows: list, sweep=(), dev="cuda"):
    """Issue 28's decode-latency kernels at B = 1, 16, 64 (us per call in a CUDA graph; hot L2: one weight tensor per
    site here, where a model step reads each layer's own): first the gate's rows (`bench_decode_gate`, B = 1 to 64);
    the routing plan of T x 6 pairs for 96 of 384 experts (Humming's plan, no tiles; T up to 1,024: rank4 decode's
    B = 256, whose plan takes 4 x B tokens) in one program (the default up to 256 pairs; beyond 64 pairs also each
    `one_program_step`), the three kernels over pick_block's blocks (the default beyond) and over 1,024-pair blocks,
    and the torch sort; the mHC site input (V4.1, delayed pre, FP8 quant) at T = 1, 16, 64, 256, 384 with the tiles
    chosen by T against the 4,096-token tiles (64-token blocks x 8 chunks: the deterministic mode's at every T, the
    default's before issue 28), at B = 1 other split counts at the chosen block, from 256 rows other token blocks.
    `bits`: y elements that differ from the chosen tiles' (the mixes move in their last bits with the chunking; y
    follows them rarely). Then Engram's gate and update (mini/kernels/engram_gate.py) against its torch ops. Last,
    cuBLAS on V4.1's dense projection shapes against the decode GEMV (`bench_decode_gemv`)."""
    from mini.kernels.engram_gate import engram_gate
    from mini.kernels.mhc_norm import mhc_norm, partial_tiles
    from mini.kernels.moe_route import plan_routes, plan_routes_torch
    from mini.ops.engram import GATE_FLOOR, gated_update
    experts = range(96, 192)

    def add(row):  # printed as it comes: a phase cut short by its time cap keeps the rows so far
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)

    bench_decode_gate(rows, dev=dev)  # first: the gate's candidate tilings (`--only decode_gate` runs them alone)

    fn = torch.randn((2 + HC) * HC, HC * DIM, device=dev) * 0.01
    scale, base = torch.rand(3, device=dev), torch.randn((2 + HC) * HC, device=dev)
    nw = torch.rand(DIM, device=dev).bfloat16()
    for T in (1, 16, 24, 64, 256, 1024):  # 24: the B = 1 verify step (4 emulated ranks x 6 rows)
        ids = torch.rand(T, 384, device=dev).argsort(dim=1)[:, :6]
        weights = torch.rand(T, 6, device=dev)
        plans = {"one program": dict(one_program=True), "three kernels, pick_block": dict(one_program=False),
                 "three kernels, 1,024-pair blocks": dict(one_program=False, block=1024),
                 **{f"one program, {sub} pairs a step, {w} warps": dict(one_program=True, one_program_step=(sub, w))
                    for sub, w in ((64, 4), (128, 8), (256, 8), (256, 16)) if T * 6 > 64 and sub // 2 < T * 6}}
        for label, kw in plans.items():
            ms = _bench_graph(lambda: plan_routes(ids, weights, experts, 128, False, **kw))
            add(dict(kernel=f"route_plan/T={T} pairs={T * 6}", config=label, ms=ms, us=ms * 1e3))
        ms = _bench_graph(lambda: plan_routes_torch(ids, weights, experts, 128, False))
        add(dict(kernel=f"route_plan/T={T} pairs={T * 6}", config="torch sort", ms=ms, us=ms * 1e3))
    for B in (1, 16, 64, 256, 384):
        h = torch.randn(B, HC, DIM, device=dev).bfloat16()
        kw = dict(pre_in=torch.rand(B, HC, device=dev), iters=20, hc_eps=1e-6, norm_eps=1e-20, quant="fp8")
        nbytes = h.numel() * 2 + B * DIM * 2 + fn.numel() * 6  # h, y, fn's three bf16 pieces once
        chosen = partial_tiles(B, DIM, 16, invariant=False)
        base_y = mhc_norm(h, fn, scale, base, nw, **kw)[0]
        configs = [{"note": f"by T {chosen}"}, {"invariant": True, "note": "4,096-token tiles (64 x 8)"},
                   *({"block_t": chosen[0], "split": s} for s in (40, 80, 320) if B == 1),
                   # from 256 rows each 64-token block re-reads fn's pieces: larger blocks read them fewer times
                   *({"block_t": t, "split": s} for t, s in ((128, 80), (256, 160), (32, 20)) if B >= 256),
                   *sweep]
        for cfg in configs:
            run_kw = {k: v for k, v in cfg.items() if k != "note"}
            ms = _bench_graph(lambda: mhc_norm(h, fn, scale, base, nw, **kw, **run_kw))
            y = mhc_norm(h, fn, scale, base, nw, **kw, **run_kw)[0]
            add(dict(kernel=f"mhc_norm/decode T={B}", config=cfg, ms=ms, us=ms * 1e3, gbs=nbytes / ms / 1e6,
                     bits=int((y != base_y).sum())))
    gw = torch.randn(HC, DIM, device=dev)  # Engram's gate + update (mini/kernels/engram_gate.py) against its torch ops
    for B in (1, 16, 64):
        h, kv = torch.randn(B, HC, DIM, device=dev).bfloat16(), torch.randn(B, (HC + 1) * DIM, device=dev).bfloat16()
        for label, f in (("triton", lambda: engram_gate(h, kv, gw, 1e-20, GATE_FLOOR)),
                         ("torch reference", _reference(lambda: gated_update(h, kv, gw, 1e-20)))):
            ms = _bench_graph(f)
            add(dict(kernel=f"engram_gate/decode T={B}", config=label, ms=ms, us=ms * 1e3))
    bench_decode_gemv(rows, dev=dev)  # last: the dense projections (`--only decode_gemv` runs them alone)


def bench_decode_gemv(rows: list, sweep=(), dev="cuda"):
    """The dense projections at decode (issue 28 item 3; us per call in a CUDA graph): cuBLAS on V4.1's projection
    shapes at B = 1, 6, 16, 64 against their weight bytes' floor (L2 defeated), and at B <= 16 the decode GEMV
    (mini/kernels/gemv.py) in each of its candidate tilings on the same weight copies (`same_as_cublas`: the
    fraction of outputs equal to cuBLAS's bits), then an FP8 weight's linear as it runs: the activation quant pass +
    cuBLAS against the GEMV with the quant in its loads."""
    import torch.nn.functional as F

    from mini.kernels.device_info import sm_count
    from mini.kernels.fp8_act_quant import fp8_act_quant
    from mini.kernels.gemv import CANDIDATES as GEMV_CANDIDATES
    from mini.kernels.gemv import MAX_ROWS as GEMV_MAX_ROWS
    from mini.kernels.gemv import gemv, split_k

    def add(row):  # printed as it comes: a phase cut short by its time cap keeps the rows so far
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)

    # item 3's measurement: cuBLAS on the dense projections' dequantized bf16 weights at decode row counts,
    # against the weight bytes' floor; copies of each weight in turn (>= 128 MB in all), so L2 does not hold it
    for n_out, n_in, name in ((1280, 5120, "wq_a"), (32768, 1280, "wq_b"), (512, 5120, "wkv"),
                              (5120, 8192, "wo_b"), (4608, 5120, "shared w1|w3"), (5120, 2304, "shared w2"),
                              (4096, 1280, "indexer wq_b"), (1024, 5120, "compressor wkv|wgate")):
        weight = torch.randn(n_out, n_in, device=dev).bfloat16()
        copies = [weight] + [weight.clone() for _ in range((128 << 20) // weight.nbytes)]
        floor_ms = weight.nbytes / COPY_TBS / 1e9
        for B in (1, 6, 16, 64):  # 6: a B = 1 verify step's rows (DSpark's draft: 5)
            x = torch.randn(B, n_in, device=dev).bfloat16()
            turn = [0]

            def linear():
                turn[0] = (turn[0] + 1) % len(copies)
                return F.linear(x, copies[turn[0]])
            ms = _bench_graph(linear)
            add(dict(kernel=f"dense_gemm/{name} [{n_out},{n_in}] B={B}", config="cuBLAS bf16", ms=ms, us=ms * 1e3,
                     floor_ms=floor_ms, frac_copy_peak=floor_ms / ms))
            if B > GEMV_MAX_ROWS:
                continue
            cublas = F.linear(x, weight)
            for label, cfg in GEMV_CANDIDATES.items():  # the decode GEMV's tilings on the same copies
                def gemv_call(cfg=cfg):
                    turn[0] = (turn[0] + 1) % len(copies)
                    return gemv(x, copies[turn[0]], config=cfg)
                ms = _bench_graph(gemv_call)
                pieces = split_k(n_out, n_in, cfg, sm_count(x.device))[0]
                add(dict(kernel=f"dense_gemm/{name} [{n_out},{n_in}] B={B}", config=f"gemv {label} split {pieces}",
                         ms=ms, us=ms * 1e3, floor_ms=floor_ms, frac_copy_peak=floor_ms / ms,
                         same_as_cublas=float((gemv(x, weight, config=cfg) == cublas).float().mean())))

            # what linear runs for an FP8 weight: the act quant pass + cuBLAS against the GEMV with the quant in its
            # loads, and the act quant pass + the GEMV without it, in each tiling
            def quant_cublas():
                turn[0] = (turn[0] + 1) % len(copies)
                return F.linear(fp8_act_quant(x, 32), copies[turn[0]])

            def quant_gemv(cfg, fused):
                def call():
                    turn[0] = (turn[0] + 1) % len(copies)
                    if fused:
                        return gemv(x, copies[turn[0]], config=cfg, act_block=32)
                    return gemv(fp8_act_quant(x, 32), copies[turn[0]], config=cfg)
                return call
            quant_rows = [("fp8 act quant + cuBLAS", quant_cublas)]
            for label, cfg in GEMV_CANDIDATES.items():
                quant_rows += [(f"gemv {label}, act quant fused", quant_gemv(cfg, True)),
                               (f"fp8 act quant + gemv {label}", quant_gemv(cfg, False))]
            for label, f in quant_rows:
                ms = _bench_graph(f)
                add(dict(kernel=f"dense_gemm/{name} [{n_out},{n_in}] B={B}", config=label, ms=ms, us=ms * 1e3,
                         floor_ms=floor_ms, frac_copy_peak=floor_ms / ms))
        del copies, weight


def bench_decode_gemv_fp8(rows: list, sweep=(), dev="cuda"):
    """An FP8 projection read as stored (MINI_GEMV_WEIGHTS=fp8) against the GEMV on its bf16 copy (the tuned build),
    act quant fused, us per call in a CUDA graph, copies taken in turn (L2 defeated); `frac_copy_peak` in each
    read's own bytes. B = 1: the one-row FP8 read on the CUDA cores, each candidate; B = 6 and 16 (a B = 1 verify
    step's rows, the GEMV's most): the tensor-core FP8 read, each candidate, with `same_as_copy` (the share of
    outputs equal to the copy's GEMV) and `max_rel_err` (largest |difference| over the sum of |products|); and the
    same read given x's FP8 codes (FP8Rows: "x codes"), alone and after the quant pass that writes them."""
    from mini.formats import dequant_fp8, quantize_fp8
    from mini.kernels.fp8_act_quant import FP8Rows, fp8_act_quant, fp8_act_quant_wire
    from mini.kernels.gemv import MMA_CANDIDATES, MMA_DEFAULT, MMA_REGISTERS, ROW_CANDIDATES, config_for, gemv
    for n_out, n_in, name in ((1792, 5120, "wq_a|wkv"), (36864, 1280, "wq_b|indexer wq_b"), (5120, 8192, "wo_b"),
                              (4608, 5120, "shared w1|w3"), (5120, 2304, "shared w2"), (1024, 5120, "compressor")):
        q, scale = quantize_fp8(torch.randn(n_out, n_in, device=dev) / n_in ** 0.5, 32)
        wb = dequant_fp8(q, scale, 32, torch.bfloat16)
        copies = {"bf16": [wb] + [wb.clone() for _ in range((128 << 20) // wb.nbytes)],
                  "fp8": [(q, scale)] + [(q.clone(), scale.clone()) for _ in range((128 << 20) // q.nbytes)]}
        floor = {"bf16": wb.nbytes / COPY_TBS / 1e9, "fp8": (q.nbytes + scale.nbytes) / COPY_TBS / 1e9}
        for B in (1, 6, 16):
            x, turn = torch.randn(B, n_in, device=dev).bfloat16(), [0]
            runs = [("bf16", "bf16 copy, tuned", config_for(n_out, n_in))]
            runs += [("fp8", f"fp8 read, {label}", cfg)
                     for label, cfg in (ROW_CANDIDATES if B == 1 else MMA_CANDIDATES).items()]
            if B > 1:  # x's codes given: the read alone, and with the pass that writes them
                runs += [(kind, f"fp8 read of {kind}, {label}", cfg) for kind in ("x codes", "quant + x codes")
                         for label, cfg in MMA_CANDIDATES.items() if cfg in (MMA_DEFAULT, MMA_REGISTERS)]
            x_codes = FP8Rows(torch.empty(B, n_in, dtype=torch.uint8, device=dev),
                              torch.empty(B, n_in // 32, dtype=torch.uint8, device=dev), 32, torch.bfloat16)
            fp8_act_quant_wire(x, 32, x_codes.codes, x_codes.scales)
            copy_y = gemv(x, wb, act_block=32)
            spread = fp8_act_quant(x, 32).float().abs() @ wb.float().abs().T
            for kind, label, cfg in runs:
                def call(kind=kind, cfg=cfg):
                    held = copies["bf16" if kind == "bf16" else "fp8"]
                    turn[0] = (turn[0] + 1) % len(held)
                    w = held[turn[0]]
                    if kind == "bf16":
                        return gemv(x, w, config=cfg, act_block=32)
                    if kind == "fp8":
                        return gemv(x, w[0], config=cfg, act_block=32, scale=w[1], w_block=32)
                    if kind == "quant + x codes":
                        fp8_act_quant_wire(x, 32, x_codes.codes, x_codes.scales)
                    return gemv(x_codes, w[0], config=cfg, scale=w[1], w_block=32)
                ms = _bench_graph(call)
                y = gemv(x, wb, config=cfg, act_block=32) if kind == "bf16" else \
                    gemv(x, q, config=cfg, act_block=32, scale=scale, w_block=32) if kind == "fp8" else \
                    gemv(x_codes, q, config=cfg, scale=scale, w_block=32)
                rows.append(dict(kernel=f"decode_gemv_fp8/{name} [{n_out},{n_in}] B={B}", config=label, ms=ms,
                                 us=ms * 1e3, floor_ms=floor["bf16" if kind == "bf16" else "fp8"],
                                 frac_copy_peak=floor["bf16" if kind == "bf16" else "fp8"] / ms,
                                 same_as_copy=float((y == copy_y).float().mean()),
                                 max_rel_err=float(((y.float() - copy_y.float()).abs() / spread).max())))
                print(json.dumps(rows[-1]), flush=True)
        del copies, q, scale, wb


def bench_rope(rows: list, sweep=(), dev="cuda"):
    from mini.formats import fake_quant_fp8
    from mini.kernels.rope_quant import rope_quant
    from mini.ops.norm import rms_norm
    from mini.ops.rope import apply_rope, rope_frequencies, rope_table
    T = 4096
    table = rope_table(torch.arange(T, device=dev) + 4096, rope_frequencies(64, 160000.0, 65536, 16.0))
    q = torch.randn(T, H, D, device=dev).bfloat16()
    kv = torch.randn(T, D, device=dev).bfloat16()
    nw = torch.rand(D, device=dev).bfloat16()
    for name, fn, ref, nbytes in [
        ("rope_quant/q rope", lambda: rope_quant(q, table), lambda: apply_rope(q, table), 2 * q.numel() * 2),
        ("rope_quant/kv norm+rope+fp8", lambda: rope_quant(kv, table, norm_weight=nw, eps=1e-20, quant="fp8"),
         lambda: fake_quant_fp8(apply_rope(rms_norm(kv, nw, 1e-20), table), 32), 2 * kv.numel() * 2)]:
        for label, f in (("triton", fn), ("torch reference", _reference(ref))):
            ms = _bench(f)
            rows.append(dict(kernel=name, config=label, ms=ms, tbs=nbytes / ms / 1e9,
                             frac_copy_peak=nbytes / ms / 1e9 / COPY_TBS))


def bench_norm(rows: list, sweep=(), dev="cuda"):
    """RMSNorm (mini/kernels/rms_norm.py) against the torch op: 4,096 rows (bandwidth) and one decode row, replayed
    in a CUDA graph as a decode step runs it (launches and gaps: the torch op is ~6 kernels)."""
    from mini.formats import fake_quant_fp8
    from mini.kernels.rms_norm import rms_norm
    from mini.ops.norm import rms_norm as reference
    for T, D in ((4096, 5120), (4096, 1280), (1, 5120), (1, 1280)):
        x = torch.randn(T, D, device=dev).bfloat16()
        w = torch.rand(D, device=dev).bfloat16()
        nbytes = 2 * x.numel() * 2
        timer = _bench if T > 1 else _bench_graph
        for label, f in (("triton", lambda: rms_norm(x, w, 1e-20)),
                         ("triton +fp8", lambda: rms_norm(x, w, 1e-20, "fp8")),
                         ("torch reference", _reference(lambda: reference(x, w, 1e-20))),
                         ("torch reference +fp8", _reference(lambda: fake_quant_fp8(reference(x, w, 1e-20), 32)))):
            ms = timer(f)
            rows.append(dict(kernel=f"rms_norm/[{T},{D}]", config=label, ms=ms, tbs=nbytes / ms / 1e9,
                             frac_copy_peak=nbytes / ms / 1e9 / COPY_TBS))


def bench_order_keys(rows: list, sweep=(), dev="cuda"):
    """The indexer top-k's integer keys (mini/kernels/order_keys.py) against their torch form (seven kernels),
    replayed in a CUDA graph: decode rows (launches and gaps) and a prefill-sized step (bandwidth: 2 bytes read, 4
    written per score)."""
    from mini.kernels.order_keys import order_keys
    from mini.ops.indexer import _order_keys as reference
    for T, N in ((1, 1024), (64, 8192), (4096, 4096)):
        x = torch.randn(T, N, device=dev).bfloat16()
        nbytes = x.numel() * (2 + 4)
        for label, f in (("triton", lambda: order_keys(x)), ("torch reference", _reference(lambda: reference(x)))):
            ms = _bench_graph(f)
            rows.append(dict(kernel=f"order_keys/[{T},{N}]", config=label, ms=ms, us=ms * 1e3,
                             tbs=nbytes / ms / 1e9, frac_copy_peak=nbytes / ms / 1e9 / COPY_TBS))


def bench_top_ids(rows: list, sweep=(), dev="cuda"):
    """The index top-k's ids in one pass (mini/kernels/top_ids.py) against the torch form of the same rule (order
    keys, topk, gather, where, sort, where, count), replayed in a CUDA graph: decode rows at 4K and 32K context (k
    512) and a prefill-sized step; the kernel in its 1,024- and 4,096-column builds. "span" rows: a
    step's rows as the model has them, the span's columns (a 4K context in the 16K span: 4,096) with -inf past
    each row's visible ones (1,025), where the op gives the kernel n_visible ("bounded": it reads only those), in
    both builds ("wide": 4,096 columns) and with each other search of the k-th key than the default's ("radix r":
    mini/kernels/top_ids.py's RADIX_BITS), and split across programs by 4,096-column chunks ("split", a candidate)."""
    from mini.kernels.top_ids import BLOCK, MERGE_MAX, RADIX_BITS, RADIXES, WIDE_BLOCK, top_ids
    from mini.ops.indexer import top_groups_ordered
    # (2,048 and 4,096 columns: V4.1-Flash's ratio-2 and ratio-1 sources at 4K, unbounded)
    shapes = [(T, N, None) for T, N in ((1, 1024), (1, 2048), (1, 4096), (1, 8192), (64, 1024), (64, 4096),
                                        (64, 8192), (4096, 1024))]
    # (V4.1's ratio-1 sources in the 16K span: 16,384 columns, an 8K context's 8,193 visible, a 16K context's all;
    # in the 64K span, which takes the torch form (top_ids.WIDE_MAX_COLS), its ratio-2 sources' 32,768 columns (a
    # 32K context's 16,385 visible, a 64K context's all) and its ratio-1 sources' 65,536 (a 32K context's 32,769))
    shapes += [(T, 4096, 1025) for T in (1, 6, 96, 384, 4096)] + [(T, 16384, 8193) for T in (1, 6, 64, 256)]
    shapes += [(T, 16384, 16384) for T in (1, 256)] + [(T, 32768, 16385) for T in (1, 64, 256)]
    shapes += [(T, 32768, 32768) for T in (1, 64, 256)] + [(T, 65536, 32769) for T in (1, 256)]
    for T, N, vis in shapes:
        x = torch.randn(T, N, device=dev).relu().bfloat16()  # relu: ties at 0, as the index scores have
        n_vis = None
        if vis is not None:
            x[:, vis:] = float("-inf")
            n_vis = torch.full((T,), vis, dtype=torch.int64, device=dev)
        runs = [("triton", lambda: top_ids(x, 512)),
                (f"triton, {WIDE_BLOCK}-column chunks", lambda: top_ids(x, 512, block=WIDE_BLOCK)),
                ("torch reference", _reference(lambda: top_groups_ordered(x, 512)))]
        if n_vis is not None:  # both builds bounded (the op takes the 4,096-column one up to WIDE_MAX_ROWS rows)
            runs[1:1] = [(f"triton, bounded{', wide' * (b == WIDE_BLOCK)}{f', radix {r}' * (r != RADIX_BITS)}",
                          lambda b=b, r=r: top_ids(x, 512, block=b, n_visible=n_vis, radix=r))
                         for b in (BLOCK, WIDE_BLOCK) for r in (RADIX_BITS,) + tuple(q for q in RADIXES
                                                                                    if q != RADIX_BITS)]
            if -(-N // WIDE_BLOCK) * 512 <= MERGE_MAX:  # the split candidate: chunks across programs
                runs.insert(1, ("triton, bounded, split", lambda: top_ids(x, 512, block=WIDE_BLOCK, n_visible=n_vis,
                                                                          split=True)))
        for label, f in runs:
            ms = _bench_graph(f)
            name = f"top_ids/[{T},{N}]" + (f" span, {vis} visible" if vis is not None else "") + " k=512"
            rows.append(dict(kernel=name, config=label, ms=ms, us=ms * 1e3))


def bench_dspark_markov(rows: list, sweep=(), dev="cuda"):
    """DSpark's Markov chain at V4.1-Flash's shape (V 129,280, r 256): five sequential steps of a draft, each the
    [B, r] x [V, r]^T bias on the bf16 head (head_logits), its add to the position's base logits and the greedy
    pick; us for the five in a CUDA graph (the head rotated past L2): torch's add + argmax against mini.ops.greedy's
    one pass (mini/kernels/add_argmax.py). `frac_copy_peak`: the bytes the five picks must move (base and bias read,
    logits written) over the copy rate. `same`: the fraction of ids equal between the two forms."""
    from mini.kernels.add_argmax import add_argmax
    from mini.ops.linear import head_logits
    V, r = 129280, 256
    heads = [(torch.randn(V, r, device=dev) / r ** 0.5).bfloat16() for _ in range(4)]
    picks = {"torch add + argmax": lambda a, b, out: torch.add(a, b, out=out).argmax(-1),
             "add_argmax (one pass)": add_argmax}
    for B in (1, 64):
        e, base = torch.randn(5, B, r, device=dev).bfloat16(), torch.randn(B, 5, V, device=dev)
        logits, ids = torch.empty_like(base), {}
        for label, pick in picks.items():
            def five(pick=pick):
                return torch.stack([pick(base[:, i], head_logits(e[i], heads[i % 4]), logits[:, i])
                                    for i in range(5)])
            ids[label] = five()
            ms = _bench_graph(five)
            rows.append(dict(kernel=f"dspark_markov/B={B} V={V} r={r} x5", config=label, ms=ms, us=ms * 1e3,
                             frac_copy_peak=5 * 3 * B * V * 4 / COPY_TBS / 1e9 / ms))
            print(json.dumps(rows[-1]), flush=True)
        rows[-1]["same"] = float((ids[next(iter(picks))] == ids[label]).float().mean())


BENCHES = {"attention": bench_attention, "attention_decode": bench_attention_decode, "indexer": bench_indexer,
           "indexer_decode": bench_indexer_decode,
           "mhc": bench_mhc, "rope": bench_rope, "norm": bench_norm,
           "decode_small": bench_decode_small, "decode_gate": bench_decode_gate, "decode_gemv": bench_decode_gemv,
           "decode_gemv_fp8": bench_decode_gemv_fp8,
           "order_keys": bench_order_keys, "top_ids": bench_top_ids, "dspark_markov": bench_dspark_markov}
# the studies beside them: tools/attention_before_after.py, flashmla_core.py


def add_args(parser: argparse.ArgumentParser, benches: dict = BENCHES) -> None:
    parser.add_argument("--only", nargs="*", choices=list(benches), default=list(benches))


def run(args, benches: dict = BENCHES) -> dict:
    torch.manual_seed(0)
    rows: list = []
    for name in args.only:
        try:
            benches[name](rows)
        except Exception as e:  # one failing kernel must not hide the others' numbers
            rows.append(dict(kernel=name, error=f"{type(e).__name__}: {e}"[:300]))
        print("\n".join(json.dumps(r) for r in rows[-8:]), flush=True)
    metrics = {f"{r['kernel']}|{r.get('config')}|ms": r["ms"] for r in rows if "ms" in r}
    return {"suite": "kernels", "definition": {"device": torch.cuda.get_device_name(), "tokens": 4096},
            "metrics": metrics, "rows": rows}


def main(argv=None, benches: dict = BENCHES, prog: str | None = None) -> None:
    """Run `benches` (default: the suite's) and print a table: `python -m mini.bench.kernels`, and the studies of
    tools/ (mhc_split.py, attention_before_after.py, flashmla_core.py, kernel_tile_sweep.py)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_args(parser, benches)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    res = run(args, benches)
    print(f"\n{'kernel':44s} {'config':58s} {'ms':>8s}  rate")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['kernel']:44s} ERROR {r['error']}")
            continue
        rate = " ".join(f"{k}={r[k]:.3g}" for k in ("us", "tflops", "frac_gemm_peak", "tbs", "gbs", "frac_hbm_peak",
                                                     "frac_copy_peak", "floor_ms", "moved_tbs", "gathered_tbs",
                                                     "max_token_rel_err_vs_triton") if k in r)
        rate += f" bits={r['bits']}" if "bits" in r else ""
        print(f"{r['kernel']:44s} {str(r['config'])[:58]:58s} {r.get('ms', float('nan')):8.4f}  {rate}")
    if args.json:
        from mini.testing.suites import environment, write_result
        write_result(args.json, {**res, "env": environment()})


if __name__ == "__main__":
    main()
