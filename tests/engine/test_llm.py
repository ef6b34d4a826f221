"""Engine core over the fake model: batching, chunking, preemption and prefix caching never change outputs."""
import random

import pytest

from fake_model import FakeTokenizer, fake_llm, scripted_llm
from mini.engine import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(n, seed=0, shared=""):
    rng = random.Random(seed)
    return [shared + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 30))) for _ in range(n)]


def _alone(prompts, params=GREEDY):
    return [fake_llm(enable_prefix_caching=False).generate([p], params)[0].token_ids for p in prompts]


def test_batched_equals_alone():
    prompts = _prompts(10)
    batched = [o.token_ids for o in fake_llm().generate(prompts, GREEDY)]
    assert batched == _alone(prompts)


@pytest.mark.parametrize("budget", [1, 3, 7])
def test_chunked_prefill_mixed_with_decode(budget):
    prompts = _prompts(6, seed=1)
    llm = fake_llm(max_num_batched_tokens=budget)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == _alone(prompts)
    calls = llm.engine.runner.model.calls
    assert max(sum(n for _, n in step) for step in calls) <= budget
    # some step mixed a prefill chunk (start 0 or longer than one token) with decodes
    assert budget == 1 or any(len(step) > 1 for step in calls)


def test_preemption_by_recompute():
    prompts = _prompts(8, seed=2)
    llm = fake_llm(num_blocks=14, max_num_seqs=8)  # 56 positions for 8 sequences of up to 42
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats.preemptions > 0
    assert [o.token_ids for o in outs] == _alone(prompts)
    assert llm.engine.blocks.n_free_blocks == 14


def test_prefix_caching_identical_and_hits():
    shared = "the quick brown fox jumps "
    prompts = _prompts(8, seed=3, shared=shared)
    llm = fake_llm(max_num_seqs=2)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == _alone(prompts)
    stats = llm.engine.blocks.stats
    assert stats.hits > 0 and 0 < stats.hit_rate < 1
    assert any(o.num_cached_tokens >= 16 for o in outs[2:])
    # the same prompts again: long hits, same outputs
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert all(o.num_cached_tokens > 0 for o in again if len(o.prompt_token_ids) > 8)


def test_prefix_cache_restores_state_not_just_blocks():
    """Without the snapshot restore, a hit would start from an empty ring/state and change the logits."""
    llm = fake_llm(snapshot_prompt_end=True)
    p = "abcdefghijklmnopq"
    first = llm.generate([p], GREEDY)[0]
    runner = llm.engine.runner
    runner.copy_slots = lambda copies: None  # drop restores and snapshots
    broken = llm.generate([p], GREEDY)[0]
    assert broken.num_cached_tokens > 0 and broken.token_ids != first.token_ids


def test_repeated_prompt_hits_from_the_first_or_second_repeat():
    p, n = "abcdefghijklmnopq", 16  # 17 tokens: the last full block ends at 16
    default = fake_llm()
    hits = [default.generate([p], GREEDY)[0].num_cached_tokens for _ in range(3)]
    assert hits == [0, 0, n]  # the first repeat ends its first chunk at 16 and leaves the snapshot
    eager = fake_llm(snapshot_prompt_end=True)
    assert [eager.generate([p], GREEDY)[0].num_cached_tokens for _ in range(2)] == [0, n]
    assert [s for s, _ in eager.engine.runner.model.calls[0]] == [0]  # the split: 0..16, then 16..17
    assert eager.engine.runner.model.calls[0][0][1] == n


def test_multi_turn_reuses_generated_blocks():
    llm = fake_llm()
    first = llm.generate(["hello there"], GREEDY)[0]
    follow = first.prompt_token_ids + first.token_ids + FakeTokenizer().encode(" more")
    out = llm.generate([follow], GREEDY)[0]
    assert out.num_cached_tokens >= 16
    assert out.token_ids == _alone([follow])[0]


