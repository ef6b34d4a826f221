"""EP + DP attention end to end on gloo ranks: tiny-v4.1 on 2 and 4 CPU processes generates the same greedy tokens
as one process, with log-probabilities within fp32 reduction-order noise."""
import pytest
import torch

from mini.parallel.dp import generate, load_ep_model
from mini.parallel.groups import DistContext
from mini.parallel.launch import spawn
from mini.engine import LLM, SamplingParams
from mini.model import load_model

# five prompts of odd lengths: on 4 ranks rank 0 gets two and finishes last, the others go idle early
PROMPTS = [[5 + (7 * i + 3 * j) % 400 for j in range(n)] for i, n in enumerate([9, 19, 4, 11, 6])]
MAX_TOKENS = [5, 2, 4, 2, 3]


def _params():
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3) for n in MAX_TOKENS]


def _llm(model, cfg, tok):
    return LLM(model, config=cfg, tokenizer=tok, device="cpu", dtype=torch.float32, block_tokens=32, num_blocks=24,
               enable_prefix_caching=False)


def _summary(outs):
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


def _run(ctx: DistContext):
    return _summary(generate(_llm(*load_ep_model("tiny-v4.1", ctx, torch.float32)), ctx, PROMPTS, _params()))


@pytest.mark.slow
def test_two_and_four_ranks_match_one():
    model, cfg, tok = load_model("tiny-v4.1", device="cpu", dtype=torch.float32)

    def one_rank(idx):  # the plain single-device engine over the given prompts
        return _summary(_llm(model, cfg, tok).generate([PROMPTS[i] for i in idx], [_params()[i] for i in idx]))

    full = one_rank(range(len(PROMPTS)))
    assert [len(t) for t, _ in full] == MAX_TOKENS
    for world in (2, 4):
        results = spawn(world, _run, device="cpu")
        assert all(r == results[0] for r in results)  # every rank returns all prompts' outputs
        assert [t for t, _ in results[0]] == [t for t, _ in full]
        # a rank's batches hold its own prompts only; against one device running the same batches, only the
        # cross-rank fp32 summation order of the routed experts differs
        for r in range(world):
            mine = range(r, len(PROMPTS), world)
            for i, (tokens, logprobs) in zip(mine, one_rank(mine)):
                assert results[0][i][0] == tokens
                torch.testing.assert_close(torch.tensor(results[0][i][1]), torch.tensor(logprobs), rtol=0,
                                           atol=1e-5)


# speculation over EP ranks: longer outputs, so that drafts are proposed and verified many times
SPEC_TOKENS = [9, 6, 8, 7, 5]


def _run_speculative(ctx: DistContext, futures, plan, dspark: bool):
    """tiny-v4.1-dspark on this rank, --deterministic: plain decode (futures None, dspark False), the oracle drafter
    (the plain run's continuations, wrong where `plan` says), or the model's own DSpark draft module."""
    from mini.testing.oracle_drafter import OracleDrafter
    model, cfg, tok = load_ep_model("tiny-v4.1-dspark", ctx, torch.float32)
    kw = dict(config=cfg, tokenizer=tok, device="cpu", dtype=torch.float32, block_tokens=16, num_blocks=48,
              enable_prefix_caching=False, deterministic=True)
    if futures is not None:
        kw.update(drafter=OracleDrafter(futures, plan, cfg.vocab_size, 3), spec_tokens=3)
    if dspark:
        kw.update(speculative="dspark", spec_adaptive=False)
    llm = LLM(model, **kw)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in SPEC_TOKENS]
    outs = generate(llm, ctx, PROMPTS, params)
    spec = llm.engine.stats.spec
    return [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in outs], list(spec.accept_lengths)


@pytest.mark.slow
def test_speculation_over_two_ranks_equals_plain_decode():
    """Each rank drafts for its own sequences (it holds the whole draft module) and verifies them in eager steps
    beside the other rank's decode or verify steps: under --deterministic the tokens and logprobs are plain decode's
    over the same ranks, bit for bit, for the oracle drafter (accept lengths 0..3 on both ranks) and for DSpark's
    own drafts (random weights: nearly all rejected)."""
    plain = spawn(2, _run_speculative, None, None, False, device="cpu")
    assert [len(t) for t, _ in plain[0][0]] == SPEC_TOKENS and plain[0][0] == plain[1][0]
    futures = {tuple(p): t for p, (t, _) in zip(PROMPTS, plain[0][0])}
    oracle = spawn(2, _run_speculative, futures, [0, 3, 1, 2, 3, 0, 2], False, device="cpu")
    assert oracle[0][0] == plain[0][0] and oracle[1][0] == plain[0][0]
    for _, lengths in oracle:  # each rank verified drafts of several accept lengths
        assert sum(n > 0 for n in lengths) >= 3, lengths
    dspark = spawn(2, _run_speculative, None, None, True, device="cpu")
    assert dspark[0][0] == plain[0][0]
    assert all(sum(lengths) > 0 for _, lengths in dspark)  # each rank verified DSpark's drafts
