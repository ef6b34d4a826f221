"""Engram n-gram memory of V4.1 (spec §2.3, official `engram.py`): hashing (host, numpy; or on the device for a
decode step, torch, bit-equal), the table lookup, the gated update.

Hashing. Token ids are first mapped to compressed ids (`mini.tokenizer.compressed_token_map`). Position p of a
sequence looks back `max_ngram - 1` tokens; a look-back that leaves the sequence or crosses a dead token (image
span, compressed id DEAD) and everything beyond it become the compressed pad id. The tokens are multiplied by
per-layer odd multipliers and XOR-folded one look-back at a time, so after step n the running value hashes the
(n+1)-gram; each (n-gram order, head) column takes it modulo its own prime and adds the column's row offset.

Tables. Every (layer, n-gram order, head) owns a prime-sized row range; the primes come from one walk over all
engram layers: each n-gram order restarts at `engram_vocab_size - 1` and takes the next primes not handed out yet.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from mini.config import ModelConfig
from mini.formats import e8m0_to_float
from mini.ops import use_fast
from mini.ops.linear import QWeight, linear
from mini.ops.stages import staged

DEAD = -1  # compressed id of a token that takes part in no n-gram (image spans)
GATE_FLOOR = 1e-6  # |dot| is clamped here before the signed square root, as in the training kernel


# ---------------------------------------------------------------------------------------------- table layout
def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for 64-bit n (these bases are exact below 3.3e24)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in bases:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@dataclass(frozen=True)
class EngramLayout:
    """Per engram layer: the prime modulus and first table row of each hash column (column = (n-1)*heads + head,
    n-gram-major), and the table's row count (the sum of its primes)."""
    layer_ids: tuple[int, ...]
    primes: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    num_embeddings: tuple[int, ...]


@lru_cache(maxsize=8)
def _layout(layer_ids: tuple[int, ...], vocab: int, max_ngram: int, heads: int) -> EngramLayout:
    handed_out: set[int] = set()
    primes = []
    for _ in layer_ids:
        cols = []
        for _ in range(max_ngram - 1):
            cur = vocab - 1
            for _ in range(heads):
                cur += 1
                while cur in handed_out or not _is_prime(cur):
                    cur += 1
                handed_out.add(cur)
                cols.append(cur)
        primes.append(tuple(cols))
    offsets = tuple(tuple(int(o) for o in np.cumsum([0, *p[:-1]])) for p in primes)
    return EngramLayout(tuple(layer_ids), tuple(primes), offsets, tuple(sum(p) for p in primes))


def engram_layout(cfg: ModelConfig) -> EngramLayout:
    return _layout(tuple(cfg.engram_layer_ids), cfg.engram_vocab_size, cfg.engram_max_ngram_size, cfg.engram_n_heads)


