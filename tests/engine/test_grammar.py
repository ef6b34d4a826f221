"""Grammar-constrained decoding in the engine: a random-logits model writes output that follows the grammar, with
overlapped steps exactly as without (the mask of step N+1 waits for step N's tokens, never uses stale state)."""
import json
import random
import threading

import jsonschema
import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

import torch
from fake_model import FakeConfig, FakeModel, FakeTokenizer
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
    return LLM(FakeModel(cfg), config=cfg, tokenizer=tokenizer or FakeTokenizer(), **opts)


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


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_unconstrained_rows_share_the_batch_unchanged(overlap, temperature):
    """Rows without a grammar next to constrained ones (their masks filled in the background when overlapped):
    their tokens and logprobs are bitwise those of the batch with no grammar at all."""
    def params(i, constrained=True):
        return SamplingParams(temperature=temperature, seed=i, max_tokens=12, ignore_eos=True, logprobs=2,
                              grammar=json_grammar(None) if constrained and i % 2 else None)
    mixed, free = _run(overlap, params), _run(overlap, lambda i: params(i, constrained=False))
    assert [o.token_ids for o in mixed[::2]] == [o.token_ids for o in free[::2]]
    assert [o.logprobs for o in mixed[::2]] == [o.logprobs for o in free[::2]]
    assert all(o.text.startswith("{") for o in mixed[1::2])


def test_overlapped_masks_fill_in_the_background(monkeypatch):
    """Overlapped, every decode step's masks are filled on the worker thread while the engine's thread does the
    previous step's bookkeeping, and its sampling is enqueued only after (never with a mask not filled yet); the
    outputs validate and equal the synchronous engine's. A batch with no grammar never starts a mask."""
    from mini.engine import structured
    from mini.engine.llm import LLMEngine
    order, fill, resolve = [], structured.MaskJob.fill, LLMEngine._resolve

    def spied_fill(job):
        order.append(("fill", threading.current_thread().name))
        fill(job)

    def spied_resolve(self, step):
        order.append(("resolve", threading.current_thread().name))
        return resolve(self, step)

    monkeypatch.setattr(structured.MaskJob, "fill", spied_fill)
    monkeypatch.setattr(LLMEngine, "_resolve", spied_resolve)

    def params(i):
        return SamplingParams(temperature=1.0, seed=i, max_tokens=400, grammar=json_grammar(SCHEMA))
    runs = {}
    for overlap in (False, True):  # (forced drafts off: their verify steps fill every row's mask on this thread)
        llm = fake_llm(overlap=overlap, tokenizer=ByteTokenizer(), max_num_seqs=8, forced_drafts=False)
        llm.engine.grammars.timings = timings = []
        order.clear()
        outs = llm.generate([f"p{i}" for i in range(5)], [params(i) for i in range(5)])
        runs[overlap] = [o.token_ids for o in outs]
        for o in outs:
            jsonschema.validate(json.loads(o.text), SCHEMA)
        background = [t.background for t in timings]
        assert all(t.rows > 0 and t.fill_s > 0 and t.exposed_s > 0 for t in timings)
        if overlap:  # all but the prefill's, the first decode's (nothing in flight before it) and those where
            # every row's matcher has ended (nothing to fill) run on the worker
            assert sum(background) >= len(timings) - 4 and sum(background) > 20
            assert ("fill", "mini-grammar-masks") in order
        else:
            assert not any(background) and all(name == "MainThread" for _, name in order)
    assert runs[True] == runs[False]
    free = fake_llm(overlap=True, tokenizer=ByteTokenizer())
    free.generate(["abc", "de"], SamplingParams(max_tokens=5, ignore_eos=True))
    assert free.engine._grammars is None  # no backend, no job: the plain step


