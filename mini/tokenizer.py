"""Tokenizer: a `tokenizer.json` wrapper, streaming detokenization, the V4.1 chat prompt (spec §5), the Engram
compressed token map (spec §2.3), and a tiny byte-level BPE tokenizer for the tiny presets.
"""
from __future__ import annotations

import json
import random
import unicodedata
from collections import Counter
from functools import lru_cache
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
THINK = "<think>"
END_THINK = "</think>"
# the tiny tokenizer's fixed ids; BOS/EOS/pad match the real V4.1 vocabulary (0, 1, 2)
TINY_SPECIALS = (BOS, EOS, PAD, USER, ASSISTANT, SYSTEM, THINK, END_THINK)
_SPECIAL = (BOS, EOS, PAD)  # role and think markers stay visible when decoding with skip_special_tokens


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


# ------------------------------------------------------------------------------------------ chat prompt (V4.1)
EFFORT_PRESETS = {"low": 50, "high": 75, "max": 100}
DEFAULT_EFFORT = "high"


def _effort_line(effort) -> str:
    effort = DEFAULT_EFFORT if effort is None else effort
    if isinstance(effort, str):
        if effort not in EFFORT_PRESETS:
            raise ValueError(f"reasoning_effort must be 1..100 or one of {list(EFFORT_PRESETS)}, got {effort!r}")
        effort = EFFORT_PRESETS[effort]
    if not (isinstance(effort, int) and 1 <= effort <= 100):
        raise ValueError(f"reasoning_effort must be 1..100 or one of {list(EFFORT_PRESETS)}, got {effort!r}")
    return (f"Reasoning Effort: {effort} (range 1-100, the higher the value, the more thorough the reasoning)"
            "\n\n")


# DSML, V4.1's tool-call markup (spec §5): a block of invokes after the content, each with its parameters.
DSML = "｜DSML｜"
CALLS_OPEN, CALLS_CLOSE = f"<{DSML} calls>", f"</{DSML} calls>"
INVOKE_CLOSE = f"</{DSML} invoke>"
PARAM_CLOSE = f"</{DSML} parameter>"
TOOL_CALLS_START = "\n\n" + CALLS_OPEN  # where an assistant turn's calls begin (after its content)


def invoke_open(name: str) -> str:
    return f'<{DSML} invoke name="{name}">'


def param_open(name: str, is_string: bool) -> str:
    return f'<{DSML} parameter name="{name}" string="{"true" if is_string else "false"}">'


_TOOLS_TEMPLATE = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"{CALLS_OPEN}" block like the following:

{CALLS_OPEN}
{invoke_open("$TOOL_NAME")}
<{DSML} parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_CLOSE}
...
{INVOKE_CLOSE}
{invoke_open("$TOOL_NAME2")}
...
{INVOKE_CLOSE}
{CALLS_CLOSE}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside \
{THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def _json(value) -> str:
    """JSON as the V4.1 encoder writes it: default separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


def tool_name(name) -> str:
    """A tool's name as the prompt writes it: `name` or `namespace::name` (at most one `::`)."""
    if not isinstance(name, str) or not name or name.count("::") > 1 or name.startswith("::") \
            or name.endswith("::"):
        raise ValueError(f"invalid tool name {name!r}")
    return name


def render_tools(tools: list[dict]) -> str:
    """The `## Tools` section: each OpenAI tool's `function` object as JSON, one per line, keys in the order
    given."""
    functions = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict):
            raise ValueError("each tool must be {'type': 'function', 'function': {...}}")
        tool_name(fn.get("name"))
        functions.append(_json(fn))
    return _TOOLS_TEMPLATE.replace("{schemas}", "\n".join(functions))


def call_arguments(arguments) -> dict:
    """A call's arguments as a dict: an object, or a JSON string of one (decoded at most twice: clients send
    double-encoded strings); anything else is wrapped as {"arguments": value}."""
    value = arguments
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    return value if isinstance(value, dict) else {"arguments": arguments}


def render_tool_calls(calls: list[dict]) -> str:
    """An assistant turn's calls (OpenAI `tool_calls`) as DSML, starting with the blank line after the content.
    String values are written as is (string="true"), all others as JSON (string="false")."""
    invokes = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise ValueError("each tool call must be {'id': ..., 'type': 'function', 'function': {...}}")
        params = [param_open(k, isinstance(v, str)) + (v if isinstance(v, str) else _json(v)) + PARAM_CLOSE
                  for k, v in call_arguments(fn.get("arguments", "")).items()]
        invokes.append(invoke_open(tool_name(fn.get("name"))) + "\n" + "\n".join(params) + "\n" + INVOKE_CLOSE)
    return TOOL_CALLS_START + "\n" + "\n".join(invokes) + "\n" + CALLS_CLOSE


