"""Images through the engine (issue 29 item 3) on the tiny vision preset (tiny-v4.1-vl), fp32 on CPU: the engine's
greedy output equals the model driven directly (the f3 harness's path, `mini logits --image`), each image is encoded
once however many chunks, sequences or recomputations read it, no prefill chunk cuts a span, and the prefix cache
tells images apart by their content."""
import importlib.util
import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import mini.engine.model_runner as runner_module
from mini.config import preset
from mini.engine import LLM, SamplingParams
from mini.model.image_input import expand_prompt, load_image

sys.path.insert(0, str(Path(__file__).parents[1] / "parity"))
from official_f3 import run_logits  # noqa: E402  (the model driven directly, as for the official fixture f3)


def _model_fixtures():
    """tests/model's layout-invariant roundings: chunked, batched and recomputed prefills then compute what one
    prefill does, bit for bit (without them they agree to rounding, which may flip a greedy near-tie)."""
    spec = importlib.util.spec_from_file_location("model_conftest", Path(__file__).parents[1] / "model" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.batch_invariant_gemms, module.layout_invariant_rounding


batch_invariant_gemms, layout_invariant_rounding = _model_fixtures()
INVARIANT = pytest.mark.usefixtures("batch_invariant_gemms", "layout_invariant_rounding")

STEPS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)


