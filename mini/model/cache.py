"""Per-sequence model state (spec §3) as pools shared by all sequences (docs/design.md "Cache pools").

* `window[l]`       [n_slots, W, head_dim] ring per layer; slot row = Batch.slots, ring index = pos % W.
* `comp_kv[l]`      [n_blocks, block_tokens // ratio, head_dim] paged compressed KV of each KV-owning layer.
* `index_k[l]`      [n_blocks, block_tokens // ratio, index_head_dim] paged index keys of each key-owning layer.
* `comp_state[l]`   (kv, score) fp32 [n_slots, state_rows, width]: the compressor's open groups (ratio > 1).
* `index_state[l]`  the same for V4's indexer compressor.
* `draft.rings[s]`  [n_slots, W, head_dim] DSpark's ring per draft stage (mini.model.dspark), models with `mtp.*`.
* `keys`            the KeyStore (mini.kernels.attention_input) the rings and compressed pools are views of, with
                    FRESH_ROWS_PER_SLOT rows per slot after them for a decode-shaped step's own new keys: one tensor
                    FlashMLA's sparse kernel reads a decode or verify step's keys from in place.
Stored values are fake-quantized (FP8/FP4 grids), so bf16 storage is exact. Nothing needs resetting when a
slot or block is reused: a step only reads positions its own sequence wrote before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mini.config import ModelConfig
from mini.kernels.attention_input import KeyStore
from mini.model.drafts import DraftRows

FRESH_ROWS_PER_SLOT = 8  # a decode-shaped step of up to 8 rows per slot (a verify step's 1 + 7 drafts) fits


@dataclass
class DraftRings:
    """DSpark's per-sequence state (mini.model.dspark.DSparkRings's layout): `rings[stage]` [n_slots, W, d]."""
    rings: list[torch.Tensor]


def _overlap(cfg: ModelConfig, ratio: int) -> bool:
    return not cfg.is_v41 and ratio == 4


def state_shape(cfg: ModelConfig, ratio: int, head_dim: int) -> tuple[int, int]:
    """(rows, width) of a compressor's open-group state; none for ratio 1."""
    overlap = _overlap(cfg, ratio)
    return ratio * (2 if overlap else 1), head_dim * (2 if overlap else 1)


class KVCache:
    def __init__(self, config: ModelConfig, n_slots: int, n_blocks: int, block_tokens: int, device="cpu",
                 dtype=torch.bfloat16):
        cfg = config
        for r in set(cfg.compress_ratios) - {0}:
            if block_tokens % r:
                raise ValueError(f"block_tokens {block_tokens} must be a multiple of every compress ratio ({r})")
        self.config, self.n_slots, self.n_blocks, self.block_tokens = cfg, n_slots, n_blocks, block_tokens
        self.device, self.dtype = device, dtype
        d, di = cfg.head_dim, cfg.index_head_dim
        shapes = [(n_slots, cfg.window_size)] * cfg.n_layers  # the attention keys' views, in the store's order
        shapes += [(n_blocks, block_tokens // p.ratio) for p in cfg.layers if p.owns_kv]
        views, start = [], 0
        for shape in shapes:
            views.append((start, shape))
            start += shape[0] * shape[1]
        rows = torch.zeros(start + n_slots * FRESH_ROWS_PER_SLOT, d, dtype=dtype, device=device)
        self.keys = KeyStore(rows, rows[start:])
        keys = [rows[at:at + n * w].view(n, w, d) for at, (n, w) in views]
        self.window = keys[:cfg.n_layers]
        pools = iter(keys[cfg.n_layers:])
        self.comp_kv, self.index_k, self.comp_state, self.index_state = {}, {}, {}, {}
        for p in cfg.layers:
            if p.owns_kv:
                self.comp_kv[p.layer] = next(pools)
                if p.ratio > 1:
                    self.comp_state[p.layer] = self._state(p.ratio, d)
            if p.owns_index_keys:
                self.index_k[p.layer] = torch.zeros(n_blocks, block_tokens // p.ratio, di, dtype=dtype,
                                                    device=device)
                if not cfg.is_v41:  # V4: the indexer pools its own keys
                    self.index_state[p.layer] = self._state(p.ratio, di)
        self.draft = DraftRings([torch.zeros(n_slots, cfg.window_size, d, dtype=dtype, device=device)
                                 for _ in range(cfg.n_mtp_layers)]) if cfg.has_dspark else None
        self.drafts: DraftRows | None = None  # the last forward's draft rows (a verify step), until committed

    def commit_drafts(self, accepted: list[int]) -> None:
        """After a verify step: the first accepted[b] drafts of each of its chunks b join the state as plain decode
        would have written them (mini.model.drafts); the rest are dropped."""
        drafts, self.drafts = self.drafts, None
        if drafts is None:
            if any(accepted):
                raise ValueError("commit_drafts: the last forward had no drafts")
            return
        drafts.commit(self.window, {"comp_state": self.comp_state, "index_state": self.index_state}, accepted)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the per-slot state rows (window rings, compressor states, DSpark rings) of slots `src` to slots `dst`
        (prefix-cache snapshot / restore). Paged pools (comp_kv, index_k) are indexed by block and are not copied."""
        pools = list(self.window) + (self.draft.rings if self.draft is not None else [])
        for states in (self.comp_state, self.index_state):
            for kv_and_score in states.values():
                pools += list(kv_and_score)
        for pool in pools:
            pool.index_copy_(0, dst, pool.index_select(0, src))

    def _state(self, ratio: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width = state_shape(self.config, ratio, head_dim)
        kv = torch.zeros(self.n_slots, rows, width, dtype=torch.float32, device=self.device)
        return kv, torch.full_like(kv, float("-inf"))

    # ------------------------------------------------------------------ sizing
    @staticmethod
    def bytes_per_block(config: ModelConfig, block_tokens: int, dtype=torch.bfloat16) -> int:
        """Paged memory of one block: compressed KV and index keys of every owning layer."""
        size = torch.tensor([], dtype=dtype).element_size()
        total = 0
        for p in config.layers:
            if p.owns_kv:
                total += block_tokens // p.ratio * config.head_dim
            if p.owns_index_keys:
                total += block_tokens // p.ratio * config.index_head_dim
        return total * size

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype=torch.bfloat16) -> int:
        """Per-sequence memory: a window ring per layer (and per DSpark stage), the key store's fresh rows and the
        fp32 compressor states."""
        size = torch.tensor([], dtype=dtype).element_size()
        rings = config.n_layers + (config.n_mtp_layers if config.has_dspark else 0)
        total = (rings * config.window_size + FRESH_ROWS_PER_SLOT) * config.head_dim * size
        for p in config.layers:
            if p.owns_kv and p.ratio > 1:
                rows, width = state_shape(config, p.ratio, config.head_dim)
                total += 2 * rows * width * 4
            if p.owns_index_keys and not config.is_v41:
                rows, width = state_shape(config, p.ratio, config.index_head_dim)
                total += 2 * rows * width * 4
        return total
