"""Speculative decoding (mini/engine/speculative.py, docs/engine.md "DSpark speculative decoding") on the real
tiny-v4.1 model, CPU, fp32, under the kernels' deterministic mode (mini.ops.deterministic_mode: every GEMM row its
own product on the CPU, so a row's logits do not depend on how many rows its step has, and a verify chunk's rows
equal the decode steps they replace bit for bit).

The drafter here is an oracle: it proposes the target's own future tokens (from a plain run) with an error at a
planned position, cycling through every accept length 0..K, so the tests reach each length and each cache edge
(a prompt of 118 crosses the 128-slot window ring's wrap while decoding; blocks of 16 and the ratio-2 groups are
crossed many times) and compare tokens and logprobs with plain decode bit for bit: alone, among other sequences
with prefill chunks in the same steps, under preemption, after a prefix-cache hit, and sampled with seeds."""
import pytest
import torch

from mini.engine import LLM, SamplingParams
from mini.engine.speculative import accept
from mini.testing.oracle_drafter import OracleDrafter

K = 5
PLAN = [0, 1, 2, 3, 4, 5, 2, 5, 1]  # accept lengths the oracle aims for, in turn
PROMPTS = [[5 + (7 * i + 3 * j) % 500 for j in range(n)] for i, n in enumerate([3, 12, 118])]
OPTS = dict(device="cpu", dtype=torch.float32, block_tokens=16)


def _generate(prompts, params, drafter=None, **opts):
    llm = LLM("tiny-v4.1", **{**OPTS, "num_blocks": 64, **opts}, drafter=drafter,
              spec_tokens=K if drafter is not None else None)
    return llm.generate(prompts, params), llm.engine


def _same(got, want):
    """Tokens, finish and logprobs (float ==: bit for bit) of two runs' outputs."""
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert [[(lp.logprob, lp.top) for lp in o.logprobs] for o in got] == \
        [[(lp.logprob, lp.top) for lp in o.logprobs] for o in want]


GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def plain(kernels_deterministic):
    outs, _ = _generate(PROMPTS, GREEDY)
    return outs


def _oracle(outs, plan=PLAN):
    return OracleDrafter({tuple(p): o.token_ids for p, o in zip(PROMPTS, outs)}, plan, 512)