def _png(w: int, h: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _llm(**opts) -> LLM:
    return LLM("tiny-v4.1-vl", device="cpu", dtype=torch.float32,
               **{"num_blocks": 64, "block_tokens": 16, "max_num_batched_tokens": 512, **opts})


@pytest.fixture(scope="module")
def llm():
    return _llm(num_blocks=4, block_tokens=128)  # the direct path's cache layout (run_logits)


def _prompt(cfg, seeds=(1, 2), sizes=((200, 160), (120, 330)), text=(7, 20, 9), text_seed=0):
    """Text, an image, text, another image, text (PromptImages): 96 tokens, spans of 26 and 34 at 7 and 53."""
    g = torch.Generator().manual_seed(text_seed)
    words = [torch.randint(3, cfg.vocab_size - 8, (n,), generator=g).tolist() for n in text]
    ids = words[0]
    for k in range(len(seeds)):
        ids = ids + [cfg.image_token_id] + words[k + 1]
    return expand_prompt(ids, [load_image(_png(w, h, s), cfg) for s, (w, h) in zip(seeds, sizes)], cfg)


def _direct(model, pi, tokens):
    """(greedy ids, logprob of each) of the model driven directly: one prefill, then a decode step per token."""
    prefill, decode, _ = run_logits(model, model.config, pi, tokens, dtype=torch.float32)
    rows = torch.from_numpy(np.concatenate([prefill[-1:], decode[:-1]]))
    return rows.argmax(-1).tolist(), rows.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def _counting(llm):
    """Count the vision tower's calls and the images it encodes (wraps the engine's model)."""
    tower, calls = llm.engine.model.vision, []
    spans = tower.spans
    tower.spans = lambda images, batched=None: (calls.append(len(images)), spans(images, batched))[1]
    return calls


@pytest.mark.usefixtures("batch_invariant_gemms")  # the direct path's prefill takes logits of every row
def test_greedy_with_images_equals_the_direct_forward(llm):
    pi = _prompt(llm.engine.config)
    out = llm.generate([pi.ids], GREEDY, images=[pi.spans()])[0]
    ids, logprobs = _direct(llm.engine.model, pi, out.token_ids)
    assert out.token_ids == ids
    assert [lp.logprob for lp in out.logprobs] == logprobs  # bitwise: the same logits


def _chunks(llm):
    """Record every scheduled chunk (seq, start, end)."""
    seen, schedule = [], llm.engine.scheduler.schedule

    def recording(*args, **kw):
        plan = schedule(*args, **kw)
        seen.extend((c.seq.request_id, c.start, c.end) for c in plan.chunks)
        return plan
    llm.engine.scheduler.schedule = recording
    return seen


@INVARIANT
def test_chunked_prefill_keeps_spans_whole_and_encodes_each_image_once():
    """A 16-token budget: the spans (26 and 34 tokens, longer than the budget) go alone, uncut, over the budget; the
    text between them is chunked as usual. Two sequences with the same images: each image encoded once."""
    llm = _llm(max_num_batched_tokens=16, enable_prefix_caching=False)
    pi = _prompt(llm.engine.config)
    calls, chunks = _counting(llm), _chunks(llm)
    outs = llm.generate([pi.ids, pi.ids], GREEDY, images=[pi.spans(), pi.spans()])
    assert calls == [1, 1] and llm.engine.model.span_cache.encoded == 2  # each in its span's step, for both
    want, _ = _direct(llm.engine.model, pi, outs[0].token_ids)
    assert [o.token_ids for o in outs] == [want, want]
    for _, start, end in chunks:
        assert not any(s.start < end < s.end for s in pi.spans()), (start, end)
    assert (("offline-0", 7, 33) in chunks and ("offline-0", 53, 87) in chunks)  # alone, whole
    assert max(end - start for _, start, end in chunks) == 34  # over the 16-token budget: only a span does that


@INVARIANT
def test_a_span_that_fits_waits_for_room_rather_than_being_cut():
    llm = _llm(max_num_batched_tokens=64, enable_prefix_caching=False)
    pi = _prompt(llm.engine.config)
    chunks = _chunks(llm)
    out = llm.generate([pi.ids], GREEDY, images=[pi.spans()])[0]
    assert out.token_ids == _direct(llm.engine.model, pi, out.token_ids)[0]
    assert chunks[:2] == [("offline-0", 0, 53), ("offline-0", 53, 96)]  # 0..64 would cut the span at 53..87



@INVARIANT
def test_prefix_cache_same_image_hits_a_different_image_misses():
    """117-token prompts (spans at 7..33 and 53..87), 16-token blocks, a snapshot at the prompt's last block
    boundary (112): the same images hit there; a different second image misses from its span on."""
    llm = _llm(max_num_seqs=1, snapshot_prompt_end=True)
    cfg = llm.engine.config
    a = _prompt(cfg, seeds=(1, 2), text=(7, 20, 30))
    b = _prompt(cfg, seeds=(1, 3), text=(7, 20, 30))  # the second image differs, same size: same ids, same span
    assert a.ids == b.ids and a.images[1].digest != b.images[1].digest
    calls = _counting(llm)
    first, again, other = llm.generate([a.ids, a.ids, b.ids], GREEDY, images=[a.spans(), a.spans(), b.spans()])
    assert calls == [2, 1]  # a's two images in its first chunk (0..112), then b's second one
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 112 and again.token_ids == first.token_ids
    assert other.num_cached_tokens < 53  # never into the second span
    assert other.logprobs[0].logprob != first.logprobs[0].logprob  # the image, not a cached block of a's, read
    assert other.token_ids == _direct(llm.engine.model, b, other.token_ids)[0]


@INVARIANT
def test_preemption_recomputes_spans_from_the_cache():
    """Six blocks of 32 positions for two sequences of 96 + 40 tokens: the later one is preempted
    and recomputed, reading its images from the span cache; every output equals the direct forward."""
    llm = _llm(num_blocks=6, block_tokens=32, max_num_batched_tokens=64, enable_prefix_caching=False)
    cfg = llm.engine.config
    prompts = [_prompt(cfg, seeds=(1, 2)), _prompt(cfg, seeds=(4, 5), text_seed=1)]
    calls = _counting(llm)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([p.ids for p in prompts], long, images=[p.spans() for p in prompts])
    assert llm.engine.stats.preemptions > 0
    assert sum(calls) == 4  # four images, each once: a preempted sequence still holds its images
    assert not llm.engine.model.span_cache.spans  # released once both finished
    for p, o in zip(prompts, outs):
        assert o.token_ids == _direct(llm.engine.model, p, o.token_ids)[0]


def test_span_cache_releases_an_image_when_no_live_sequence_holds_it():
    """Two requests share an image (seed 1), one has another (seed 2): the shared image stays until the second of
    its requests finishes, the other goes with its own; an aborted request releases its image too; a later request
    with a released image encodes it again."""
    llm = _llm(enable_prefix_caching=False)
    engine, cache = llm.engine, llm.engine.model.span_cache
    cfg = engine.config
    both, shared_only = _prompt(cfg, seeds=(1, 2)), _prompt(cfg, seeds=(1,), sizes=((200, 160),), text=(7, 9))
    shared, other = (im.digest for im in both.images)
    released, release = [], engine.model.release_images
    engine.model.release_images = lambda digests: (released.append(list(digests)), release(digests))[1]

    def run_until_finished(request_id):
        while engine.has_work():
            if any(o.finished and o.request_id == request_id for o in engine.step()):
                return
        raise AssertionError(f"{request_id} never finished")
    engine.add_request("a", both.ids, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), both.spans())
    engine.add_request("b", shared_only.ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       shared_only.spans())
    engine.step()  # both prefills: three spans, two images encoded
    assert set(cache.spans) == {shared, other} and cache.encoded == 2
    run_until_finished("a")
    assert set(cache.spans) == {shared} and released == [[other]]  # b still holds the shared image
    run_until_finished("b")
    assert not cache.spans and released == [[other], [shared]]
    engine.add_request("c", both.ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), both.spans())
    engine.step()
    assert set(cache.spans) == {shared, other} and cache.encoded == 4  # released: encoded again
    engine.abort("c")
    assert not cache.spans and sorted(released[-1]) == sorted([shared, other])
    while engine.has_work():
        engine.step()
    assert len(released) == 3  # nothing released twice


