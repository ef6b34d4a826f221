"""The tiny presets' tokenizer: a deterministic byte-level BPE learned from a small built-in corpus, written
beside a `mini make-checkpoint` model (`tokenizer.json` + `tokenizer_config.json`).
"""
from __future__ import annotations

import json
import random
import unicodedata
from collections import Counter
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from mini.chat_format import ASSISTANT, END_THINK, SYSTEM, THINK, USER
from mini.tokenizer import BOS, EOS, PAD, _byte_chars

# the tiny tokenizer's fixed ids; BOS/EOS/pad match the real V4.1 vocabulary (0, 1, 2)
TINY_SPECIALS = (BOS, EOS, PAD, USER, ASSISTANT, SYSTEM, THINK, END_THINK)
_SPECIAL = (BOS, EOS, PAD)  # role and think markers stay visible when decoding with skip_special_tokens

_TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
She sells sea shells by the sea shore, and the shells she sells are surely sea shells.
In the beginning there was the token, and the token was encoded in bytes.
def forward(self, x):
    return self.norm(self.proj(x)) + x
for i in range(10):
    print(f"step {i}: loss={i * 0.5:.3f}")
import torch
import numpy as np
Hello, world! How are you today? I am fine, thank you. What is the answer? The answer is 42.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2026 3.14159 2.71828
Please think step by step, then write the final answer after the reasoning.
The model reads the prompt, computes the logits and samples the next token until it sees the end.
Bonjour, ça va très bien. Über den Wolken. ¿Dónde está la biblioteca? 你好，世界。こんにちは。
The attention layer compresses the keys and values; the indexer selects the top blocks for each query.
Engram looks up n-grams in large hashed tables and gates the value into the residual stream.
"""


TINY_MAX_VOCAB = 4096


def _filler_text(seed: int) -> str:
    """Deterministic pseudo-words that give BPE more pairs to merge."""
    rng = random.Random(seed)
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                    for _ in range(400)) + "\n"


def _train_merges(words: Counter, n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE: repeatedly merge the most frequent adjacent pair (ties: lexicographically smallest)."""
    seqs = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for w, count in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for w, s in seqs.items():
            i, merged = 0, []
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    merged.append(s[i] + s[i + 1])
                    i += 2
                else:
                    merged.append(s[i])
                    i += 1
            seqs[w] = merged
    return merges


def build_tiny_tokenizer(vocab_size: int = 512) -> _Backend:
    """A deterministic byte-level BPE: the fixed special tokens (ids 0..7), the 256 bytes, then merges learned
    from a small built-in corpus until `vocab_size` tokens exist. Encodes any UTF-8 text."""
    base = len(TINY_SPECIALS) + 256
    if vocab_size < base:
        raise ValueError(f"vocab_size must be at least {base}")
    if vocab_size > TINY_MAX_VOCAB:
        raise ValueError(f"the tiny tokenizer has at most {TINY_MAX_VOCAB} tokens")
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text, extra = unicodedata.normalize("NFC", _TINY_CORPUS), 0
    while True:
        merges = _train_merges(Counter(w for w, _ in pre.pre_tokenize_str(text)), vocab_size - base)
        if len(merges) == vocab_size - base:
            break
        text += _filler_text(extra)  # larger vocabularies than the corpus supports: add pseudo-words
        extra += 1
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS)}
    for tok in _byte_chars() + [a + b for a, b in merges]:
        vocab[tok] = len(vocab)
    backend = _Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    for t in TINY_SPECIALS:  # in id order; add_special_tokens would mark every token special
        token = AddedToken(t, special=t in _SPECIAL, normalized=False)
        (backend.add_special_tokens if t in _SPECIAL else backend.add_tokens)([token])
    return backend


def write_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> Path:
    """Write `tokenizer.json` + `tokenizer_config.json` of the tiny tokenizer into `out_dir`; returns out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
              "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "model_max_length": 1048576,
              "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2))
    return out
