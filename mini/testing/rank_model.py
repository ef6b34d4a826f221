"""One EP rank's model at a preset's real shape with random weights, for the suites and checks that measure or
compare a rank without a checkpoint (rank4, rank4-decode, long-context, ep-prefill, `mini check ep-exact` and
`fastpath`, tools/det_profile.py) and for the tests: the model holding only its rank's experts (stacked in place,
so the build's peak is one copy), its prefill batch and cache, a stand-in Engram hasher, Engram tables at real row
width in page-locked host memory, and the layer schedule that keeps every layer kind in fewer layers.
"""
from __future__ import annotations

import time

import torch

from mini.config import ModelConfig, preset
from mini.testing.emulated_ep import ROUTINGS, EmulatedEP

SCHEDULE = "tiny-v4.1"  # the preset whose 8 layers hold every V4.1 layer kind


def layer_config(name: str, layers: int) -> ModelConfig:
    """Preset `name` with `layers` layers holding every layer kind (`SCHEDULE`'s, its last compression ratio
    repeated); 0 keeps its own."""
    from mini.testing.suites import SuiteError
    base = preset(name)
    if layers == 0:
        return base
    s = preset(SCHEDULE)
    if layers < s.n_layers:
        raise SuiteError(f"ep-prefill: --layers must be 0 or >= {s.n_layers} (every layer kind)")
    extra = layers - s.n_layers
    return base.replace(
        n_layers=layers, compress_ratios=s.compress_ratios + (s.compress_ratios[-1],) * extra,
        kv_source_layers=s.kv_source_layers, index_source_layers=s.index_source_layers,
        candidate_source_layer=s.candidate_source_layer, engram_layer_ids=s.engram_layer_ids)