@INVARIANT
def test_a_prompt_ending_in_an_image_decodes_with_its_span_dead_for_engram(monkeypatch):
    """The decode tokens right after a span hash their n-grams with the span's positions dead, on the eager path
    and on the static decode path (the one CUDA graphs capture; on CPU it runs uncaptured)."""
    cfg = _llm().engine.config
    pi = _prompt(cfg, seeds=(1,), sizes=((60, 50),), text=(7, 0))  # a span of 10 tokens at 7
    assert pi.starts[0] + len(pi.images[0].token_types) == len(pi.ids)  # the prompt ends with the span
    for static in (False, True):
        monkeypatch.setattr(runner_module, "use_cuda_graphs", lambda *a: static)
        llm = _llm()
        assert (llm.engine.runner.graphs is not None) == static
        out = llm.generate([pi.ids], GREEDY, images=[pi.spans()])[0]
        ids, logprobs = _direct(llm.engine.model, pi, out.token_ids)
        assert out.token_ids == ids
        assert np.allclose([lp.logprob for lp in out.logprobs], logprobs, atol=1e-5)


def test_requests_with_images_are_checked():
    text_only = LLM("tiny-v4.1", device="cpu", dtype=torch.float32, num_blocks=16, block_tokens=16)
    vl = _llm()
    pi = _prompt(vl.engine.config)
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.generate([pi.ids], GREEDY, images=[pi.spans()])
    spans = pi.spans()
    with pytest.raises(ValueError, match="not a span of the prompt"):
        vl.generate([pi.ids[:50]], GREEDY, images=[spans])  # the second span is past the prompt's end
    with pytest.raises(ValueError, match="not a span of the prompt"):
        vl.generate([pi.ids], GREEDY, images=[spans[::-1]])  # out of order


