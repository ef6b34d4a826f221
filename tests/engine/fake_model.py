"""A stand-in with the model's interface (mini.step.StepModel: forward, its batch and cache) for engine tests.

Its logits are a deterministic function of the token history, but it computes that history *through its cache*
the way V4.1 does: positions older than the window come from paged blocks (by block table), the last W
positions from a per-slot ring, and a per-slot running state (like the compressor's partial group) is carried
across steps. A wrong block table, a missed snapshot restore or a stale ring changes the logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mini.tokenizer import StreamDecoder

_P = (1 << 61) - 1  # modulus of the history hash


@dataclass(frozen=True)
class FakeConfig:
    vocab_size: int = 300
    max_position_embeddings: int = 4096
    eos_id: int = 1
    window_size: int = 6


class FakeTokenizer:
    """Bytes tokenizer: id = byte + 3 (0, 1, 2 are special: bos, eos, pad). UTF-8 characters span tokens."""

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")

    def stream(self, skip_special_tokens: bool = False):
        return StreamDecoder(self, skip_special_tokens)


@dataclass
class FakeBatch:
    chunks: list  # mini.model.SeqChunk


class FakeCache:
    def __init__(self, config, n_slots, n_blocks, block_tokens, device, dtype):
        self.config, self.block_tokens, self.n_blocks = config, block_tokens, n_blocks
        self.ring = torch.full((n_slots, config.window_size), -1, dtype=torch.int64)
        self.pages = torch.full((n_blocks, block_tokens), -1, dtype=torch.int64)
        self.state = torch.zeros(n_slots, dtype=torch.int64)  # hash of the history so far
        # the last forward's draft rows, per chunk: (slot, [(position, token, state after it)]), for commit_drafts
        self.drafts: list[tuple[int, list[tuple[int, int, int]]]] = []

    @staticmethod
    def bytes_per_block(config, block_tokens, dtype):
        return block_tokens * 8

    @staticmethod
    def bytes_per_slot(config, dtype):
        return config.window_size * 8 + 8

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for s, d in zip(src.tolist(), dst.tolist()):
            self.ring[d] = self.ring[s]
            self.state[d] = self.state[s]

    def commit_drafts(self, accepted: list[int]) -> None:
        """The ring and state take the accepted draft rows only (a rejected row must not overwrite a ring slot the
        next step still reads); pages are written for every row (read only below the window, once committed)."""
        for (slot, rows), a in zip(self.drafts, accepted):
            for q, token, state in rows[:a]:
                self.ring[slot, q % self.config.window_size] = token
                self.state[slot] = state
        self.drafts = []


def _mix(h: int, token: int, pos: int) -> int:
    return (h * 1000003 + (token + 1) * (pos + 7)) % _P


class FakeStepModel:
    """What the engine needs of a model besides `forward` (mini.step.StepModel), for the fakes: no static decode
    buffers (the engine tests that take the static path use the tiny models)."""
    capturable = False
    reads_images = False
    drafter = None  # no draft module: `speculative` refuses it

    def agree_step(self, n_tokens, bucket):
        return bucket

    def static_decode(self, *args, **kwargs):
        raise NotImplementedError("the fake models run eagerly")

    def build_batch(self, chunks, device) -> FakeBatch:
        return FakeBatch(list(chunks))

    def release_images(self, digests) -> None:
        pass  # the fakes keep nothing of an image

    def new_cache(self, n_slots, n_blocks, block_tokens, device, dtype) -> FakeCache:
        return FakeCache(self.config, n_slots, n_blocks, block_tokens, device, dtype)

    def cache_bytes(self, block_tokens, dtype) -> tuple[int, int]:
        return FakeCache.bytes_per_block(self.config, block_tokens, dtype), FakeCache.bytes_per_slot(self.config, dtype)


class FakeModel(FakeStepModel):
    def __init__(self, config: FakeConfig):
        self.config = config
        self.calls: list[list[tuple[int, int]]] = []  # (start, length) of each chunk, per forward

    def forward(self, batch: FakeBatch, cache: FakeCache) -> torch.Tensor:
        W, bt = self.config.window_size, cache.block_tokens
        rows = []
        self.calls.append([(c.start, len(c.tokens) - c.start) for c in batch.chunks])
        cache.drafts = []
        for c in batch.chunks:
            # the history before the chunk, read back from the cache: pages for old positions, ring for recent
            old = [int(cache.pages[c.blocks[q // bt], q % bt]) for q in range(max(0, c.start - W))]
            recent = [int(cache.ring[c.slot, q % W]) for q in range(max(0, c.start - W), c.start)]
            h = 0
            for q, t in enumerate(old + recent):
                h = _mix(h, t, q)
            state = int(cache.state[c.slot]) if c.start else 0
            committed, draft_rows = len(c.tokens) - c.drafts, []  # a verify chunk: a logit row per position
            for q in range(c.start, len(c.tokens)):
                h, state = _mix(h, c.tokens[q], q), _mix(state, c.tokens[q], q)
                cache.pages[c.blocks[q // bt], q % bt] = c.tokens[q]
                if q < committed:
                    cache.ring[c.slot, q % W] = c.tokens[q]
                    cache.state[c.slot] = state
                else:
                    draft_rows.append((q, c.tokens[q], state))
                if c.want_logits and q >= committed - 1:
                    g = torch.Generator().manual_seed((h ^ (state >> 3)) % (1 << 62))
                    rows.append(torch.randn(self.config.vocab_size, generator=g) * 3)
            cache.drafts.append((c.slot, draft_rows))
        return torch.stack(rows) if rows else torch.empty(0, self.config.vocab_size)


def fake_llm(model_cls=None, **opts):
    """An LLM over the fake model (CPU); `model_cls`: a FakeModel subclass."""
    from mini.engine import LLM
    cfg = FakeConfig()
    opts = {"num_blocks": 64, "block_tokens": 4, "device": "cpu", "dtype": torch.float32, **opts}
    return LLM((model_cls or FakeModel)(cfg), config=cfg, tokenizer=FakeTokenizer(), **opts)


class ScriptedModel(FakeStepModel):
    """Greedy output follows `script` (one-hot logits): the token after a history of n tokens is
    script[(n - prompt_len) % len(script)]. For exact stop-string / detokenization tests."""

    def __init__(self, config: FakeConfig, script: list[int], prompt_len: int):
        self.config, self.script, self.prompt_len = config, script, prompt_len

    def forward(self, batch: FakeBatch, cache: FakeCache) -> torch.Tensor:
        rows = []
        for c in batch.chunks:
            for n in range(len(c.tokens) - c.drafts, len(c.tokens) + 1) if c.want_logits else ():  # verify rows too
                row = torch.zeros(self.config.vocab_size)
                row[self.script[(n - self.prompt_len) % len(self.script)]] = 10.0
                rows.append(row)
        return torch.stack(rows) if rows else torch.empty(0, self.config.vocab_size)


def scripted_llm(text: str, prompt_len: int, **opts):
    """An LLM whose greedy output is the bytes of `text` (repeated), one byte per token."""
    from mini.engine import LLM
    cfg = FakeConfig()
    opts = {"num_blocks": 64, "block_tokens": 4, "device": "cpu", "dtype": torch.float32, **opts}
    model = ScriptedModel(cfg, FakeTokenizer().encode(text), prompt_len)
    return LLM(model, config=cfg, tokenizer=FakeTokenizer(), **opts)


class MarkovCache(FakeCache):
    def commit_drafts(self, accepted: list[int]) -> None:
        """A Markov chain keeps nothing of a row but its token: nothing to roll back."""


class ChainDrafter:
    """mini.step.Drafter proposing a Markov table's greedy continuation of the anchor (a deterministic proposal:
    right for greedy requests over MarkovModel(table), often for sampled ones)."""
    min_confidence = 0.0

    def __init__(self, table: torch.Tensor, max_draft: int):
        self.table, self.max_draft = table, max_draft

    def propose(self, cache, commits):
        out = []
        for c in commits:
            draft, t = [], c.anchor
            while t is not None and len(draft) < c.max_draft:
                t = int(self.table[t].argmax())
                draft.append(t)
            out.append(draft)
        return out

    def static_draft(self, static, cache):
        return None  # drafts on the host only (`propose`)


class MarkovModel(FakeStepModel):
    """A Markov chain over the vocabulary: the logits after a history are `table[its last token]`, for every row a
    chunk wants (1 + drafts rows of a verify chunk), so every output's distribution is known exactly and a
    speculative step's rows are exactly plain decode's. It speculates (its cache takes `commit_drafts`).
    `steps`: the (start, length, drafts) of each forward's chunks."""

    def __init__(self, config: FakeConfig, table: torch.Tensor):
        self.config, self.table, self.steps = config, table, []

    def new_cache(self, n_slots, n_blocks, block_tokens, device, dtype) -> MarkovCache:
        return MarkovCache(self.config, n_slots, n_blocks, block_tokens, device, dtype)

    def forward(self, batch: FakeBatch, cache: FakeCache) -> torch.Tensor:
        self.steps.append([(c.start, len(c.tokens) - c.start, c.drafts) for c in batch.chunks])
        rows = [self.table[torch.tensor(c.tokens[len(c.tokens) - 1 - c.drafts:])] for c in batch.chunks
                if c.want_logits]
        return torch.cat(rows) if rows else torch.empty(0, self.config.vocab_size)


def markov_llm(table: torch.Tensor, **opts):
    """An LLM over MarkovModel(table) (CPU, fp32, blocks of 4 tokens unless `opts` say otherwise); the model, with
    its `steps`, is `llm.engine.model`."""
    from mini.engine import LLM
    cfg = FakeConfig(vocab_size=table.shape[0])
    opts = {"block_tokens": 4, "device": "cpu", "dtype": torch.float32, **opts}
    return LLM(MarkovModel(cfg, table), config=cfg, tokenizer=FakeTokenizer(), **opts)
