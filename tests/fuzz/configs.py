"""Random valid V4.1 and V4 model configurations from a seed, for the fast-vs-reference fuzzer.

"Valid" means what the model's definition needs (ModelConfig.validate plus the widths its fake quantization and
linear layers divide into blocks), NOT what our kernels happen to take: widths, head and RoPE dims, windows and
index sizes are drawn from small lists that include values the kernels cannot take (non-powers of two, windows
that are not whole key tiles), so the fuzzer also checks that the fast path refuses or falls back there instead of
computing garbage. Lists are short so that many configs share Triton's compiled kernels (each distinct constexpr
compiles once per process and is cached on disk).
"""
from __future__ import annotations

import random

from mini.config import TINY_V4, TINY_V41, ModelConfig
from mini.ops.engram import engram_layout


def v41_schedule(rng: random.Random, n_layers: int) -> dict:
    """compress_ratios (0, 1, 2) with KV / index / candidate sources as the V4.1 rules have them (validate and the
    official configs): a compressed layer reads the newest KV source at or below it, which must have its ratio, so
    the first layer of a run of one ratio is a KV source (later ones may be too); every KV source is an index
    source, other compressed layers may be; a candidate source is an index source whose later index sources score
    groups of its ratio (their scores are masked by its candidate blocks)."""
    first = rng.randint(0, 2)
    ratios = [0 if i < first else rng.choice([0, 1, 2, 2]) for i in range(n_layers)]
    kv, index = [], []
    for i, r in enumerate(ratios):
        if r == 0:
            continue
        newest = max(kv, default=None)
        if newest is None or ratios[newest] != r or rng.random() < 0.25:
            kv.append(i)
            index.append(i)
        elif rng.random() < 0.3:
            index.append(i)
    ok = [s for s in index if all(ratios[t] == ratios[s] for t in index if t > s)]
    cand = rng.choice(ok) if ok and rng.random() < 0.7 else -1
    return dict(compress_ratios=tuple(ratios), kv_source_layers=tuple(kv), index_source_layers=tuple(index),
                candidate_source_layer=cand)


