"""The config fuzzer on CPU: the fast path's Triton kernels under Triton's interpreter (bf16 as on the GPU,
mini/kernels/interpreter.py) against the reference, per op, and end to end over chunked prefill + decode, on a few
small random configs (harness.py says what is compared and why the bounds are what they are). Each config takes
~20 s in the interpreter; the GPU run (test_fuzz_gpu.py) covers 30+ configs at larger sizes with every level."""
import pytest

from configs import random_config
from harness import check_config

# a ratio-2 V4.1 model on the kernels; one falling back (head 96, RoPE 24); V4 (ratios 128, 4 with its indexer)
SEEDS = [7, 4, 26]


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_fast_matches_reference_interpreted(seed, fast_on_cpu):
    cfg = random_config(seed)
    cfg = cfg.replace(n_layers=min(cfg.n_layers, 3), compress_ratios=cfg.compress_ratios[:3],
                      **_cut_sources(cfg, 3))
    report = check_config(seed, cfg, "cpu", prompt=10, chunks=(6, 4), decode=2, layers=False,
                          modes=("chunked_decode",))
    print(report.summary())
    assert report.ops, "no dispatched op ran"
    assert not report.failures(), "\n".join([report.summary()] + report.failures())


def _cut_sources(cfg, n: int) -> dict:
    """The V4.1 source lists and Engram layers of the first n layers."""
    if cfg.version != "v4.1":
        return dict(n_hash_layers=min(cfg.n_hash_layers, n))
    idx = tuple(s for s in cfg.index_source_layers if s < n)
    engram = tuple(i for i in cfg.engram_layer_ids if i < n)
    keep = [j for j, i in enumerate(cfg.engram_layer_ids) if i < n]
    return dict(kv_source_layers=tuple(s for s in cfg.kv_source_layers if s < n), index_source_layers=idx,
                candidate_source_layer=cfg.candidate_source_layer if cfg.candidate_source_layer in idx else -1,
                engram_layer_ids=engram, engram_num_embeddings=tuple(cfg.engram_num_embeddings[j] for j in keep))