@pytest.mark.gpu
def test_cuda_graphs_with_images_equal_eager():
    """On the GPU (bf16, fast backend): decode steps replayed from CUDA graphs, their Engram tails marked from
    DecodeRows.images, give the tokens of the eager engine, for prompts ending in a span and with text after."""
    cfg = preset("tiny-v4.1-vl")
    prompts = [_prompt(cfg), _prompt(cfg, seeds=(1,), sizes=((60, 50),), text=(7, 0))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = []
    for eager in (False, True):
        llm = LLM("tiny-v4.1-vl", device="cuda", dtype=torch.bfloat16, num_blocks=64, block_tokens=16,
                  max_num_seqs=4, enforce_eager=eager)
        assert (llm.engine.runner.graphs is None) == eager
        outs.append([o.token_ids for o in llm.generate([p.ids for p in prompts], params,
                                                       images=[p.spans() for p in prompts])])
    assert outs[0] == outs[1]


# ----------------------------------------------------------------------- the scheduler's spans, on the fake model
def _fake_vl_llm(**opts):
    """The fake model taking requests with images (it reads their ids as text): the scheduler's side alone."""
    sys.path.insert(0, str(Path(__file__).parent))
    from fake_model import FakeModel, fake_llm

    class FakeVL(FakeModel):
        reads_images = True
    return fake_llm(FakeVL, **opts)


def _span(start, length, tag="x"):
    from mini.step import ImageSpan
    return ImageSpan(start, length, tag, data=None)


@pytest.mark.parametrize("deterministic", [False, True])
def test_spans_stay_whole_beside_decodes_and_in_deterministic_chunks(deterministic):
    """A 40-token budget with 4 decoding sequences: a 50-token span goes over the budget as the step's only prefill
    chunk; a 20-token span waits rather than being cut; the deterministic mode's fixed chunks move to span edges
    (and still finish); every output equals the same prompt's alone."""
    prompt = [7 + i % 50 for i in range(130)]
    spans = [_span(10, 50, "a"), _span(75, 20, "b")]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = _fake_vl_llm(max_num_batched_tokens=512).generate([prompt], params, images=[spans])[0].token_ids
    llm = _fake_vl_llm(max_num_batched_tokens=40, max_num_seqs=8, deterministic=deterministic,
                       enable_prefix_caching=False)
    model = llm.engine.model
    others = [[3 + i] * 5 for i in range(4)]
    outs = llm.generate(others + [prompt], params, images=[[]] * 4 + [spans])
    assert outs[-1].token_ids == alone
    image_chunks = []
    for step in model.calls:
        for start, length in step:
            if length > 1 and start < 130 and start + length > 6:  # the long prompt's chunks
                image_chunks.append((start, start + length))
                assert not any(s.start < start + length < s.end for s in spans), (start, length)
        prefills = [length for _, length in step if length > 1]
        if sum(length for _, length in step) > 40:  # over the budget: only with a span too long for any step
            assert prefills == [50], step
    assert (10, 60) in image_chunks  # the long span went whole, alone
    assert any(sum(length for _, length in step) > 40 and len(step) > 1 for step in model.calls)  # beside decodes


def test_a_span_longer_than_a_prefill_cap_goes_whole():
    """EP ranks' lock step caps a rank's prefill tokens while another rank only decodes (`step(prefill_cap=)`), a
    cut that may last as long as traffic does. A 50-token span under a 16-token cap (the budget 512) goes whole,
    beside the decodes, rather than waiting for the cap to lift; a 20-token one as well; the text is cut to the cap
    (0..10 stops at the first span, 60..75 at the second)."""
    prompt = [7 + i % 50 for i in range(130)]
    spans = [_span(10, 50, "a"), _span(75, 20, "b")]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = _fake_vl_llm(max_num_batched_tokens=512).generate([prompt], params, images=[spans])[0].token_ids
    llm = _fake_vl_llm(max_num_batched_tokens=512, max_num_seqs=8, enable_prefix_caching=False)
    engine, model = llm.engine, llm.engine.model
    for i in range(3):
        engine.add_request(f"other-{i}", [3 + i] * 5, params)
    engine.step()  # the others' prompts: they decode from now on
    engine.add_request("image", prompt, params, spans)
    done = {}
    for _ in range(40):
        done.update({o.request_id: o for o in engine.step(prefill_cap=16) if o.finished})
        if not engine.has_work():
            break
    assert done["image"].token_ids == alone
    prefills = [(start, start + length) for step in model.calls[1:] for start, length in step if length > 1]
    assert prefills[:5] == [(0, 10), (10, 60), (60, 75), (75, 95), (95, 111)], prefills