def hash_multipliers(cfg: ModelConfig, layer: int) -> np.ndarray:
    """int64 [max_ngram]: odd, and small enough that compressed_id * multiplier cannot overflow int64."""
    if cfg.engram_compressed_vocab_size <= 0:
        raise ValueError("engram_compressed_vocab_size is not set in the config")
    bound = max(1, (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2)
    rng = np.random.default_rng(10007 * layer)
    return rng.integers(0, bound, size=cfg.engram_max_ngram_size, dtype=np.int64) * 2 + 1


class EngramHasher:
    """Hash row ids of positions of one sequence, from its token ids (host side, numpy)."""

    def __init__(self, cfg: ModelConfig, token_map: np.ndarray):
        self.token_map = np.asarray(token_map, dtype=np.int64)
        if int(self.token_map.max()) + 1 != cfg.engram_compressed_vocab_size:
            raise ValueError(f"token map has {int(self.token_map.max()) + 1} compressed ids, the config says "
                             f"{cfg.engram_compressed_vocab_size}: every hash would be wrong")
        layout = engram_layout(cfg)
        self.lookback = cfg.engram_max_ngram_size
        self.heads = cfg.engram_n_heads
        self.pad = self.token_map[cfg.engram_pad_id]
        self.multipliers = np.stack([hash_multipliers(cfg, layer) for layer in layout.layer_ids])  # [Le, N]
        self.primes = np.array(layout.primes, dtype=np.int64)  # [Le, cols]
        self.offsets = np.array(layout.offsets, dtype=np.int64)  # [Le, cols]

    def compress(self, ids: np.ndarray) -> np.ndarray:
        """Token ids -> compressed ids; a negative token id marks a dead token (DEAD)."""
        ids = np.asarray(ids, dtype=np.int64)
        return np.where(ids < 0, DEAD, self.token_map[np.maximum(ids, 0)])

    def hash_ids(self, history: list[int], start: int, end: int) -> torch.Tensor:
        """int64 [end - start, n_engram_layers, n_hash_cols] for positions start..end-1 of the sequence `history`."""
        if not 0 <= start <= end <= len(history):
            raise ValueError(f"positions {start}..{end} outside a history of {len(history)} tokens")
        first = max(0, start - (self.lookback - 1))
        comp = self.compress(history[first:end])
        pos = np.arange(start, end)
        blocked = np.zeros(len(pos), dtype=bool)
        toks = np.empty((len(pos), self.lookback), dtype=np.int64)
        for shift in range(self.lookback):
            src = comp[np.maximum(pos - shift - first, 0)]
            blocked |= (pos < shift) | (src == DEAD)
            toks[:, shift] = np.where(blocked, self.pad, src)
        return self._hash(toks)

    def hash_last(self, tails: np.ndarray) -> torch.Tensor:
        """hash_ids of the last position of many sequences at once (a decode step): tails [B, lookback] int64, row b
        = the sequence's last `lookback` token ids in order, left-filled with -1 where the sequence is shorter (a
        position before the start blocks its n-grams as a dead token does) -> [B, n_engram_layers, n_hash_cols]."""
        src = self.compress(tails)[:, ::-1]  # column `shift` = the token `shift` positions back
        blocked = np.logical_or.accumulate(src == DEAD, axis=1)
        return self._hash(np.where(blocked, self.pad, src))

    def _hash(self, toks: np.ndarray) -> torch.Tensor:
        """toks [L, lookback] compressed ids of each position and its predecessors (pad once blocked) -> hash ids."""
        return torch.from_numpy(_fold(toks, self.multipliers, self.primes, self.offsets, self.heads, np.concatenate))

    def on_device(self, device) -> "DeviceEngramHasher":
        return DeviceEngramHasher(self, device)


class DeviceEngramHasher:
    """`EngramHasher.hash_last` in torch on `device`, from that hasher's own parameter arrays (copied once, here):
    a captured decode step hashes its token window without a trip to the host. Bit-equal to the numpy path: the
    same int64 operations (products, XOR, floor-modulo; numpy and torch both wrap int64 products modulo 2^64,
    though the multipliers are bounded so that no product overflows)."""

    def __init__(self, hasher: EngramHasher, device):
        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        self.token_map, self.multipliers = put(hasher.token_map), put(hasher.multipliers)
        self.primes, self.offsets = put(hasher.primes), put(hasher.offsets)
        self.pad, self.lookback, self.heads = int(hasher.pad), hasher.lookback, hasher.heads

    def hash_last(self, tails: torch.Tensor) -> torch.Tensor:
        """tails [B, lookback] int64 on the device, as for EngramHasher.hash_last -> [B, n_engram_layers, n_hash_cols].
        Device ops only (no host sync, fixed shapes): a CUDA graph can capture it."""
        comp = torch.where(tails < 0, DEAD, self.token_map[tails.clamp(min=0)]).flip(1)  # column = shift back
        blocked = (comp == DEAD).to(torch.int32).cummax(1).values.bool()  # logical_or.accumulate along the shifts
        return _fold(torch.where(blocked, self.pad, comp), self.multipliers, self.primes, self.offsets, self.heads,
                     torch.cat)


def _fold(toks, multipliers, primes, offsets, heads: int, cat):
    """The hash of `toks` [L, lookback] (numpy or torch int64 alike; `cat` joins along the last axis): multiply by
    each layer's multipliers, XOR-fold one look-back at a time, each column modulo its prime plus its row offset."""
    prod = toks[:, None, :] * multipliers[None]  # [L, Le, N]
    rolling, cols = prod[..., 0], []
    for n in range(1, toks.shape[1]):
        rolling = rolling ^ prod[..., n]
        cols.append(rolling[..., None] % primes[None, :, (n - 1) * heads:n * heads])
    return cat(cols, -1) + offsets[None]


# ---------------------------------------------------------------------------------------------- the module
@dataclass(eq=False)
class EngramWeights:
    embed: torch.Tensor  # float8_e4m3fn [rows, head_dim] (may stay on the host, memory-mapped)
    embed_scale: torch.Tensor  # E8M0 [rows, head_dim / 32]
    wkv: QWeight  # fp8 [(hc + 1) * D, n_hash_cols * head_dim]
    gate_weight: torch.Tensor  # fp32 [hc, D] = q_weight * k_weight (only the product is ever used)

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig) -> "EngramWeights":
        """Tensors `{prefix}engram.*`; `prefix` is the layer's (e.g. "layers.1."), or already ends in "engram."."""
        p = prefix if prefix.rstrip(".").endswith("engram") else f"{prefix}engram"
        p = p.rstrip(".") + "."
        gate = state[p + "q_weight"].float() * state[p + "k_weight"].float()
        return cls(state[p + "embed.weight"], state[p + "embed.scale"],
                   QWeight.from_state(state, p + "wkv", cfg.fp8_block), gate)

    def gather(self, hash_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw bytes of table rows, gathered where the table is: fp8 values as uint8 [..., head_dim] and E8M0
        scale bytes [..., head_dim / 32]."""
        ids = hash_ids.to(self.embed.device)
        return self.embed.view(torch.uint8)[ids], self.embed_scale.view(torch.uint8)[ids]

    def lookup(self, hash_ids: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
        """Dequantized table rows [..., head_dim] on `device` (the raw bytes travel, a quarter of fp32's)."""
        vals, scales = self.gather(hash_ids)
        return dequantize_rows(vals.to(device), scales.to(device), dtype)


def dequantize_rows(vals: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Table rows from their raw bytes (uint8 fp8 values [..., head_dim], E8M0 scale bytes [..., head_dim / 32], on
    one device): fp8 value * scale per group, exact in fp32 and so in bf16 unless the scale over- or underflows it.
    The one dequantization of every lookup path (in place, host tables prefetched), so all give the same bits."""
    v = vals.view(torch.float8_e4m3fn).float()
    s = _e8m0_values(vals.device)[scales.long()]
    group = v.shape[-1] // s.shape[-1]
    return (v.unflatten(-1, (-1, group)) * s.unsqueeze(-1)).flatten(-2).to(dtype)


@lru_cache(maxsize=8)
def _e8m0_values(device: torch.device) -> torch.Tensor:
    """fp32 [256]: the value of every E8M0 byte, on `device` (made once, outside any capture: decoding the bytes
    directly would copy constants from the host on each call, which a CUDA graph cannot capture)."""
    return e8m0_to_float(torch.arange(256, dtype=torch.int32).to(torch.uint8)).to(device)


@staged("hc_norm_other.engram")
def engram(h: torch.Tensor, hash_ids: torch.Tensor | None, w: EngramWeights, cfg: ModelConfig,
           token_mask: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """h [T, hc, D], hash_ids [T, n_hash_cols] -> h + gate * value [T, hc, D] in h.dtype. `rows` [T, n_hash_cols,
    head_dim], when given, are the table rows `w.lookup(hash_ids)` already looked up (a CUDA-graph decode step does
    the host-side lookup before its replay) and hash_ids is not used.

    key (one per copy) and value (shared) come from wkv(rows); the gate of copy c is
    sigmoid(signed_sqrt(<h_c * w_c, key_c> / (rms(h_c) * rms(key_c) * sqrt(D)))), normalised per (token, copy).
    token_mask [T] False closes the gate (image positions)."""
    if rows is None:
        rows = w.lookup(hash_ids, h.dtype, h.device)
    rows = rows.flatten(-2)  # [T, cols * head_dim]
    return gated_update(h, linear(rows, w.wkv), w.gate_weight.to(h.device), cfg.norm_eps, token_mask)


def gated_update(h: torch.Tensor, kv: torch.Tensor, gate_weight: torch.Tensor, eps: float,
                 token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """`engram`'s gate and update from wkv's output kv [T, (hc + 1) * D] (hc keys, then the value): h [T, hc, D] +
    gate [T, hc] * value, in h.dtype (fp32 math). One kernel on the fast path (mini/kernels/engram_gate.py) where it
    takes the tensors, else these ~20 torch ops."""
    if use_fast(h, kv, gate_weight):
        from mini.kernels.engram_gate import engram_gate, supported
        if supported(h, kv, gate_weight, token_mask):
            return engram_gate(h, kv, gate_weight, eps, GATE_FLOOR, token_mask)
    _, hc, dim = h.shape
    key = kv[:, :hc * dim].float().unflatten(-1, (hc, dim))
    value = kv[:, hc * dim:].float()
    hf = h.float()
    inv_rms = torch.rsqrt(hf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (hf * gate_weight * key).sum(-1) * inv_rms * dim ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_FLOOR).sqrt(), dot))
    if token_mask is not None:
        gate = gate.masked_fill(~token_mask.unsqueeze(-1), 0)
    return (hf + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(h.dtype)