def test_finish_reasons_and_stops():
    llm = fake_llm()
    ref = llm.generate(["stop test"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 20
    stop_id = ref.token_ids[5]
    out = llm.generate(["stop test"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                      stop_token_ids=[stop_id]))[0]
    k = ref.token_ids.index(stop_id)
    assert out.token_ids == ref.token_ids[:k + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    # EOS ends a request unless ignored
    eos = fake_llm().engine.config.eos_id
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[])
    outs = fake_llm().generate(_prompts(40, seed=5), params)
    ended = [o for o in outs if o.finish_reason == "stop"]
    assert ended and all(o.token_ids[-1] == eos for o in ended)


def test_stop_string_across_token_boundaries():
    """A stop string that straddles tokens (even inside a multi-byte character) ends the text right before it."""
    llm = fake_llm()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = llm.generate(["xyz"], params)[0]
    text = ref.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate(["xyz"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "@@@@"]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    with_stop = llm.generate(["xyz"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop,
                                                     include_stop_str_in_output=True))[0]
    assert with_stop.text == text[:text.index(stop) + len(stop)]


@pytest.mark.parametrize("stop,want", [("é!", "abc "), ("\u00e9", "abc "), ("c é", "ab"), ("!x", "abc é"),
                                       ("zz", "abc é!xyz")])
def test_stop_string_inside_multibyte_characters(stop, want):
    """'é' is two byte-tokens: a stop string starting or ending inside it still matches on characters."""
    llm = scripted_llm("abc é!xyz", prompt_len=2)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=stop)
    out = llm.generate([[70, 71]], params)[0]
    assert out.text == want
    assert out.finish_reason == ("length" if stop == "zz" else "stop")
    eng = llm.engine
    eng.add_request("s", [70, 71], params)
    pieces = []
    while eng.has_work():
        pieces += [o.new_text for o in eng.step()]
    assert "".join(pieces) == want and all("\ufffd" not in p for p in pieces)


def test_streamed_text_never_shows_part_of_a_stop_string():
    llm = fake_llm()
    ref = llm.generate(["stream"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    stop = ref.text[4:7]
    eng = llm.engine
    eng.add_request("s", "stream", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop))
    pieces = []
    while eng.has_work():
        pieces += [o.new_text for o in eng.step()]
    assert "".join(pieces) == ref.text[:ref.text.index(stop)]


def test_seeded_sampling_independent_of_batch():
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=10, ignore_eos=True) for i in range(6)]
    prompts = _prompts(6, seed=7)
    batched = [o.token_ids for o in fake_llm().generate(prompts, params)]
    alone = [fake_llm().generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    assert batched == alone
    other_seed = fake_llm().generate([prompts[0]], SamplingParams(temperature=1.0, seed=99, max_tokens=10,
                                                                  ignore_eos=True))[0].token_ids
    assert other_seed != batched[0]


def test_logprobs_are_raw_model_logprobs():
    llm = fake_llm()
    out = llm.generate(["lp"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=3))[0]
    assert len(out.logprobs) == 3
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and len(lp.top) == 3
        assert max(lp.top.values()) == pytest.approx(lp.logprob)  # greedy picks the top token


def test_rejects_bad_requests():
    llm = fake_llm(num_blocks=8)  # context = 32 tokens
    eng = llm.engine
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="context"):
        eng.add_request("b", list(range(3, 40)), GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request("c", [5, 100000], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request("d", [5], SamplingParams(max_tokens=10**9))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 32


def test_abort_frees_cache():
    llm = fake_llm()
    eng = llm.engine
    eng.add_request("x", "abort me please", SamplingParams(max_tokens=100, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.blocks.n_free_blocks < 64
    eng.abort("x")
    outs = eng.step()
    assert [o.finish_reason for o in outs] == ["abort"]
    assert eng.blocks.n_free_blocks == 64 and not eng.has_work()


def test_one_length_rule_with_and_without_tokens_in_flight():
    """Sequence.at_length_limit is the length rule of both the stop check (tokens read back) and the scheduler's
    `length_capped` (tokens in flight too): max_tokens, or the context full, whichever comes first."""
    from mini.engine.sequence import Sequence
    seq = Sequence("r", [5] * 4, SamplingParams(max_tokens=3), seed=0, max_total_tokens=100)
    seq.output_token_ids, seq.num_inflight = [7, 7], 1
    assert not seq.at_length_limit() and seq.at_length_limit(count_inflight=True) and seq.length_capped
    seq.output_token_ids, seq.num_inflight = [7, 7, 7], 0
    assert seq.at_length_limit() and seq.length_capped
    ctx = Sequence("c", [5] * 4, SamplingParams(max_tokens=None), seed=0, max_total_tokens=7)
    ctx.output_token_ids, ctx.num_inflight = [7, 7], 1
    assert not ctx.at_length_limit() and ctx.length_capped  # 4 + 2 + 1 = 7 positions
    ctx.output_token_ids.append(7)
    ctx.num_inflight = 0
    assert ctx.at_length_limit()