def test_background_mask_equals_the_synchronous_one():
    """The same matchers filled on the worker thread and on this one give the same bits, ended rows allow EOS
    only, rows without a grammar allow everything; an error in the fill is raised by `result`."""
    from mini.engine.structured import GrammarBackend
    tok = ByteTokenizer()
    backend = GrammarBackend(tok, FakeConfig().vocab_size)
    ms = [backend.matcher(json_grammar(SCHEMA)) for _ in range(5)]
    backend.advance([(ms[1], tok.encode("{")[0]), (ms[2], tok.encode("x")[0])])  # 2: not allowed -> error state
    rows = [ms[0], None, ms[1], ms[2], ms[3]]
    sync = backend.bitmask(rows, "cpu")
    job = backend.start(rows, "cpu", background=True)
    assert job.background
    assert torch.equal(job.result(), sync)
    assert ms[2].is_error() and sync[3].tolist() == [2] + [0] * (sync.shape[1] - 1)  # EOS (id 1) only
    assert (sync[1] == -1).all() and not torch.equal(sync[0], sync[2])
    job = backend.start([ms[0]], "cpu", background=True)
    job.done.wait()
    job.error = RuntimeError("fill failed")
    with pytest.raises(RuntimeError, match="fill failed"):
        job.result()


def test_forced_tool_calls_parse_and_validate():
    def params(i):
        grammar = tool_call_grammar(TOOLS, only="get_weather" if i % 2 else None, parallel=bool(i % 3))
        return SamplingParams(temperature=1.0, seed=i, max_tokens=1000, grammar=grammar)  # parallel: ~2 calls
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
    counts = [len(parse_tool_calls(o.text, {"get_weather", "noop"})[1]) for o in outs]
    assert max(counts) > 1  # parallel calls can follow each other (a "\n" between calls once made it impossible)


def test_bad_grammar_is_a_value_error():
    llm = fake_llm(tokenizer=ByteTokenizer())
    with pytest.raises(ValueError, match="grammar"):
        llm.engine.check_prompt([5, 6], SamplingParams(grammar="start: undefined_rule"))
    with pytest.raises(ValueError, match="tokenizer"):
        fake_llm().engine.check_prompt([5, 6], SamplingParams(grammar=json_grammar(None)))


def test_matchers_are_copies_of_a_grammar_compiled_once(monkeypatch):
    """`check` compiles (on the request's thread) and `matcher` copies: no compile on the engine's thread for a
    grammar seen before; each copy starts fresh and moves on its own, its masks those of a newly compiled matcher;
    the last COMPILED_KEPT grammars are kept."""
    import mini.engine.structured as structured
    from mini.engine.sampler import unpack_bitmask
    tok, backend, _ = _matcher(json_grammar(None))
    compiled = []

    llmatcher = backend._ll.LLMatcher

    def counting(*args, **kw):
        compiled.append(args[1])
        return llmatcher(*args, **kw)
    monkeypatch.setattr(backend, "_ll", type("LL", (), {"LLMatcher": staticmethod(counting)}))
    grammar = tool_call_grammar(TOOLS, parallel=True)
    backend.check(grammar)
    a, b = backend.matcher(grammar), backend.matcher(grammar)
    assert compiled == [grammar]
    reference = backend._ll.LLMatcher(backend.tokenizer, grammar, log_level=0)
    text = tok.encode('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="noop">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    for t in text:
        masks = unpack_bitmask(backend.bitmask([a, b, reference], "cpu"), FakeConfig().vocab_size)
        assert torch.equal(masks[0], masks[2]) and masks[0][t]
        assert a.consume_token(t) and reference.consume_token(t)
        assert b.is_accepting() is False and not b.is_stopped()  # b has not moved
    assert a.is_accepting() and backend.matcher(grammar).consume_tokens(text[:3])
    for k in range(structured.COMPILED_KEPT):
        backend.check(f"start: {_lit_rule(k)}")
    backend.matcher(grammar)
    assert compiled.count(grammar) == 3  # the reference, then recompiled once evicted


def test_reasoning_ends_with_the_models_own_end_of_thinking_token():
    """V4.1's `</think>` is an added, not special, token: the model ends its reasoning with that one token, so a
    thinking-mode grammar allows it where `</think>` may come (llguidance alone takes it for a special token no
    grammar text matches, and the reasoning could never end). Special tokens (BOS, pad) stay out of text."""
    from mini.engine.sampler import unpack_bitmask
    from mini.engine.structured import GrammarBackend
    from mini.chat_format import END_THINK
    from mini.checkpoint.tiny_tokenizer import build_tiny_tokenizer
    from mini.tokenizer import Tokenizer
    tok = Tokenizer(build_tiny_tokenizer())
    end_think = tok.encode(END_THINK)
    assert len(end_think) == 1
    backend = GrammarBackend(tok, len(tok))
    for answer_is_json, grammar in ((True, json_grammar(SCHEMA, thinking=True)),
                                    (False, tool_call_grammar(TOOLS, thinking=True, optional=True))):
        m = backend.matcher(grammar)
        assert m.consume_tokens(tok.encode("some reasoning")), m.get_error()
        allowed = unpack_bitmask(backend.bitmask([m], "cpu"), len(tok))[0]
        assert allowed[end_think[0]] and not allowed[tok.bos_id] and not allowed[2]
        assert m.consume_tokens(end_think), m.get_error()
        after = unpack_bitmask(backend.bitmask([m], "cpu"), len(tok))[0]
        assert after[tok.encode("{")[0]] and bool(after[end_think[0]]) != answer_is_json  # JSON starts now


def _lit_rule(k):
    return json.dumps(f"x{k}")


def _tiny(model, device, dtype, **opts):
    from mini.model import load_model
    m, cfg, tok = load_model(model, device=device, dtype=dtype)
    return LLM(m, config=cfg, tokenizer=tok, device=device, dtype=dtype, **opts)


TINY_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                                "s": {"type": "string", "maxLength": 5},
                                                "b": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}},
               "required": ["n", "s", "b"], "additionalProperties": False}


