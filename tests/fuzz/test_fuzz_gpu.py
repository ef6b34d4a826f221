"""The config fuzzer on the GPU: N_CONFIGS random configs (configs.random_config(seed, big=True)), each checked
per op, per layer and end to end (prefill, chunked prefill, decode) by harness.check_config, fast vs reference
in bf16. Every fifth seed and every config with V4.1-Flash's attention shape (64 heads x 512) prefills 1,100
tokens, where the fused MoE gate (from 1,024 tokens) and FlashMLA (that shape, from 512 tokens) take over. The
seed, config and result of each config are printed and, with MINI_FUZZ_LOG=path, appended there as one JSON line
(scripts/gpu.sh phase_fuzz sums the kernels that ran)."""
import json
import os
from pathlib import Path

import pytest

from configs import random_config
from harness import check_config

N_CONFIGS = 32


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(N_CONFIGS))
def test_fast_matches_reference_gpu(seed):
    cfg = random_config(1000 + seed, big=True)
    long = seed % 5 == 0 or (cfg.n_heads, cfg.head_dim) == (64, 512)  # FlashMLA serves from 512 tokens
    prompt, chunks = (1100, (600, 1, 499)) if long else (80, (33, 1, 30, 16))
    report = check_config(1000 + seed, cfg, "cuda", prompt=prompt, chunks=chunks, decode=4)
    print(report.summary())
    failures = report.failures()
    log = os.environ.get("MINI_FUZZ_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"seed": 1000 + seed, "config": report.config, "ok": not failures,
                                "failures": failures[:10], "kernels": report.kernels, "e2e": report.e2e,
                                "ops": len(report.ops), "seconds": round(report.seconds, 1)}) + "\n")
    assert report.ops, "no dispatched op ran"
    assert not failures, "\n".join([report.summary()] + failures)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["f0", "f1", "f2"])
def test_fast_matches_reference_on_official_fixtures(name):
    """The same three levels on the official-reference fixtures' checkpoints (tests/fixtures/v41_reference: widths
    our presets never used), their prompt and greedy ids (the fast path vs mini's reference; against the official
    logits: tests/parity, scripts/gpu.sh phase_fidelity)."""
    import numpy as np

    from mini.config import ModelConfig
    from mini.model import load_model
    root = Path(__file__).resolve().parents[1] / "fixtures" / "v41_reference" / name
    with np.load(root / "reference.npz") as z:
        prompt_ids, greedy = z["prompt_ids"].tolist(), z["greedy_ids"].tolist()
    n, decode = len(prompt_ids), 4
    chunks = (n // 2, 1, n - n // 2 - 1)

    def make_model(dtype):
        return load_model(root, "cuda", dtype)[0]
    cfg = ModelConfig.load(root)
    report = check_config(0, cfg, "cuda", prompt=n, chunks=chunks, decode=decode, make_model=make_model,
                          tokens=prompt_ids + greedy[:decode])
    print(name, report.summary())
    assert report.ops and not report.failures(), "\n".join([report.summary()] + report.failures())