def _text(content) -> str:
    """Message content: a string, None, or text parts (joined by a blank line, as the V4.1 encoder does)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError("only text content parts are supported")
        parts.append(part["text"])
    return "\n\n".join(parts)


def _merge_tool_results(messages: list[dict]) -> list[dict]:
    """V4.1 has no tool role: a tool result joins the user turn as `<tool_result>...</tool_result>`, and
    consecutive user turns (text or results) merge, their parts joined by a blank line. Within a turn, results
    are put in the order of the calls (by id) of the latest assistant turn that made calls."""
    merged: list[dict] = []
    call_order: dict[str, int] = {}
    for msg in messages:
        role = msg.get("role")
        if role == "assistant" and msg.get("tool_calls"):
            call_order = {c["id"]: i for i, c in enumerate(msg["tool_calls"]) if isinstance(c, dict) and c.get("id")}
        if role not in ("user", "tool"):
            merged.append(dict(msg))
            continue
        part = (("result", msg.get("tool_call_id") or "", f"<tool_result>{_text(msg.get('content'))}</tool_result>")
                if role == "tool" else ("text", "", _text(msg.get("content"))))
        if merged and merged[-1].get("role") == "user" and "_parts" in merged[-1]:
            merged[-1]["_parts"].append(part)
        else:
            merged.append({"role": "user", "_parts": [part], "_order": call_order})
    for m in merged:
        parts = m.get("_parts")
        if parts is None:
            continue
        results = [p for p in parts if p[0] == "result"]
        if len(results) > 1 and m["_order"]:
            results.sort(key=lambda p: m["_order"].get(p[1], 0))  # stable: unknown ids keep their place first
            it = iter(results)
            parts[:] = [next(it) if p[0] == "result" else p for p in parts]
    return merged


def _is_turn_start(msg: dict, index: int) -> bool:
    """User turns and mid-conversation system messages are answered by the assistant."""
    return msg["role"] == "user" or (msg["role"] == "system" and index > 0)


def render_chat(messages: list[dict], thinking: bool = False, reasoning_effort=None, tools: list[dict] | None = None,
                drop_thinking: bool = True) -> str:
    """The V4.1 prompt text for OpenAI-style messages (system / developer / user / assistant / tool), ending with
    the assistant header: `<｜Assistant｜><think>` (thinking) or `<｜Assistant｜></think>` (chat).

    BOS, then in thinking mode `<｜System｜>Reasoning Effort: N (...)\\n\\n`, then the turns. `developer` is a
    system message. `tools` (OpenAI tool objects) are described after the first system message's text (an empty
    one is put first if there is none). Assistant turns are `[reasoning</think>]content[DSML calls]` then
    `<｜end▁of▁sentence｜>`. Earlier reasoning (before the last user turn) is dropped, unless tools are given or
    `drop_thinking` is False: then every assistant turn keeps its reasoning and every header opens `<think>`."""
    msgs = []
    for m in messages:
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"unsupported chat role {m.get('role')!r}")
        if m.get("tools"):
            raise ValueError("tools are given to render_chat's `tools`, not inside a message")
        msgs.append({**m, "role": role})
    if tools:
        first_system = next((m for m in msgs if m["role"] == "system"), None)
        if first_system is None:
            first_system = {"role": "system", "content": ""}
            msgs.insert(0, first_system)
        first_system["_tools"] = tools
    keep_all = bool(tools) or not drop_thinking  # the encoder keeps every turn's reasoning when tools exist
    msgs = _merge_tool_results(msgs)
    last_user = max((i for i, m in enumerate(msgs) if _is_turn_start(m, i)), default=-1)
    out = [BOS]
    if thinking:
        out += [SYSTEM, _effort_line(reasoning_effort)]
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "system":
            if i > 0 or not thinking:
                out.append(SYSTEM)
            out.append(_text(m.get("content")))
            if m.get("_tools"):
                out += ["\n\n", render_tools(m["_tools"])]
        elif role == "user":
            out += [USER, "\n\n".join(p[2] for p in m["_parts"])]
        else:  # assistant
            if thinking and (keep_all or i > last_user):
                out += [m.get("reasoning_content") or "", END_THINK]
            out.append(_text(m.get("content")))
            if m.get("tool_calls"):
                out.append(render_tool_calls(m["tool_calls"]))
            out.append(EOS)
        following = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
        if _is_turn_start(m, i) and following in (None, "assistant"):
            out += [ASSISTANT, THINK if thinking and (keep_all or i >= last_user) else END_THINK]
    return "".join(out)


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


# ------------------------------------------------------------------------------------------ tiny tokenizer
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
