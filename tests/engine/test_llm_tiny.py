"""The engine over the real tiny-v4.1 model on CPU. Activations in fp32 (design.md, numerics contract): greedy
near-ties in bf16 could flip a token between batch shapes, which is rounding, not an engine bug."""
import gc

import pytest
import torch

from mini.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
PROMPTS = [[5 + (7 * i + 3 * j) % 500 for j in range(n)] for i, n in enumerate([3, 17, 33])]


def _llm(**opts):
    return LLM("tiny-v4.1", device="cpu", dtype=torch.float32, **{"num_blocks": 32, "block_tokens": 16, **opts})


@pytest.fixture(scope="module")
def alone():
    llm = _llm(enable_prefix_caching=False)
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def test_batched_chunked_preempted_equals_alone(alone):
    # 4 blocks = 64 positions for sequences of 6, 20 and 36 tokens; 16-token steps chunk the prefills
    llm = _llm(num_blocks=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == alone
    assert llm.engine.stats.preemptions > 0


def test_prefix_caching_equals_no_caching(alone):
    """Three prompts share a 32-token prefix. The second one's first chunk stops where its blocks stop matching
    (32) and leaves a snapshot there; the third reuses the blocks and restores the window rings and compressor
    state from that snapshot. Its output equals the uncached run."""
    shared = PROMPTS[2][:32]
    prompts = [shared + PROMPTS[0], shared + PROMPTS[1][:5], PROMPTS[2]]
    llm = _llm(max_num_seqs=1)  # one at a time, so each can hit what the previous left
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 32]
    assert outs[2].token_ids == alone[2]
    assert llm.engine.blocks.stats.hit_rate > 0.2


@pytest.mark.gpu
@pytest.mark.gpu_alone  # its pools are a fraction of the GPU's memory: other workers' memory would not be free
def test_cuda_pools_sized_from_free_memory():
    # the gpu_alone pass runs in one process: an earlier module's models may be garbage not yet collected, whose
    # blocks the caching allocator still holds (docs/perf/039: ~39 GB, after tests/model's gpu_alone tests)
    gc.collect()
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    # eager: the graphs' pool (not subtracted from the cache budget, docs/engine.md) would blur the memory bound
    llm = LLM("tiny-v4.1", device="cuda", dtype=torch.bfloat16, gpu_memory_utilization=0.3, block_tokens=128,
              max_num_seqs=8, max_model_len=1 << 20, enforce_eager=True)
    eng = llm.engine
    free_after, _ = torch.cuda.mem_get_info()
    assert eng.blocks.n_blocks > 1000 and free_before - free_after <= 0.3 * total
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in outs)
    # without a long context to serve, the pools stop at what max_num_seqs sequences can use
    small = LLM("tiny-v4.1", device="cuda", dtype=torch.bfloat16, block_tokens=128, max_num_seqs=4, max_model_len=1000)
    assert small.engine.blocks.n_blocks == 4 * 8
