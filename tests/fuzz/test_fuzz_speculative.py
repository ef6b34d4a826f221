"""Speculative decoding on configs nobody chose (issue 27). For each seed: a random valid config
(tests/fuzz/configs.py: V4.1 and V4, windows of 4-64 keys, often shorter than a verify chunk of 1 + K rows,
compress ratios 2, 4 and 128, Engram, hash layers) with random weights, and a random cache block size, draft
length K, token budget (prefill chunks in the same steps as verify chunks), cache size (tight ones preempt) and
prompt lengths (window wraps, ratio groups and blocks crossed at random places). The oracle drafter
(mini/testing/oracle_drafter.py) proposes the plain run's own continuation, wrong at a random position per proposal,
so accept lengths 0..K all occur. Greedy or seeded sampling (top-p and a repetition penalty at random): the
speculative run's tokens and logprobs must equal plain decode's bit for bit (CPU reference backend, fp32, the
engine's deterministic mode: a row's numbers do not depend on its step's rows, nor a prompt's chunks on the other
requests). Verification keeps only the target's tokens, so every mismatch here is state that speculation left
wrong. Its first run found one (mini.ops.attention.sparse_attention: a verify chunk's last softmax block was
narrower than a decode step's, and rounded otherwise on the CPU)."""
import random
from collections.abc import Iterable

import pytest
import torch
from configs import describe, random_config
from harness import build

import mini.ops
from mini.engine import LLM, SamplingParams
from mini.testing.oracle_drafter import OracleDrafter

SEEDS = [300, 301, 302, 303, 304, 305]


def _prompts(rng: random.Random, vocab: int, lengths: Iterable[int]) -> list[list[int]]:
    """Random prompts of 1 + lengths[i] tokens with distinct first tokens (the oracle finds a sequence's prompt by
    its prefix); `lengths` is read as the prompts are drawn (a generator may draw them from `rng` in turn)."""
    return [[3 + i] + [rng.randrange(3, vocab) for _ in range(n)] for i, n in enumerate(lengths)]


