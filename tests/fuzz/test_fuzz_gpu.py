"""The config fuzzer on the GPU: N_CONFIGS random configs (configs.random_config(seed, big=True)), each checked
per op, per layer and end to end (prefill, chunked prefill, decode) by harness.check_config, fast vs reference
in bf16. Every fifth seed and every config with V4.1-Flash's attention shape (64 heads x 512) prefills 1,100
tokens, where the fused MoE gate (from 1,024 tokens) and FlashMLA (that shape, from 512 tokens) take over. The
seed, config and result of each config are printed and, with MINI_FUZZ_LOG=path, appended there as one JSON line
(scripts/gpu.sh phase_fuzz sums the kernels that ran)."""
import json
import os

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
