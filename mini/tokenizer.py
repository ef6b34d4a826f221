"""Tokenizer: a `tokenizer.json` wrapper, streaming detokenization and the Engram compressed token map
(spec §2.3). The V4.1 chat prompt is `mini.chat_format`; the tiny presets' BPE tokenizer is made by
`mini.checkpoint.tiny_tokenizer`.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
from tokenizers import Regex, normalizers
from tokenizers import Tokenizer as _Backend

# the vocabulary's fixed tokens (ids 0, 1, 2 in V4.1 and in the tiny tokenizer)
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"


class Tokenizer:
    """A `tokenizers` backend plus the ids the engine needs. Special-token strings inside text encode as tokens;
    no BOS is added implicitly (the chat renderer writes it, as `add_bos_token: false` says)."""

    def __init__(self, backend: _Backend, config: dict | None = None):
        self.backend = backend
        config = config or {}
        self.bos_id = self._id(config.get("bos_token"), BOS)
        self.eos_id = self._id(config.get("eos_token"), EOS)

    def _id(self, entry, default: str) -> int:
        text = entry.get("content") if isinstance(entry, dict) else entry
        tid = self.backend.token_to_id(text or default)
        if tid is None:
            raise ValueError(f"tokenizer has no token {text or default!r}")
        return tid

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        cfg_file = path / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        return cls(_Backend.from_file(str(path / "tokenizer.json")), config)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, tid: int) -> str | None:
        return self.backend.id_to_token(tid)

    def stream(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Incremental detokenization: `push(id)` returns the text the new token completes. Text is decoded over a
    short window of recent tokens (so byte-level merges and spacing come out as in a full decode) and held back
    while it ends in an incomplete UTF-8 sequence (U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tok, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # window start: decoded context, already emitted
        self.read = 0  # tokens before this are fully emitted

    def _text(self, lo: int, hi: int) -> str:
        return self.tok.decode(self.ids[lo:hi], self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        done = self._text(self.prefix, self.read)
        full = self._text(self.prefix, len(self.ids))
        if full.endswith("\ufffd") or len(full) <= len(done):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(done):]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete UTF-8 tail at the end of generation)."""
        done = self._text(self.prefix, self.read)
        full = self._text(self.prefix, len(self.ids))
        self.prefix = self.read = len(self.ids)
        return full[len(done):]


# ------------------------------------------------------------------------------------------ Engram token map
def _engram_normalizer() -> normalizers.Normalizer:
    sentinel = "\ue000"  # keeps a token that is a lone space from stripping to "" and merging with others
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])


def compressed_token_map(tokenizer) -> np.ndarray:
    """int64 [len(tokenizer)]: token id -> compressed id. Tokens whose raw decode normalises alike share an id;
    a decode containing U+FFFD (a partial UTF-8 byte) is keyed by the raw token string; ids are given in
    first-seen order over token ids 0..len-1. `tokenizer`: ours, a `tokenizers.Tokenizer`, or an HF one."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "backend", tokenizer)
    norm = _engram_normalizer()
    keys: dict[str, int] = {}
    n = backend.get_vocab_size(with_added_tokens=True)
    out = np.empty(n, dtype=np.int64)
    for tid in range(n):
        text = backend.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(tid)
        else:
            key = norm.normalize_str(text) or text
        out[tid] = keys.setdefault(key, len(keys))
    return out


@lru_cache(maxsize=4)
def _token_map_of(path: str) -> np.ndarray:
    return compressed_token_map(_Backend.from_file(str(Path(path) / "tokenizer.json")))


def load_token_map(model_dir: str | Path) -> np.ndarray:
    """The compressed token map of the tokenizer in `model_dir` (computed once per process)."""
    return _token_map_of(str(Path(model_dir).resolve()))


def _byte_chars() -> list[str]:
    """The byte-level alphabet (GPT-2 convention): printable bytes map to themselves, the others to U+0100+."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars
