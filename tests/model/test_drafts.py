"""A verify step's draft rows and `KVCache.commit_drafts` (mini/model/drafts.py): after a verify chunk
[b, d1..dk] that accepts a drafts, every cache row a later step reads equals plain decode's after b, d1..da, bit for
bit (CPU, fp32, the kernels' deterministic mode): the window rings (positions e-128..e-1 of the frontier e), the
compressors' open groups (the live state rows) and the paged compressed KV and index keys of the complete groups,
for every accept length 0..k, with frontiers around the ring's wrap at 128, a block boundary and both parities of
the ratio-2 groups."""
import copy

import pytest
import torch

import mini.ops
from mini.model import Batch, KVCache, SeqChunk

BT, K = 16, 5


def _forward(model, hasher, cache, tokens, start, drafts=0):
    chunk = SeqChunk(tokens=tokens, start=start, slot=0, blocks=list(range(cache.n_blocks)), drafts=drafts)
    return model.forward(Batch.build([chunk], model.config, "cpu", hasher=hasher), cache)


def _live_rows_equal(got: KVCache, want: KVCache, end: int) -> None:
    """The rows a step after `end` committed tokens reads."""
    cfg, W = got.config, got.config.window_size
    pos = torch.arange(max(0, end - W), end)
    for layer, (g, w) in enumerate(zip(got.window, want.window)):
        assert torch.equal(g[0, pos % W], w[0, pos % W]), f"window ring of layer {layer}"
    for plan in cfg.layers:
        r, l = plan.ratio, plan.layer
        if l in got.comp_state:
            open_pos = torch.arange(end // r * r, end)
            for g, w in zip(got.comp_state[l], want.comp_state[l]):
                assert torch.equal(g[0, open_pos % r], w[0, open_pos % r]), f"open group of layer {l}"
        for pools in (got.comp_kv, got.index_k):
            if l in pools:
                other = want.comp_kv if pools is got.comp_kv else want.index_k
                g, w = pools[l].view(-1, pools[l].shape[-1]), other[l].view(-1, other[l].shape[-1])
                assert torch.equal(g[:end // r], w[:end // r]), f"complete groups of layer {l}"


@pytest.mark.parametrize("prompt_len", [121, 125])
def test_commit_drafts_leaves_plain_decodes_cache(tiny_model, prompt_len):
    model, hasher = tiny_model("tiny-v4.1")
    gen = torch.Generator().manual_seed(prompt_len)
    tokens = torch.randint(1, 500, (prompt_len + K + 1,), generator=gen).tolist()
    with mini.ops.deterministic_mode():
        base = KVCache(model.config, 2, 10, BT, "cpu", torch.float32)
        _forward(model, hasher, base, tokens[:prompt_len], 0)
        plain, cache, logits = [], copy.deepcopy(base), []
        for p in range(prompt_len, prompt_len + K + 1):  # b, then the true d1..dk one at a time
            logits.append(_forward(model, hasher, cache, tokens[:p + 1], p)[0])
            plain.append(copy.deepcopy(cache))
        for a in range(K + 1):
            draft = tokens[prompt_len + 1:prompt_len + 1 + K]
            if a < K:
                draft[a] = (draft[a] + 1) % 500  # wrong from d(a+1) on: a accepted
            cache = copy.deepcopy(base)
            rows = _forward(model, hasher, cache, tokens[:prompt_len + 1] + draft, prompt_len, drafts=K)
            assert rows.shape[0] == 1 + K
            for i in range(a + 1):  # the rows the accepted prefix conditions on are plain decode's logits
                assert torch.equal(rows[i], logits[i]), (a, i)
            cache.commit_drafts([a])
            _live_rows_equal(cache, plain[a], prompt_len + 1 + a)


def test_commit_counts_are_checked(tiny_model):
    model, hasher = tiny_model("tiny-v4.1")
    cache = KVCache(model.config, 2, 4, BT, "cpu", torch.float32)
    _forward(model, hasher, cache, list(range(1, 10)), 0, drafts=3)
    with pytest.raises(ValueError, match="4 drafts accepted of 3"):
        cache.commit_drafts([4])
    _forward(model, hasher, cache, list(range(1, 10)), 0)
    with pytest.raises(ValueError, match="no drafts"):
        cache.commit_drafts([1])