def test_accept_is_the_longest_matching_prefix():
    assert accept([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accept([1, 2, 3], [1, 5, 3, 4]) == 1
    assert accept([7], [1, 2]) == 0
    assert accept([], [4]) == 0


def test_greedy_among_load_equals_plain_decode_bitwise(plain):
    # a budget of 24 tokens: the 118-token prompt is prefilled in chunks beside the others' verify chunks; every
    # draft as long as the oracle's plan (the acceptance rule would cut the plan's long drafts after its misses)
    outs, engine = _generate(PROMPTS, GREEDY, _oracle(plain), max_num_batched_tokens=24, spec_adaptive=False)
    _same(outs, plain)
    lengths = engine.stats.spec.accept_lengths
    assert len(lengths) == K + 1 and all(n > 0 for n in lengths), lengths  # every accept length 0..K happened
    assert engine.stats.spec.accepted_tokens == sum(a * n for a, n in enumerate(lengths))


def test_greedy_alone_equals_plain_decode_bitwise(plain):
    outs, engine = _generate(PROMPTS[2:], GREEDY, _oracle(plain, plan=[3, 0, 5, 1, 4, 2]))
    _same(outs, plain[2:])
    assert engine.stats.steps < 14  # fewer steps than tokens: drafts were taken


def test_preemption_mid_speculation_equals_plain_decode(plain):
    # 2 blocks of 16 positions for two sequences admitted with one each, that need 1 and 2: the second is
    # preempted as it grows (a verify chunk's drafts grow it too) and recomputed once the first is done
    outs, engine = _generate(PROMPTS[:2], GREEDY, _oracle(plain), num_blocks=2, enable_prefix_caching=False)
    _same(outs, plain[:2])
    assert engine.stats.preemptions > 0


def test_prefix_cache_hit_then_speculation_equals_plain_decode(plain):
    prompts = [PROMPTS[2][:16] + PROMPTS[0], PROMPTS[2][:16] + PROMPTS[1][:2]]
    ref, _ = _generate(prompts, GREEDY, enable_prefix_caching=False)
    drafter = OracleDrafter({tuple(p): o.token_ids for p, o in zip(prompts, ref)}, PLAN, 512)
    # one at a time: the second restores the snapshot the first left at 16 (rings, compressor state)
    outs, engine = _generate(prompts, GREEDY, drafter, max_num_seqs=1, snapshot_prompt_end=True)
    assert [o.num_cached_tokens for o in outs] == [0, 16]
    _same(outs, ref)


def test_seeded_sampling_penalties_and_stops_equal_plain_decode(kernels_deterministic):
    """Seeded draws, a repetition penalty, a logit bias and min_tokens' hold are applied to every verify row with
    the drafts before it in the history; a stop token or a stop string inside an accepted run ends the output
    there (text and tokens as plain decode's)."""
    params = [SamplingParams(temperature=0.9, seed=7, max_tokens=12, logprobs=1, repetition_penalty=1.3,
                             logit_bias={17: 3.0}, min_tokens=4),
              SamplingParams(temperature=0.7, seed=3, max_tokens=12, presence_penalty=0.5, frequency_penalty=0.4)]
    ref, _ = _generate(PROMPTS[:2], params)
    stop_at = ref[1].token_ids[6]
    params[1].stop_token_ids = [stop_at]
    text = ref[0].text
    assert len(text) >= 10, text
    params[0].stop = [text[6:9]]  # a stop string: where it first occurs, maybe across tokens
    ref, _ = _generate(PROMPTS[:2], params)
    assert ref[1].finish_reason == "stop" and len(ref[1].token_ids) <= 7
    assert ref[0].finish_reason == "stop" and ref[0].stop_reason == text[6:9]
    drafter = OracleDrafter({tuple(p): o.token_ids for p, o in zip(PROMPTS, ref)}, [5, 5, 2, 5], 512)
    outs, engine = _generate(PROMPTS[:2], params, drafter)
    _same(outs, ref)
    assert [o.text for o in outs] == [o.text for o in ref]
    assert engine.stats.spec.accepted_tokens > 0


# ------------------------------------------------------------------------------------------- DSpark as the drafter
class Recording:
    """Wraps a drafter and records each draft it proposes with the end of the cache it was made at."""

    def __init__(self, drafter):
        self.drafter, self.max_draft, self.min_confidence, self.drafts = drafter, drafter.max_draft, 0.0, []

    def propose(self, cache, commits):
        out = self.drafter.propose(cache, commits)
        self.drafts += [(c.end, d) for c, d in zip(commits, out) if d]
        return out

    def static_draft(self, static, cache):
        return None  # drafts on the host only (`propose`)


def test_dspark_drafts_are_mini_logits_dspark_drafts(kernels_deterministic, tmp_path):
    """Greedy speculation with DSpark (tiny-v4.1-dspark, random weights: its drafts are rarely right) gives plain
    decode's output, and every draft it proposes after a decode step is the one `mini logits --dspark` records for
    that step (the f4 order: the step's features into the rings, then a draft anchored on the next token), cut at
    its first position whose sigmoid(confidence) is below --spec-min-confidence and to the room the request has
    left."""
    import numpy as np

    from mini.cli import main
    prompt, params = PROMPTS[1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    opts = dict(OPTS, num_blocks=16)
    plain = LLM("tiny-v4.1-dspark", **opts).generate([prompt], params)
    tokens = plain[0].token_ids
    assert main(["logits", "--model", "tiny-v4.1-dspark", "--device", "cpu", "--dtype", "float32",
                 "--ids", ",".join(map(str, prompt)), "--force-tokens", ",".join(map(str, tokens)), "--dspark",
                 "--out", str(tmp_path / "l.npz")]) == 0
    ref = np.load(tmp_path / "l.npz")  # row n: the draft after feeding tokens[n]
    sure = 1 / (1 + np.exp(-ref["dspark_confidence"].astype(np.float64)))
    levels = np.unique(sure)
    threshold = float(levels[len(levels) // 2 - 1:len(levels) // 2 + 1].mean())  # between two of them: no tie
    # the acceptance rule off: the random module's drafts are rarely taken, and the rule would stop them
    spec = LLM("tiny-v4.1-dspark", **opts, speculative="dspark", spec_min_confidence=threshold, spec_adaptive=False)
    spec.engine.spec.drafter = recording = Recording(spec.engine.spec.drafter)
    _same(spec.generate([prompt], params), plain)
    after_decode = [(end, d) for end, d in recording.drafts if end > len(prompt)]
    assert after_decode
    cut_short = 0
    for end, draft in after_decode:
        n = end - len(prompt) - 1
        confident = int(np.cumprod(sure[n] >= threshold).sum())
        room = min(K, params.max_tokens - (end + 1 - len(prompt)) - 1)
        assert draft == ref["dspark_draft_ids"][n][:min(confident, room)].tolist(), end
        cut_short += confident < room
    assert cut_short > 0  # the threshold did cut some drafts


def test_dspark_rings_follow_overlapped_plain_steps(kernels_deterministic, tmp_path):
    """Steps in which nobody drafts are plain decode's, overlapped (as on graphs) and without a draft forward, but
    DSpark's rings still take each step's rows. Three sequences under a load rule of 5 rows: while all three decode
    nobody drafts (cap 0), then the last one drafts 4 tokens a step; each of its drafts is the one `mini logits
    --dspark` records at that step (a ring missing a plain step's row changes them), and every output is plain
    decode's."""
    import numpy as np

    from mini.cli import main
    prompts = [PROMPTS[0], [9, 8, 7, 6, 5], PROMPTS[1]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (16, 18, 30)]
    opts = dict(OPTS, num_blocks=32)
    plain = LLM("tiny-v4.1-dspark", **opts).generate(prompts, params)
    long_prompt, long_out = prompts[2], plain[2].token_ids
    assert main(["logits", "--model", "tiny-v4.1-dspark", "--device", "cpu", "--dtype", "float32",
                 "--ids", ",".join(map(str, long_prompt)), "--force-tokens", ",".join(map(str, long_out)),
                 "--dspark", "--out", str(tmp_path / "l.npz")]) == 0
    ref = np.load(tmp_path / "l.npz")["dspark_draft_ids"]  # row n: the draft after feeding output n
    spec = LLM("tiny-v4.1-dspark", **opts, speculative="dspark", overlap=True, spec_max_rows=5,
               spec_adaptive=False, spec_tokens=4)
    drafter, drafts = spec.engine.spec.drafter, []

    def propose(cache, commits):
        out = type(drafter).propose(drafter, cache, commits)
        drafts.extend((c.end, d) for c, d in zip(commits, out) if d and c.history()[:len(long_prompt)] == long_prompt)
        return out
    drafter.propose = propose
    _same(spec.generate(prompts, params), plain)
    stats = spec.engine.stats
    assert stats.spec.plain_steps >= 14 and stats.overlapped_steps >= stats.spec.plain_steps - 1, stats
    late = [(end, d) for end, d in drafts if end - len(long_prompt) > 16]
    assert late and all(len(d) == 4 for _, d in late[:-3]), drafts  # full drafts after the plain steps
    for end, draft in late:
        assert draft == ref[end - len(long_prompt) - 1][:len(draft)].tolist(), end


def test_a_model_without_dspark_refuses_speculation():
    with pytest.raises(ValueError, match="no DSpark draft module"):
        LLM("tiny-v4.1", **OPTS, num_blocks=8, speculative="dspark")


def test_metrics_report_drafted_and_accepted_tokens(plain):
    from mini.server.metrics import ServerMetrics
    _, engine = _generate(PROMPTS[:1], GREEDY, _oracle(plain, plan=[2, 5]))
    text = ServerMetrics(engine).render()
    spec = engine.stats.spec
    assert f"mini_spec_draft_tokens_total {spec.drafted_tokens}" in text and spec.drafted_tokens > 0
    assert f"mini_spec_accepted_tokens_total {spec.accepted_tokens}" in text
    assert f'mini_spec_acceptance_length_bucket{{le="+Inf"}} {sum(spec.accept_lengths)}' in text
    assert f"mini_spec_acceptance_length_sum {spec.accepted_tokens}" in text
    # every step that ran a forward counted once by kind, with its host time: verify steps from the prompt's on
    # (its token anchors a draft), a plain one at the end (no room left for a draft), no prefill without a verify
    steps, seconds = engine.stats.kind_steps, engine.stats.kind_seconds
    assert steps.get("verify", 0) > 1 and "prefill" not in steps, steps
    assert sum(steps.values()) == engine.stats.steps and all(seconds[k] > 0 for k in steps), seconds
    assert f'mini_steps_total{{kind="verify"}} {steps["verify"]}' in text and 'mini_steps_total{kind="prefill"} 0' in text
    assert f'mini_step_seconds_total{{kind="verify"}} {round(seconds["verify"], 6)}' in text


def test_grammar_rows_follow_the_matcher_over_the_drafts(kernels_deterministic):
    """A JSON-schema grammar: each verify row's mask is the matcher's after the drafts before it (then rolled
    back); greedy and seeded outputs equal plain decode's, drafts are accepted."""
    from mini.server.grammars import json_grammar
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 4}},
              "required": ["n", "s"], "additionalProperties": False}
    params = [SamplingParams(temperature=0, max_tokens=30, grammar=json_grammar(schema)),
              SamplingParams(temperature=0.8, seed=5, max_tokens=30, grammar=json_grammar(schema))]
    ref, _ = _generate(PROMPTS[:2], params)
    drafter = OracleDrafter({tuple(p): o.token_ids for p, o in zip(PROMPTS, ref)}, [5, 1, 5, 3], 512)
    outs, engine = _generate(PROMPTS[:2], params, drafter)
    _same(outs, ref)
    assert engine.stats.spec.accepted_tokens > 0


def test_generate_refuses_speculation_without_dspark(capsys):
    from mini.cli import main
    assert main(["generate", "--model", "tiny-v4.1", "--device", "cpu", "--prompt", "hi", "--max-tokens", "2",
                 "--speculative", "dspark"]) == 2
    assert "no DSpark draft module (mtp.* weights)" in capsys.readouterr().err


@pytest.mark.gpu
def test_speculation_on_cuda_equals_plain_decode_gpu(kernels_deterministic):
    """The eager speculative path on CUDA (bf16, the fast backend, the deterministic kernels): the oracle's and
    DSpark's speculation give plain decode's tokens and logprobs, plain decode run eagerly and on CUDA graphs with
    overlap (scripts/gpu/serving.sh phase_spec_gpu)."""
    opts = dict(device="cuda", dtype=torch.bfloat16, block_tokens=16, num_blocks=64)
    plain = LLM("tiny-v4.1-dspark", **opts).generate(PROMPTS, GREEDY)
    eager = LLM("tiny-v4.1-dspark", **opts, enforce_eager=True).generate(PROMPTS, GREEDY)
    _same(eager, plain)
    oracle = OracleDrafter({tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}, PLAN, 512)
    # the acceptance rule off, as in test_greedy_among_load_equals_plain_decode_bitwise: it would cut the plan's
    # long drafts after its misses, and this test asks for every accept length 0..K
    spec = LLM("tiny-v4.1-dspark", **opts, drafter=oracle, spec_tokens=K, max_num_batched_tokens=24,
               spec_adaptive=False)
    _same(spec.generate(PROMPTS, GREEDY), plain)
    lengths = spec.engine.stats.spec.accept_lengths
    assert len(lengths) == K + 1 and all(n > 0 for n in lengths), lengths
    dspark = LLM("tiny-v4.1-dspark", **opts, speculative="dspark")
    _same(dspark.generate(PROMPTS, GREEDY), plain)
    assert dspark.engine.stats.spec.drafted_tokens > 0
