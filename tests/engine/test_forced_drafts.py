"""Forced drafts (mini/engine/speculative.py, docs/engine.md "Structured outputs"): the tokens a grammar forces
(DSML tool-call markup, JSON keys) are drafts, verified in one step, with speculation on or off. On the real
tiny-v4.1 (near-byte vocabulary), CPU, fp32, under the kernels' deterministic mode (a verify row's logits equal the
decode step's it replaces bit for bit, as in test_speculative.py): tokens, logprobs, finish and text equal the
engine's without them (`forced_drafts=False`), in far fewer steps."""
import pytest
import torch

from mini.engine import LLM, SamplingParams
from mini.engine.speculative import FORCED_DRAFT
from mini.server.grammars import json_grammar, regex_grammar, tool_call_grammar

PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [40, 41], [300, 7, 8], [77, 78, 79]]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                     "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"]}}}]
CALL = tool_call_grammar(TOOLS, only="get_weather", parallel=False)  # tool_choice naming the tool: forced
# a forced call's markup starts with 89 forced tokens on the tiny vocabulary; 40 tokens end inside that run
TOOL_PARAMS = [SamplingParams(temperature=0, max_tokens=40, grammar=CALL, logprobs=2),
               SamplingParams(temperature=0.8, seed=3, max_tokens=40, grammar=CALL, logprobs=2),
               SamplingParams(temperature=0, max_tokens=40, grammar=CALL, stop=["invoke"]),  # a stop in the run
               SamplingParams(temperature=0, max_tokens=7, grammar=CALL, logprobs=1),  # max_tokens in the run
               SamplingParams(temperature=1.0, max_tokens=40, grammar=CALL, logprobs=1)]  # rejection sampling
OPTS = dict(device="cpu", dtype=torch.float32, block_tokens=16, num_blocks=64)


class JunkDrafter:
    """mini.step.Drafter proposing the anchor repeated: wrong almost always, so speculation alone saves nothing
    and every step saved comes from forced drafts (which replace its drafts inside a forced run)."""
    min_confidence = 0.0

    def __init__(self, max_draft: int = 4):
        self.max_draft, self.proposed = max_draft, 0

    def propose(self, cache, commits):
        drafts = [[c.anchor] * c.max_draft if c.anchor is not None else [] for c in commits]
        self.proposed += sum(map(len, drafts))
        return drafts

    def static_draft(self, static, cache):
        return None  # drafts on the host only (`propose`)


def _generate(params, prompts=PROMPTS, **opts):
    llm = LLM("tiny-v4.1", **{**OPTS, **opts})
    return llm.generate(prompts[:len(params)], params), llm.engine


def _same(got, want):
    """Tokens, text, finish and logprobs (float ==: bit for bit) of two runs' outputs."""
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [(o.text, o.finish_reason, o.stop_reason) for o in got] == \
        [(o.text, o.finish_reason, o.stop_reason) for o in want]
    assert [[(lp.logprob, lp.top) for lp in o.logprobs] for o in got] == \
        [[(lp.logprob, lp.top) for lp in o.logprobs] for o in want]


@pytest.fixture(scope="module")
def plain_tool_calls(kernels_deterministic):
    outs, engine = _generate(TOOL_PARAMS, forced_drafts=False)
    assert engine.stats.steps == 40 and engine.stats.spec.drafted_tokens == 0  # one step a token
    assert outs[2].finish_reason == "stop" and outs[2].stop_reason == "invoke"
    assert [len(o.token_ids) for o in outs] == [40, 40, len(outs[2].token_ids), 7, 40]
    return outs


@pytest.mark.parametrize("overlap", [False, True])
def test_forced_tool_call_without_speculation_equals_plain_decode(plain_tool_calls, overlap):
    """Speculation off: verify steps run for the forced drafts alone, greedy, seeded and unseeded (p(d) = 1 under
    the mask: accepted, and the bonus token is plain decode's own draw); a stop string and max_tokens inside a
    forced run end the output where plain decode does. Overlapped, the step in flight is read back first."""
    outs, engine = _generate(TOOL_PARAMS, overlap=overlap)
    _same(outs, plain_tool_calls)
    spec = engine.stats.spec
    assert spec.drafted_tokens > 0 and spec.accepted_tokens == spec.drafted_tokens  # forced: every one taken
    assert len(spec.accept_lengths) == FORCED_DRAFT + 1 and spec.accept_lengths[FORCED_DRAFT] > 0  # 16-row runs
    assert engine.stats.steps <= 4, engine.stats.steps  # 40 tokens, 16 a step