def _case(seed: int):
    """The config, engine options, prompts, sampling and draft length of one seed."""
    rng = random.Random(seed)
    cfg = random_config(seed)
    k = rng.randint(1, 6)
    block_tokens = max(rng.choice([4, 8, 16, 32]), *cfg.compress_ratios)  # powers of two: every ratio divides it
    w = cfg.window_size
    prompts = _prompts(rng, cfg.vocab_size, (rng.randint(0, 2 * w + 9) for _ in range(3)))
    sampled = rng.random() < 0.5  # seeded sampling: a draft is accepted where it is the target's own seeded draw
    params = SamplingParams(temperature=rng.choice([0.6, 1.0]) if sampled else 0, seed=rng.randrange(1 << 20),
                            top_p=rng.choice([1.0, 0.9]), repetition_penalty=rng.choice([1.0, 1.2]),
                            max_tokens=rng.randint(8, 14), ignore_eos=True, logprobs=2)
    need = [-(-(len(p) + params.max_tokens + k + 1) // block_tokens) for p in prompts]
    tight = rng.random() < 0.3  # room for the longest sequence and a block: the others wait or are preempted
    # The engine's deterministic mode: each prompt's prefill chunks are fixed by the budget alone, so both runs cut
    # them alike (speculation's verify rows would otherwise move them on configs whose chunked prefill rounds
    # otherwise than whole prefill).
    opts = dict(device="cpu", dtype=torch.float32, block_tokens=block_tokens, spec_adaptive=False,
                num_blocks=max(need) + 1 if tight else sum(need) + 4, deterministic=True,
                enable_prefix_caching=False, max_num_seqs=4, max_num_batched_tokens=rng.choice([8, 16, 64, 2048]))
    return cfg, opts, prompts, params, k


def _plain_and_speculative(model, cfg, opts, prompts, params, k, plan_seed: int):
    """(plain decode's outputs, speculation's with the oracle, the speculating engine's stats)."""
    rng = random.Random(plan_seed)
    llm = LLM(model, config=cfg, **opts)
    plain = llm.generate(prompts, params)
    llm.engine.close()  # the engine's deterministic mode ends with it
    futures = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    drafter = OracleDrafter(futures, [rng.randint(0, k) for _ in range(17)], cfg.vocab_size, k)
    llm = LLM(model, config=cfg, drafter=drafter, spec_tokens=k, **opts)
    spec = llm.generate(prompts, params)
    llm.engine.close()
    return plain, spec, llm.engine.stats


def _assert_same(plain, spec, case: str):
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain], case
    assert [[(lp.logprob, lp.top) for lp in o.logprobs] for o in spec] == \
        [[(lp.logprob, lp.top) for lp in o.logprobs] for o in plain], case


@pytest.mark.parametrize("seed", SEEDS)
def test_speculation_equals_plain_decode_on_random_configs(seed):
    cfg, opts, prompts, params, k = _case(seed)
    plain, spec, stats = _plain_and_speculative(build(cfg, "cpu", torch.float32, seed), cfg, opts, prompts, params,
                                                k, seed + 1)
    case = f"seed {seed}: {describe(cfg)}; K {k}, {opts}, prompts of {[len(p) for p in prompts]}"
    _assert_same(plain, spec, case)
    lengths = stats.spec.accept_lengths
    assert sum(n > 0 for n in lengths) >= min(k + 1, 3), (lengths, case)  # several accept lengths ran


@pytest.fixture
def splits(monkeypatch) -> list[tuple[int, bool]]:
    """Each call of the deterministic mode's split (attend_by_chunk_kind): (its prefill rows, whether the step held
    verify chunks)."""
    from mini.kernels import flashmla_attention as fm
    seen, split = [], fm.attend_by_chunk_kind

    def spy(inp, key_rows, *args):
        out = split(inp, key_rows, *args)
        seen.append((key_rows.multi_token[0], key_rows.verify is not None and bool(key_rows.verify.any())))
        return out
    monkeypatch.setattr(fm, "attend_by_chunk_kind", spy)
    return seen


def test_verify_chunks_keep_decode_rows_beside_flashmla_prefill_interpreter(monkeypatch, splits):
    """The gpu test below on the CPU: the fast path under Triton's interpreter, FlashMLA's per-row stand-in
    (mini/testing/flashmla_stand_in.py) for prefill chunks, --deterministic, a random config our kernels take
    (seed 306: V4.1, 3 layers, 6 heads x 128, a ratio-2 layer, Engram). Steps hold prefill chunks beside verify
    chunks, and speculation equals plain decode bit for bit. With the verify mark dropped (`key_rows.verify =
    None` in the spy) these very runs' logprobs differ (checked once, docs/perf/028; two more engine runs, ~80 s,
    are not repeated here)."""
    from mini.testing import flashmla_stand_in
    if torch.cuda.is_available():
        pytest.skip("interpreter test: the gpu test below runs FlashMLA itself here")
    flashmla_stand_in.install(monkeypatch.setattr)
    mini.ops.set_backend("fast", interpret_on_cpu=True)  # the conftest gives the backend back
    cfg = random_config(306)
    prompts = _prompts(random.Random(306), cfg.vocab_size, [6, 30, 45])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    opts = dict(device="cpu", dtype=torch.bfloat16, block_tokens=16, spec_adaptive=False, num_blocks=64,
                deterministic=True, enable_prefix_caching=False, max_num_seqs=4, max_num_batched_tokens=20,
                enforce_eager=True)
    plain, spec, _ = _plain_and_speculative(build(cfg, "cpu", torch.bfloat16, 306), cfg, opts, prompts, params, 3,
                                            307)
    _assert_same(plain, spec, describe(cfg))
    assert any(n > 0 and verify for n, verify in splits), splits  # a step held prefill rows and verify chunks


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [12, 39])  # random_config(seed, big=True) with FlashMLA's 64 heads x 512
def test_speculation_equals_plain_decode_at_flashmla_shapes_gpu(seed, monkeypatch, splits):
    """--deterministic on the H200 at FlashMLA's attention shape, bf16, the fast path: prefill chunks take FlashMLA,
    decode rows our kernel, and verify chunks, in steps beside prefill chunks too (eager), our kernel as the decode
    steps they stand for (mini.kernels.flashmla_attention.attend_by_chunk_kind): speculation equals plain decode bit
    for bit."""
    from mini.kernels import flashmla_attention as fm
    if not fm.available():
        pytest.skip("needs FlashMLA's SM90 kernels on an H200")
    monkeypatch.setenv("MINI_SPARSE_ATTN", "flashmla")
    cfg = random_config(seed, big=True)
    prompts = _prompts(random.Random(seed), cfg.vocab_size, [20, 130, 200])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    opts = dict(device="cuda", dtype=torch.bfloat16, block_tokens=16, spec_adaptive=False, num_blocks=64,
                deterministic=True, enable_prefix_caching=False, max_num_seqs=4, max_num_batched_tokens=64)
    plain, spec, _ = _plain_and_speculative(build(cfg, "cuda", torch.bfloat16, seed), cfg, opts, prompts, params, 5,
                                            seed + 1)
    _assert_same(plain, spec, f"seed {seed}: {describe(cfg)}")
    assert any(n > 0 and verify for n, verify in splits), splits  # a step held prefill rows and verify chunks