def host_engram_tables(cfg: ModelConfig, rows: int, seed: int, fill_device,
                       pin_tables: bool = True) -> tuple[list, dict]:
    """Per Engram layer, (fp8 values [rows, head_dim] as float8_e4m3fn, E8M0 scales [rows, head_dim / 32] as
    float8_e8m0fnu) in host memory, page-locked in place where CUDA is (mini.model.engram_host.pin), and what the
    setup took. The rows are drawn as `random_state` draws Engram rows (standard normal values, one power-of-two scale
    per 32 values of a row), on `fill_device` in chunks copied back: far faster than drawing 50 GB on the CPU."""
    from mini.formats import float_to_e8m0, pow2_ceil_scale
    from mini.formats.fp8 import FP8_MAX, to_e4m3
    from mini.model.engram_host import pin
    hd, block = cfg.engram_head_dim, 32
    fill_device = torch.device(fill_device)
    info = {"alloc_s": 0.0, "pin_s": 0.0, "fill_s": 0.0, "pinned": True}
    tables = []
    chunk = 1 << 21
    for j, _ in enumerate(cfg.engram_layer_ids):
        t0 = time.perf_counter()
        vals = torch.empty((rows, hd), dtype=torch.uint8)
        scales = torch.empty((rows, hd // block), dtype=torch.uint8)
        t1 = time.perf_counter()
        # filled while still pageable, page-locked after: on the H200 (36c16dc) the first device-to-host copy into
        # a table registered before the fill failed with 'CUDA error: invalid argument'
        g = torch.Generator(device=fill_device).manual_seed(seed * 7919 + j)
        for a in range(0, rows, chunk):
            x = torch.randn((min(rows, a + chunk) - a, hd // block, block), generator=g, device=fill_device)
            scale = pow2_ceil_scale(x.abs().amax(-1).clamp_min(1e-30) / FP8_MAX)
            vals[a:a + x.shape[0]].copy_(to_e4m3(x / scale.unsqueeze(-1)).flatten(-2).view(torch.uint8))
            scales[a:a + x.shape[0]].copy_(float_to_e8m0(scale).view(torch.uint8))
        if fill_device.type == "cuda":
            torch.cuda.synchronize(fill_device)
        t2 = time.perf_counter()
        info["pinned"] &= pin_tables and pin(vals) & pin(scales)
        t3 = time.perf_counter()
        info["alloc_s"] += t1 - t0
        info["fill_s"] += t2 - t1
        info["pin_s"] += t3 - t2
        tables.append((vals.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)))
    info["gb"] = sum(v.numel() + s.numel() for v, s in tables) / 1e9
    return tables, info


def host_memory_available() -> int | None:
    """Bytes of host memory available (Linux MemAvailable), or None where /proc/meminfo is not there."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def restack_experts(state: dict, cfg: ModelConfig, experts: range) -> dict:
    """Move each layer's routed-expert tensors into one [E_local, ...] buffer per tensor name, leaving views in
    `state` (returned). MoEWeights.from_state then uses the buffers as they are; without this the experts would
    exist twice while the model is built (2 x 72 GB at V4.1-Flash EP4). One tensor is copied at a time."""
    for i in range(cfg.n_layers):
        for proj in ("w1", "w3", "w2"):
            for leaf in ("weight", "scale"):
                names = [f"layers.{i}.ffn.experts.{e}.{proj}.{leaf}" for e in experts]
                first = state[names[0]]
                buf = torch.empty((len(names), *first.shape), dtype=first.dtype, device=first.device)
                for j, n in enumerate(names):
                    buf[j].copy_(state[n])
                    state[n] = buf[j]  # the drawn tensor is freed here
    return state


def hasher_of(cfg: ModelConfig):
    """An Engram hasher with a stand-in token map: any map onto the compressed vocabulary gives the same work (the
    real one needs the real tokenizer)."""
    if not cfg.engram_layer_ids:
        return None
    import numpy as np
    from mini.ops.engram import EngramHasher
    return EngramHasher(cfg, np.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size)


def rank_model(cfg: ModelConfig, device, dtype, seed: int, experts: range, engram_rows: int | None, moe_exchange):
    """A model with random weights drawn on `device`, holding only `experts` (one EP rank), stacked in place."""
    from mini.checkpoint import random_state
    from mini.model import Model
    state = restack_experts(random_state(cfg, device, seed, experts=experts, engram_rows=engram_rows), cfg, experts)
    # consumed: experts rewritten into new buffers (Humming's w1|w3 stack) free the old ones layer by layer, not
    # at the end of the build (40 layers x 1.2 GB)
    return Model(cfg, state, device, dtype, moe_exchange=moe_exchange, experts=experts, consume_state=True)


def prefill_batch(cfg: ModelConfig, tokens: list[list[int]], device, dtype, block_tokens: int,
                  engram_rows: int | None):
    """(Batch, KVCache) of one prefill step from position 0 over the sequences `tokens`, each in its own slot."""
    from mini.model import Batch, KVCache
    from mini.model.batch import SeqChunk
    nb = -(-max(len(t) for t in tokens) // block_tokens)
    chunks = [SeqChunk(t, 0, i, list(range(i * nb, (i + 1) * nb))) for i, t in enumerate(tokens)]
    batch = Batch.build(chunks, cfg, device, hasher_of(cfg))
    if batch.engram is not None and engram_rows:
        batch.engram.data = batch.engram.data % engram_rows  # hash ids -> the capped tables' rows
    return batch, KVCache(cfg, len(tokens), len(tokens) * nb, block_tokens, device, dtype)


def add_emulated_rank_args(p) -> None:
    """The flags of `emulated_rank`'s build beside --preset and --ep, for the suites built on it (rank4-decode,
    long-context)."""
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--engram-rows", type=int, default=1 << 20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routing", choices=ROUTINGS, default="uniform")


def emulated_rank(args, config: ModelConfig | None = None) -> tuple[ModelConfig, "EmulatedEP", object, float]:
    """The model of one emulated EP rank (rank 0 of `args.ep`) at `config` (default: `args.preset`), on the fast
    backend where CUDA is: (config, exchange, model, build seconds). The suites that decode or prefill through it
    build their own caches."""
    import mini.ops
    from mini.checkpoint import expert_range
    cfg = config or preset(args.preset)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda":
        mini.ops.set_backend("fast")
    check_backends()
    t0 = time.perf_counter()
    experts = expert_range(cfg, 0, args.ep)
    exchange = EmulatedEP(args.ep, args.seed, args.routing, experts)
    model = rank_model(cfg, device, dtype, args.seed, experts, args.engram_rows, exchange)
    return cfg, exchange, model, time.perf_counter() - t0


def check_backends(suite: str = "rank4") -> None:
    """Resolve the library switches now, before the model is built: a library its variable forces
    (MINI_MOE_GEMM=humming, MINI_SPARSE_ATTN=flashmla) that cannot run here is a SuiteError naming what is missing
    (`mini bench` exits 2), not a run on other kernels under the same name."""
    from mini.testing.suites import SuiteError
    from mini.ops import backends
    try:
        backends.resolve()
    except (RuntimeError, ValueError) as e:
        raise SuiteError(f"{suite}: {e} ({_missing()})") from None


def _missing() -> str:
    """What the forced libraries lack here: the GPU generation, or the import's own error."""
    import importlib

    from mini import switches
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"the GPU is SM{''.join(map(str, torch.cuda.get_device_capability()))}, the libraries need SM90"
    out = []
    asked = switches.current()  # MINI_MOE_GEMM, MINI_SPARSE_ATTN
    for want, module, wheel in ((asked.moe_gemm, "humming", "humming_kernels"),
                                (asked.sparse_attn, "flash_mla", "sgl_flash_mla")):
        if want in ("humming", "flashmla"):
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001 - the reason is the message
                out.append(f"import {module}: {type(e).__name__}: {e}; carry the {wheel} wheel (.whl/gpu)")
    return "; ".join(out) or "see the message"
