"""Cache placement: block ids for the paged pools, slots for the per-sequence state, and the prefix cache.

One block table per sequence serves every paged pool of the model: block `b` holds positions
`[i*block_tokens, (i+1)*block_tokens)` of the sequence whose table has `b` at index `i`.

Prefix caching over a hybrid cache (docs/design.md "Cache pools"). What the model keeps in a full block depends only
on the tokens up to its end, so the block is shared by every sequence with that prefix. What it keeps per sequence
(slot rows) is not in the blocks; it is reproduced exactly by a *snapshot*: a copy of a sequence's slot rows taken
when its cached length sits on a block boundary, kept in spare slots of the state pools. A prefix hit therefore
needs (a) every block of the prefix still cached and (b) a snapshot at the prefix's end; the new sequence takes the
blocks (shared, reference counted) and restores the snapshot into its own slot. State the model derives from the
token history needs nothing: the history comes with the prompt. What is reused is exactly what the sequence would
have written.

Snapshots exist only where a step ended on a block boundary, so the scheduler ends chunks on boundaries where
one is useful: when blocks match further than the last snapshot (a prefix shared with an earlier request), the
new sequence's first chunk ends where the match ends, and the snapshot taken there serves the next request.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from mini.engine.sequence import Sequence


def block_hash(parent: int, tokens: list[int] | tuple[int, ...], images: tuple = ()) -> int:
    """Chained key of a full block: its tokens, the images it holds positions of (`images`: their digests and
    offsets, see `block_images`; an image position's id says nothing of the image) and (through `parent`)
    everything before it."""
    return hash((parent, tuple(tokens), images) if images else (parent, tuple(tokens)))


def block_images(seq: Sequence, start: int, end: int) -> tuple:
    """(digest, first position relative to `start`) of each of `seq`'s image spans that intersects [start, end)."""
    return tuple((s.digest, s.start - start) for s in seq.images if s.start < end and s.end > start)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (admissions)
    hits: int = 0  # of those, tokens served from the cache
    snapshots_taken: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class SlotCopy:
    """Copy the per-sequence state rows of slot `src` into slot `dst` (snapshot or restore)."""
    src: int
    dst: int


class BlockManager:
    """Allocates block ids and state slots; owns the prefix cache index and the snapshot slots.

    Slots `[0, n_seq_slots)` belong to running sequences; `[n_seq_slots, n_seq_slots + n_snapshots)` hold
    snapshots. Free blocks are kept in eviction order: unhashed blocks first, then cached blocks least recently
    freed first.
    """

    def __init__(self, n_blocks: int, block_tokens: int, n_seq_slots: int, n_snapshots: int = 0,
                 enable_prefix_caching: bool = True):
        if n_blocks < 1 or block_tokens < 1 or n_seq_slots < 1:
            raise ValueError(f"need at least one block, one token per block and one slot "
                             f"(got {n_blocks}, {block_tokens}, {n_seq_slots})")
        self.n_blocks = n_blocks
        self.block_tokens = block_tokens
        self.n_seq_slots = n_seq_slots
        self.prefix_caching = enable_prefix_caching and n_snapshots > 0
        self.ref = [0] * n_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(n_blocks))
        self.hash_of: dict[int, int] = {}  # block -> key
        self.block_of: dict[int, int] = {}  # key -> block
        self.free_slots = list(range(n_seq_slots - 1, -1, -1))
        self.free_snapshot_slots = list(range(n_seq_slots + n_snapshots - 1, n_seq_slots - 1, -1))
        self.snapshot_of: OrderedDict[int, int] = OrderedDict()  # key of the prefix's last block -> slot (LRU)
        self.stats = PrefixCacheStats()

    # ------------------------------------------------------------------ accounting
    @property
    def n_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running sequences (cached free blocks count as free)."""
        return 1.0 - len(self.free) / self.n_blocks

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_tokens)

    def new_blocks_needed(self, seq: Sequence, upto: int) -> int:
        return max(0, self.blocks_for(upto) - len(seq.blocks))

    def has_free_slot(self) -> bool:
        return bool(self.free_slots)

    # ------------------------------------------------------------------ admission / growth / release
    def admit(self, seq: Sequence) -> SlotCopy | None:
        """Give `seq` a slot and its cached prefix (blocks + restored state). Returns the restore copy, if any.
        The caller checked `has_free_slot()`."""
        seq.slot = self.free_slots.pop()
        seq.blocks, seq.block_hashes, seq.num_computed = [], [], 0
        if not self.prefix_caching:
            return None
        tokens = seq.tokens
        keys, parent = [], 0
        # the last token is always computed (its logits are needed), so only blocks strictly before it match
        bt = self.block_tokens
        for i in range((len(tokens) - 1) // bt):
            parent = block_hash(parent, tokens[i * bt:(i + 1) * bt], block_images(seq, i * bt, (i + 1) * bt))
            if parent not in self.block_of:
                break
            keys.append(parent)
        # the blocks match further than any snapshot: end the first chunk there so the next one can hit it
        seq.split_at = len(keys) * self.block_tokens
        while keys and keys[-1] not in self.snapshot_of:
            keys.pop()
        if not keys:
            return None
        for k in keys:
            b = self.block_of[k]
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
            seq.blocks.append(b)
        seq.block_hashes = keys
        seq.num_computed = len(keys) * self.block_tokens
        self.snapshot_of.move_to_end(keys[-1])
        return SlotCopy(src=self.snapshot_of[keys[-1]], dst=seq.slot)

    def grow(self, seq: Sequence, upto: int) -> bool:
        """Make `seq.blocks` cover positions `[0, upto)`. False (nothing allocated) if there are too few blocks."""
        need = self.new_blocks_needed(seq, upto)
        if need > len(self.free):
            return False
        for _ in range(need):
            b, _ = self.free.popitem(last=False)
            self._forget(b)
            self.ref[b] = 1
            seq.blocks.append(b)
        return True

    def release(self, seq: Sequence) -> None:
        """Return `seq`'s blocks and slot. Hashed blocks stay findable until they are reallocated."""
        for b in reversed(seq.blocks):  # the tail of a sequence is the least likely to be shared: evict it first
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
                if b not in self.hash_of:
                    self.free.move_to_end(b, last=False)
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
        seq.blocks, seq.block_hashes, seq.slot = [], [], -1

    # ------------------------------------------------------------------ prefix cache upkeep
    def commit(self, seq: Sequence) -> SlotCopy | None:
        """After a step: index `seq`'s newly completed blocks; if its cached length sits on a block boundary,
        return the snapshot copy to take now (before the slot changes again)."""
        if not self.prefix_caching:
            return None
        n_full = seq.num_computed // self.block_tokens
        tokens = seq.tokens if len(seq.block_hashes) < n_full else None  # the copy only when a block completed
        while len(seq.block_hashes) < n_full:
            i = len(seq.block_hashes)
            lo, hi = i * self.block_tokens, (i + 1) * self.block_tokens
            key = block_hash(seq.block_hashes[-1] if i else 0, tokens[lo:hi], block_images(seq, lo, hi))
            seq.block_hashes.append(key)
            b = seq.blocks[i]
            if key not in self.block_of and b not in self.hash_of:
                self.block_of[key], self.hash_of[b] = b, key
        if n_full == 0 or seq.num_computed % self.block_tokens or self.block_of.get(seq.block_hashes[-1]) is None:
            return None
        key = seq.block_hashes[-1]
        if key in self.snapshot_of:
            self.snapshot_of.move_to_end(key)
            return None
        if not self.free_snapshot_slots:
            _, old = self.snapshot_of.popitem(last=False)
            self.free_snapshot_slots.append(old)
        slot = self.free_snapshot_slots.pop()
        self.snapshot_of[key] = slot
        self.stats.snapshots_taken += 1
        return SlotCopy(src=seq.slot, dst=slot)

    def _forget(self, b: int) -> None:
        """Block `b` is being reused: its key and any snapshot ending at it become invalid."""
        key = self.hash_of.pop(b, None)
        if key is None:
            return
        del self.block_of[key]
        slot = self.snapshot_of.pop(key, None)
        if slot is not None:
            self.free_snapshot_slots.append(slot)