def _constrained_runs(llms, n=6):
    rng = random.Random(1)
    prompts = [[rng.randrange(8, 512) for _ in range(rng.randint(3, 40))] for _ in range(n)]
    params = [SamplingParams(temperature=0.8 if i % 2 else 0, seed=i, max_tokens=120,
                             grammar=json_grammar(TINY_SCHEMA) if i != 2 else None, ignore_eos=i == 2)
              for i in range(n)]
    runs = {}
    for name, llm in llms:
        outs = llm.generate(prompts, params)
        runs[name] = [o.token_ids for o in outs]
        for i, o in enumerate(outs):
            if i != 2:
                assert o.finish_reason == "stop", o.text
                jsonschema.validate(json.loads(o.text), TINY_SCHEMA)
    return runs


def test_static_decode_path_with_device_fed_tokens(monkeypatch):
    """tiny-v4 through the static decode buffers on CPU, overlapped: the previous step's ids are fed on the
    device, so the grammar rows read them back after the launch (in LLMEngine._grammar_masks); tokens equal the
    plain engine's."""
    import mini.engine.model_runner as runner_module
    from mini.engine.llm import LLMEngine
    late, masks = [], LLMEngine._grammar_masks

    def spied(self, seqs, prev, device):
        late.append(prev is not None and prev.kept is None)  # the step in flight is not read back yet
        return masks(self, seqs, prev, device)

    monkeypatch.setattr(LLMEngine, "_grammar_masks", spied)
    llms = []
    for static, overlap in ((False, False), (True, True)):
        monkeypatch.setattr(runner_module, "use_cuda_graphs", lambda *a, s=static: s)
        llm = _tiny("tiny-v4", "cpu", torch.float32, num_blocks=64, block_tokens=128, max_num_seqs=8,
                    max_model_len=512, overlap=overlap)
        assert (llm.engine.runner.graphs is not None) == static and llm.engine.overlap == overlap
        llms.append((overlap, llm))
    late.clear()
    runs = _constrained_runs(llms)
    assert runs[True] == runs[False]
    assert sum(late) >= 10  # overlapped steps whose masks waited for the step in flight after their launch