def test_forced_tool_call_with_speculation_equals_plain_decode(plain_tool_calls):
    """Speculation on: inside a forced run the forced tokens replace the drafter's draft, capped by --spec-tokens
    (4 here); elsewhere the drafter's drafts are verified as before. Same outputs, a fraction of the steps."""
    junk = JunkDrafter()
    outs, engine = _generate(TOOL_PARAMS, drafter=junk, spec_tokens=4)
    _same(outs, plain_tool_calls)
    assert junk.proposed > 0
    lengths = engine.stats.spec.accept_lengths
    assert len(lengths) == 5 and lengths[4] > 0
    assert engine.stats.steps <= 11, engine.stats.steps  # 40 tokens, 5 a step


def test_load_rule_caps_forced_runs(plain_tool_calls):
    """--spec-max-rows: 20 rows leave each of 5 sequences a draft of 3 at most (4 rows a sequence), each of the 3
    that decode on once the others stopped 5."""
    outs, engine = _generate(TOOL_PARAMS, spec_max_rows=20)
    _same(outs, plain_tool_calls)
    lengths = engine.stats.spec.accept_lengths
    assert lengths[3] > 0 and not any(lengths[6:]), lengths
    assert 4 < engine.stats.steps <= 14, engine.stats.steps


def test_json_schema_keys_are_forced(kernels_deterministic):
    schema = {"type": "object", "properties": {"temperature": {"type": "integer"},
                                               "description": {"type": "string", "maxLength": 5}},
              "required": ["temperature", "description"], "additionalProperties": False}
    params = [SamplingParams(temperature=0, max_tokens=40, grammar=json_grammar(schema), logprobs=2),
              SamplingParams(temperature=0.7, seed=11, max_tokens=40, grammar=json_grammar(schema), logprobs=1)]
    ref, plain = _generate(params, forced_drafts=False)
    outs, forced = _generate(params)
    _same(outs, ref)
    assert forced.stats.spec.accepted_tokens >= 2 * len('"temperature":'), forced.stats.spec
    assert forced.stats.steps < plain.stats.steps, (forced.stats.steps, plain.stats.steps)


def test_a_grammar_forcing_nothing_changes_nothing(kernels_deterministic):
    params = [SamplingParams(temperature=0, max_tokens=10, grammar=regex_grammar("[a-z]{0,30}"), logprobs=1),
              SamplingParams(temperature=0.9, seed=2, max_tokens=10, grammar=regex_grammar("[a-z]{0,30}"))]
    ref, plain = _generate(params, forced_drafts=False)
    outs, engine = _generate(params)
    _same(outs, ref)
    assert engine.stats.spec.drafted_tokens == 0 and engine.stats.steps == plain.stats.steps


@pytest.mark.gpu
def test_forced_drafts_on_cuda_equal_plain_decode_gpu(kernels_deterministic):
    """bf16, fast backend, the kernels' deterministic mode (a row's result does not depend on its step's rows):
    decode steps replay CUDA graphs, overlapped, and the forced drafts' verify steps run eagerly between them
    (speculation off: graphs of width 1); tokens and logprobs equal the engine's without forced drafts."""
    from mini.ops import set_backend
    set_backend("fast")
    opts = dict(device="cuda", dtype=torch.bfloat16, max_num_seqs=8, block_tokens=128, max_model_len=1024)
    runs = {}
    for forced in (False, True):
        llm = LLM("tiny-v4.1", **opts, forced_drafts=forced)
        assert llm.engine.runner.graphs is not None and llm.engine.overlap
        runs[forced] = llm.generate(PROMPTS, TOOL_PARAMS), llm.engine
    _same(runs[True][0], runs[False][0])
    assert runs[False][1].stats.steps == 40 and runs[True][1].stats.steps <= 4, runs[True][1].stats
