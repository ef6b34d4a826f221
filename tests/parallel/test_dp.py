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