@pytest.mark.gpu
def test_cuda_graphs_with_overlap_follow_the_grammar():
    """tiny-v4.1 in bf16 on the fast backend, CUDA-graph decode with and without overlapped steps (same graphs):
    every constrained output validates in both modes; in the deterministic mode (a row's bits do not depend on its
    step's rows) the tokens are the same. In the default mode they may differ: an overlapped step still carries a
    sequence that has just finished (mini/engine/llm.py), so a step can have 2 rows where the plain engine's has
    1, and the decode GEMV reads the weights by row count (docs/kernels.md; the 2-16-row FP8 read flipped a token of
    the unconstrained request so on an H100, docs/perf/044)."""
    from mini.ops import set_backend
    set_backend("fast")
    for deterministic in (False, True):
        # (forced drafts off: overlapped, a step in flight hides tokens to draft after, so the batches would
        # differ; test_forced_drafts' gpu test covers them on graphs)
        llms = [(mode, _tiny("tiny-v4.1", "cuda", torch.bfloat16, max_num_seqs=8, block_tokens=128,
                             max_model_len=1024, overlap=mode == "overlap", forced_drafts=False,
                             deterministic=deterministic, enable_prefix_caching=False))
                for mode in ("graphs", "overlap")]
        assert all(llm.engine.runner.graphs is not None for _, llm in llms)
        assert llms[1][1].engine.overlap and not llms[0][1].engine.overlap
        runs = _constrained_runs(llms, n=8)
        for _, llm in llms:
            llm.engine.close()
        if deterministic:
            assert runs["overlap"] == runs["graphs"]


@pytest.mark.parametrize("grammar", [json_grammar(SCHEMA, thinking=True), tool_call_grammar(TOOLS, thinking=True)])
def test_thinking_mode_constrains_only_after_the_reasoning(grammar):
    from mini.engine.sampler import unpack_bitmask
    from mini.engine.structured import GrammarBackend
    tok = ByteTokenizer()
    backend = GrammarBackend(tok, FakeConfig().vocab_size)
    m = backend.matcher(grammar)

    def allowed(text):
        return bool(unpack_bitmask(backend.bitmask([m], "cpu"), FakeConfig().vocab_size)[0, tok.encode(text)[0]])

    assert allowed("x") and allowed("{")  # free reasoning, anything but the end marker
    assert m.consume_tokens(tok.encode("free text, {not json</thi"))
    assert m.consume_tokens(tok.encode("nk>"))
    first = "{" if "%json" in grammar.split("answer:")[1].split("\n")[0] else "\n"
    assert allowed(first) and not allowed("x") and not allowed(chr(1) if first == "{" else "{")


def _matcher(grammar):
    from mini.engine.structured import GrammarBackend
    tok = ByteTokenizer()
    backend = GrammarBackend(tok, FakeConfig().vocab_size)
    return tok, backend, backend.matcher(grammar)


def _eos_allowed(backend, m):
    from mini.engine.sampler import unpack_bitmask
    return bool(unpack_bitmask(backend.bitmask([m], "cpu"), FakeConfig().vocab_size)[0, 1])


UNBOUNDED = [{"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}}, "required": ["text"]}}}]


def test_free_text_ends_at_its_delimiter():
    """Reasoning, raw string arguments and content before a block end at the first delimiter even when they hold
    its prefixes ('<', '</thi', '</｜DSML｜ par')."""
    text = ('reason </thi < </think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="echo">\n'
            '<｜DSML｜ parameter name="text" string="true">a </｜DSML｜ par <b> \n</｜DSML｜ parameter>\n'
            '<｜DSML｜ parameter name="n" string="false">12</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    tok, backend, m = _matcher(tool_call_grammar(UNBOUNDED, thinking=True))
    assert m.consume_tokens(tok.encode(text)), m.get_error()
    assert _eos_allowed(backend, m) and m.is_accepting()
    _, calls = parse_tool_calls(text.split("</think>")[1], {"echo"})
    assert json.loads(calls[0].arguments) == {"text": "a </｜DSML｜ par <b> \n", "n": 12}


@pytest.mark.parametrize("text,complete", [
    ("plain words with \n\n< and <｜DSML｜ but no block", True),
    ('some text\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="echo">\n<｜DSML｜ parameter name="text" string="true">'
     'x</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>', True),
    ('some text\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="echo">\n', False),
])
def test_auto_with_at_most_one_call(text, complete):
    tok, backend, m = _matcher(tool_call_grammar(UNBOUNDED, parallel=False, optional=True))
    assert m.consume_tokens(tok.encode(text)), m.get_error()
    assert _eos_allowed(backend, m) == complete
    if complete and "calls>" in text:  # the block is closed: nothing but EOS may follow
        assert not m.consume_tokens(tok.encode("\n"))
