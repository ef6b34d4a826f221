"""DP balance policy (mini.parallel.balance): where requests go and the per-step prefill cap, without ranks."""
from types import SimpleNamespace

from mini.parallel.balance import Placement, RankLoad, prefill_cap

BIG = 10_000  # free cache tokens: room for anything below


def _placement(*loads: RankLoad) -> Placement:
    p = Placement(len(loads))
    p.report(list(loads), [0] * len(loads))
    return p


def test_fewest_tokens_in_flight_wins_not_fewest_requests():
    # rank 0: one 900-token prompt still prefilling; rank 1: three decodes with 60 tokens of context in all
    p = _placement(RankLoad(prefill_tokens=900, cache_free_tokens=BIG),
                   RankLoad(decode_tokens=60, decode_seqs=3, cache_free_tokens=BIG))
    assert p.choose(10) == 1
    # decoding context counts like prompt tokens: a long decode is load too
    p = _placement(RankLoad(prefill_tokens=100, cache_free_tokens=BIG),
                   RankLoad(decode_tokens=700, decode_seqs=1, cache_free_tokens=BIG))
    assert p.choose(10) == 0


def test_ties_go_to_more_free_cache_then_lowest_rank():
    p = _placement(RankLoad(prefill_tokens=50, cache_free_tokens=100),
                   RankLoad(prefill_tokens=50, cache_free_tokens=900),
                   RankLoad(prefill_tokens=50, cache_free_tokens=900))
    assert p.choose(10) == 1


def test_a_rank_without_room_for_the_prompt_is_skipped():
    # rank 0 is idle but its cache is full (cached prefixes of finished requests do not count as used)
    p = _placement(RankLoad(cache_free_tokens=64), RankLoad(prefill_tokens=300, cache_free_tokens=BIG))
    assert p.choose(64) == 0 and p.choose(65) == 1
    # nowhere fits: the most free cache (it frees first)
    p = _placement(RankLoad(cache_free_tokens=10), RankLoad(prefill_tokens=300, cache_free_tokens=40))
    assert p.choose(100) == 1


def test_a_burst_between_reports_spreads_by_tokens():
    """One long prompt then many short ones, all before the next report: the short ones fill the other rank until
    it carries as many tokens as the long prompt's rank."""
    p = _placement(RankLoad(cache_free_tokens=BIG), RankLoad(cache_free_tokens=BIG))
    ranks = [p.place(n) for n in [600] + [100] * 8]
    assert ranks == [0, 1, 1, 1, 1, 1, 1, 0, 1]
    assert p.load(0).tokens_in_flight == 700 and p.load(1).tokens_in_flight == 700
    # the next report includes the adds sent with it; `placed_before` covers the ones sent after
    p.report([RankLoad(prefill_tokens=700, cache_free_tokens=BIG - 700),
              RankLoad(prefill_tokens=600, cache_free_tokens=BIG - 600)], [0, 100])
    assert p.load(1).tokens_in_flight == 700 and p.load(1).cache_free_tokens == BIG - 700
    assert p.choose(1) == 0  # tie in tokens and cache: the lowest rank


def test_rank_load_of_an_engine():
    """RankLoad.of(engine) is the engine's own account (LLMEngine.load) of its scheduler and block manager."""
    from mini.engine.llm import LLMEngine

    def seq(tokens, computed, prefill):
        return SimpleNamespace(num_pending=tokens - computed, num_computed=computed, in_prefill=prefill)
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(waiting=[seq(40, 0, True)], running=[seq(500, 256, True), seq(30, 29, False),
                                                                      seq(12, 11, False)]),
        blocks=SimpleNamespace(n_free_blocks=5, block_tokens=32))
    engine.load = lambda: LLMEngine.load(engine)
    assert RankLoad.of(engine) == RankLoad(prefill_tokens=40 + 244, decode_tokens=29 + 11, decode_seqs=2,
                                           cache_free_tokens=160)


def test_prefill_cap_only_when_a_rank_only_decodes():
    prefilling = RankLoad(prefill_tokens=3000, decode_tokens=100, decode_seqs=4)
    assert prefill_cap([prefilling, RankLoad(prefill_tokens=20)], 256) is None  # both prefill: full chunks
    assert prefill_cap([prefilling, RankLoad()], 256) is None  # the other rank is idle: nobody waits
    assert prefill_cap([RankLoad(decode_tokens=99, decode_seqs=9), RankLoad(decode_seqs=3)], 256) is None
    # a decoding-only rank: the prefilling rank's chunk shrinks to max(min_chunk, the largest decode batch)
    assert prefill_cap([prefilling, RankLoad(decode_tokens=900, decode_seqs=64)], 256) == 256
    assert prefill_cap([prefilling, RankLoad(decode_seqs=300), RankLoad(decode_seqs=700)], 256) == 700