def random_config(seed: int, big: bool = False) -> ModelConfig:
    """A valid config for `seed`. `big` (GPU runs) allows wider models, more layers and V4.1-Flash's attention
    shape (64 heads x 512, RoPE 64: the FlashMLA and real-size kernel paths)."""
    rng = random.Random(seed)
    v41 = rng.random() < 0.7
    block = 32 if v41 else 128
    dim = rng.choice([128, 256] if v41 else [128, 256]) if not big else rng.choice([128, 256, 384, 512])
    if v41 and not big and rng.random() < 0.3:
        dim = 64
    if big and v41 and rng.random() < 0.15:  # V4.1-Flash's attention core
        n_heads, head_dim, rope = 64, 512, 64
    else:
        head_dim = rng.choice([64, 96, 128] if not big else [64, 96, 128, 192, 256, 512])
        if v41:
            rope = rng.choice([r for r in (16, 24, 32, 64) if r < head_dim])
        else:  # V4 quantizes the nope part in 1x64 blocks and keeps RoPE 64
            head_dim, rope = rng.choice([128, 192] if not big else [128, 192, 512]), 64
        n_heads = rng.choice([2, 4, 8, 6] if not big else [4, 8, 16, 12, 64])
    o_groups = rng.choice([g for g in (1, 2, 4) if n_heads % g == 0])
    o_lora = rng.choice([32, 64] if v41 else [128])
    q_lora = rng.choice([32, 64, 96] if v41 else [128, 256])
    n_layers = rng.randint(3, 6 if not big else 8)
    n_experts = rng.choice([4, 8, 12, 16])
    top_k = rng.randint(1, min(6, n_experts))
    inter = rng.choice([32, 64, 96, 128] if v41 else [128, 256])
    if big:
        inter = rng.choice([128, 256, 384] if v41 else [128, 256])
    window = rng.choice([4, 8, 16, 24, 64] if not big else [8, 16, 100, 128])
    index_heads = rng.choice([2, 4, 3, 8])
    if v41:
        index_dim = rng.choice([32, 64, 96])
        if index_dim <= rope:
            index_dim = rope + 32
    else:  # Hadamard rotation: a power of two
        index_dim = 128
    index_topk = rng.choice([4, 8, 16, 24])
    kw = dict(vocab_size=rng.choice([256, 512]), dim=dim, n_layers=n_layers, n_heads=n_heads, head_dim=head_dim,
              rope_head_dim=rope, q_lora_rank=q_lora, o_groups=o_groups, o_lora_rank=o_lora, window_size=window,
              index_n_heads=index_heads, index_head_dim=index_dim, index_topk=index_topk,
              n_routed_experts=n_experts, n_activated_experts=top_k, moe_inter_dim=inter,
              route_scale=rng.choice([1.0, 1.5, 2.5]), swiglu_limit=rng.choice([0.0, 10.0]),
              hc_mult=rng.choice([4, 4, 4, 2, 3]), fp8_block=block, max_position_embeddings=4096,
              original_seq_len=rng.choice([0, 256]), rope_factor=4.0)
    if v41:
        sched = v41_schedule(rng, n_layers)
        blocks = rng.choice([2, 3, 8])
        size = rng.choice([1, 2, 4, 8])
        blocks = max(blocks, -(-index_topk // size))  # the candidates must cover index_topk groups
        kw.update(sched, candidate_topk_blocks=blocks, candidate_block_size=size)
        if rng.random() < 0.6:  # Engram
            layers = tuple(sorted(rng.sample(range(n_layers), rng.randint(1, min(2, n_layers)))))
            kw.update(engram_layer_ids=layers, engram_vocab_size=rng.choice([100, 300]),
                      engram_max_ngram_size=rng.choice([2, 3, 4]), engram_n_heads=rng.choice([1, 2]),
                      engram_head_dim=32, engram_compressed_vocab_size=rng.choice([100, 200]))
            probe = TINY_V41.replace(**kw, engram_num_embeddings=(1,) * len(layers))
            kw["engram_num_embeddings"] = engram_layout(probe).num_embeddings
        else:
            kw.update(engram_layer_ids=(), engram_num_embeddings=())
        return TINY_V41.replace(**kw)
    ratios = tuple(0 if i < rng.randint(0, 2) else rng.choice([0, 4, 128]) for i in range(n_layers))
    kw.update(compress_ratios=ratios, n_hash_layers=rng.randint(0, min(2, n_layers)),
              score_func=rng.choice(["sqrtsoftplus", "sqrtsoftplus", "sigmoid", "softmax"]), norm_eps=1e-6)
    return TINY_V4.replace(**kw)


def describe(cfg: ModelConfig) -> str:
    """One line with the fields a failing seed is judged by."""
    return (f"{cfg.version} dim {cfg.dim} layers {cfg.n_layers} ratios {list(cfg.compress_ratios)} heads "
            f"{cfg.n_heads}x{cfg.head_dim} rope {cfg.rope_head_dim} W {cfg.window_size} q_lora {cfg.q_lora_rank} "
            f"o {cfg.o_groups}x{cfg.o_lora_rank} experts {cfg.n_routed_experts} top {cfg.n_activated_experts} "
            f"inter {cfg.moe_inter_dim} index {cfg.index_n_heads}x{cfg.index_head_dim} top {cfg.index_topk} "
            f"kv {list(cfg.kv_source_layers)} idx {list(cfg.index_source_layers)} cand "
            f"{cfg.candidate_source_layer}:{cfg.candidate_topk_blocks}x{cfg.candidate_block_size} hc {cfg.hc_mult} "
            f"engram {list(cfg.engram_layer_ids)} block {cfg.fp8_block} score {cfg.score_func}")
