"""Grammar-constrained decoding in the engine: a random-logits model writes output that follows the grammar, with
overlapped steps exactly as without (the mask of step N+1 waits for step N's tokens, never uses stale state)."""
import json
import random

import jsonschema
import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

import torch
from fake_model import FakeBatch, FakeCache, FakeConfig, FakeModel, FakeSeqChunk, FakeTokenizer
from mini.engine import LLM
from mini.engine import SamplingParams
from mini.server.grammars import json_grammar, tool_call_grammar
from mini.server.tool_calls import parse_tool_calls
from mini.tokenizer import _byte_chars


class ByteTokenizer(FakeTokenizer):
    """The fake model's tokenizer (id = byte + 3) with a `tokenizers` backend, as the grammar backend needs."""
    eos_id = 1

    def __init__(self):
        vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, **{c: 3 + b for b, c in enumerate(_byte_chars())}}
        self.backend = Backend(models.BPE(vocab=vocab, merges=[]))
        self.backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.backend.decoder = decoders.ByteLevel()
        self.backend.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<pad>")])
        assert self.backend.encode("a{é").ids == self.encode("a{é")


def fake_llm(tokenizer=None, **opts):
    cfg = FakeConfig()
    opts = {"num_blocks": 256, "block_tokens": 4, "device": "cpu", "dtype": torch.float32, **opts}
    return LLM(FakeModel(cfg), config=cfg, tokenizer=tokenizer or FakeTokenizer(), batch_cls=FakeBatch,
               cache_cls=FakeCache, seq_chunk_cls=FakeSeqChunk, **opts)


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}, "ok": {"type": "boolean"}},
    "required": ["name", "n", "tags", "ok"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                     "unit": {"type": "string", "enum": ["C", "F"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]


def _run(overlap, params, n=6):
    llm = fake_llm(overlap=overlap, tokenizer=ByteTokenizer(), max_num_seqs=8)
    rng = random.Random(0)
    prompts = ["".join(rng.choice("abc {}") for _ in range(rng.randint(2, 9))) for _ in range(n)]
    return llm.generate(prompts, [params(i) for i in range(n)])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate_with_and_without_overlap(temperature):
    def params(i):
        return SamplingParams(temperature=temperature, seed=i, max_tokens=400, grammar=json_grammar(SCHEMA))
    plain, over = _run(False, params), _run(True, params)
    assert [o.token_ids for o in over] == [o.token_ids for o in plain]
    for o in plain:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_unconstrained_rows_share_the_batch_unchanged():
    def params(i):
        return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                              grammar=json_grammar(None) if i % 2 else None)
    mixed, free = _run(True, params), _run(True, lambda i: SamplingParams(temperature=0, max_tokens=12,
                                                                         ignore_eos=True))
    assert [o.token_ids for o in mixed[::2]] == [o.token_ids for o in free[::2]]
    assert all(o.text.startswith("{") for o in mixed[1::2])


def test_forced_tool_calls_parse_and_validate():
    def params(i):
        grammar = tool_call_grammar(TOOLS, only="get_weather" if i % 2 else None, parallel=bool(i % 3))
        return SamplingParams(temperature=1.0, seed=i, max_tokens=600, grammar=grammar)
    outs = _run(True, params)
    for i, o in enumerate(outs):
        assert o.finish_reason == "stop", o.text
        content, calls = parse_tool_calls(o.text, {"get_weather", "noop"})
        assert content == "" and calls, o.text
        assert len(calls) == 1 or i % 3
        for c in calls:
            assert c.name == "get_weather" or not i % 2
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == c.name)
            jsonschema.validate(json.loads(c.arguments), schema)


def test_bad_grammar_is_a_value_error():
    llm = fake_llm(tokenizer=ByteTokenizer())
    with pytest.raises(ValueError, match="grammar"):
        llm.engine.check_prompt([5, 6], SamplingParams(grammar="start: undefined_rule"))
    with pytest.raises(ValueError, match="tokenizer"):
        fake_llm().engine.check_prompt([5, 6], SamplingParams(grammar=json_grammar(None)))
