"""DSpark, the draft module (mini/model/dspark.py, mini/ops/dspark_attention.py): config, checkpoint inventory,
the draft attention op against its plain definition, the rings, `mini logits --dspark`. The comparison with the
official draft forward is tests/parity/test_dspark_f4.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mini.checkpoint.inventory import expected_tensors, skip_reason
from mini.checkpoint.load import load_state
from mini.config import ModelConfig, preset
from mini.ops.dspark_attention import draft_attention, draft_key_lists, draft_key_rows, plain_draft_attention

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "v41_reference"


def test_config_fields_round_trip_and_who_has_a_draft():
    tiny = preset("tiny-v4.1-dspark")
    assert tiny.has_dspark and ModelConfig.from_hf(tiny.to_hf()) == tiny
    f4 = ModelConfig.load(FIXTURES / "f4")
    assert (f4.n_mtp_layers, f4.dspark_block_size, f4.dspark_noise_id) == (3, 5, 1023)
    assert f4.dspark_target_layers == (3, 4, 5)
    assert (f4.dspark_markov_rank, f4.dspark_n_routed_experts, f4.dspark_n_activated_experts) == (32, 4, 2)
    assert [p.layer for p in f4.dspark_layers] == [6, 7, 8] and not any(p.yarn or p.ratio for p in f4.dspark_layers)
    assert f4.dspark_moe.n_activated_experts == 2 and f4.dspark_moe.n_routed_experts == 4
    # the backbone presets keep their checkpoints: no draft; V4's MTP block is another design
    assert not preset("tiny-v4.1").has_dspark and not preset("v4.1-flash").has_dspark
    assert not preset("v4-flash").has_dspark and preset("v4-flash").n_mtp_layers == 1
    with pytest.raises(ValueError, match="dspark_target_layers"):
        tiny.replace(dspark_target_layers=(8,))


def test_the_inventory_is_each_fixture_checkpoint():
    """Strict loading: every `mtp.*` tensor of the fixtures (one stage in f0-f2, three in f4) is expected."""
    for name, stages in (("f0", 1), ("f4", 3)):
        cfg = ModelConfig.load(FIXTURES / name)
        state = load_state(FIXTURES / name, cfg, progress=False)
        mtp = {n for n in state if n.startswith("mtp.")}
        assert {n.split(".")[1] for n in mtp} == {str(s) for s in range(stages)}
        assert f"mtp.{stages - 1}.markov_head.embed.weight" in mtp and "mtp.0.main_proj.scale" in mtp
        assert skip_reason("mtp.0.attn.wkv.weight", cfg) is None
    assert skip_reason("mtp.0.attn.wkv.weight", preset("tiny-v4.1")) == "mtp"
    # the draft's experts are never split over EP ranks: a rank holds the whole draft
    tiny = preset("tiny-v4.1-dspark")
    some = expected_tensors(tiny, range(0, 4))
    assert "mtp.2.ffn.experts.7.w1.weight" in some and "layers.0.ffn.experts.4.w1.weight" not in some


def _attention_inputs(B=3, k=5, H=4, D=64, W=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, k, H, D, generator=g).to(torch.bfloat16)
    block = torch.randn(B, k, D, generator=g).to(torch.bfloat16)
    ring = torch.randn(B + 1, W, D, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, generator=g)
    return q, block, ring, sink


def test_draft_attention_is_its_plain_definition():
    """Ring slots 0..n-1 of the sequence's slot, then the whole block (no causal mask), a sink in the denominator;
    to the rounding of P to bf16 before P·V."""
    q, block, ring, sink = _attention_inputs()
    slots, n_ring = torch.tensor([2, 0, 3]), torch.tensor([16, 1, 7])
    o = draft_attention(q, block, ring, slots, n_ring, sink, 64 ** -0.5)
    ref = plain_draft_attention(q, block, ring, slots, n_ring, sink, 64 ** -0.5)
    assert torch.allclose(o.float(), ref.float(), atol=2e-2, rtol=2e-2)
    # slots past n_ring and other sequences' rings are never read
    poisoned = ring.clone()
    poisoned[0, 1:] = float("nan")
    poisoned[1] = float("nan")
    poisoned[3, 7:] = float("nan")
    assert torch.equal(draft_attention(q, block, poisoned, slots, n_ring, sink, 64 ** -0.5), o)
    # every block key is seen by every block query: changing the last key moves the first query's output
    moved = block.clone()
    moved[:, -1] += 1
    assert not torch.equal(draft_attention(q, moved, ring, slots, n_ring, sink, 64 ** -0.5)[:, 0], o[:, 0])


def test_draft_key_rows_are_the_key_lists():
    """The FlashMLA form of a draft's list (one key tensor, a row list per query, its count) holds the same keys in
    the same order as the reference's lists, -1 past each list's end, for each of the draft's k queries."""
    q, block, ring, sink = _attention_inputs(B=4, k=3, W=16)
    slots, n_ring = torch.tensor([2, 0, 4, 1]), torch.tensor([16, 1, 7, 9])
    keys, valid = draft_key_lists(block, ring, slots, n_ring)
    kv, rows, count = draft_key_rows(block, ring, slots, n_ring, 8)
    assert rows.shape == (12, 24) and rows.dtype == count.dtype == torch.int32
    for t in range(12):
        b, n = t // 3, int(count[t])
        assert n == int(n_ring[b]) + 3 and (rows[t, n:] == -1).all() and (rows[t, :n] >= 0).all()
        assert torch.equal(kv[rows[t, :n].long()].float(), keys[b][valid[b]])


def test_draft_attention_under_auto_checks_flashmla_once(monkeypatch):
    """MINI_SPARSE_ATTN=auto: the draft's first FlashMLA-shaped call runs both kernels, keeps the library's output
    and settles the switch (the backbone's rule, mini.ops.attention.settle_by_first_call); a library that differs
    is warned of and the switch settles on our kernels, with the reference's output kept."""
    import mini.ops.dspark_attention as op
    from mini.ops import backends
    q, block, ring, sink = _attention_inputs()
    args = (q, block, ring, torch.tensor([2, 0, 3]), torch.tensor([16, 1, 7]), sink, 64 ** -0.5)
    ref = draft_attention(*args)
    monkeypatch.setattr(op, "draft_kernel", lambda *a: "flashmla-checked")
    close = (ref.float() * 1.01).to(ref.dtype)  # within the check's 2e-2 per token, yet not the reference's bits
    for library_out, settled in ((close, "flashmla"), (ref + 1, "triton")):
        monkeypatch.setattr(op, "_flashmla", lambda *a, o=library_out: o)
        monkeypatch.setattr(backends, "_libraries", {"sparse_attn": "auto-flashmla"})
        if settled == "triton":
            with pytest.warns(UserWarning, match="DSpark's draft attention"):
                out = draft_attention(*args)
        else:
            out = draft_attention(*args)
        assert torch.equal(out, ref if settled == "triton" else library_out)
        assert backends.sparse_attn() == settled


def needs_flashmla(test):
    from mini.kernels.flashmla_attention import available
    return pytest.mark.gpu(pytest.mark.skipif(
        not available(), reason="sgl-flash-mla (with its SM90 kernels) does not import on an SM90 GPU here")(test))


@needs_flashmla
@pytest.mark.parametrize("library", ["flashmla", "auto-flashmla"])
def test_draft_attention_on_flashmla_is_the_reference_gpu(library, monkeypatch):
    """V4.1-Flash's shape (64 heads x 512, W = 128, k = 5), odd B, rings partly filled (slots past n_ring and the
    rings of other sequences NaN: never read): FlashMLA's draft attention against the reference op per token
    (tests/kernels/test_flashmla_attention.py's bound: the same arithmetic, other roundings of P), in a CUDA graph
    too; under auto the first call checks the library and settles the switch."""
    import mini.ops.dspark_attention as op
    from mini.ops import backends
    from tests.kernels.test_flashmla_attention import assert_close_per_token
    g = torch.Generator(device="cuda").manual_seed(7)
    B, k, H, D, W = 5, 5, 64, 512, 128
    q = torch.randn(B, k, H, D, device="cuda", generator=g).bfloat16()
    block = torch.randn(B, k, D, device="cuda", generator=g).bfloat16()
    ring = torch.randn(B + 3, W, D, device="cuda", generator=g).bfloat16()
    slots, n_ring = torch.tensor([6, 0, 3, 1, 5], device="cuda"), torch.tensor([128, 1, 37, 128, 64], device="cuda")
    for s, n in zip(slots.tolist(), n_ring.tolist()):
        ring[s, n:] = float("nan")
    ring[[2, 4, 7]] = float("nan")
    sink = torch.randn(H, device="cuda", generator=g)
    args = (q, block, ring, slots, n_ring, sink, D ** -0.5)
    monkeypatch.setattr(backends, "_libraries", {"sparse_attn": "triton"})
    assert op.draft_kernel(q, block, ring) == "reference"
    ref = draft_attention(*args)
    monkeypatch.setattr(backends, "_libraries", {"sparse_attn": library})
    assert op.draft_kernel(q, block, ring) == ("flashmla" if library == "flashmla" else "flashmla-checked")
    out = torch.full_like(ref, float("nan"))
    out.copy_(draft_attention(*args))
    assert backends.sparse_attn() == "flashmla"  # auto: settled by the checked first call
    assert_close_per_token(out.flatten(0, 1), ref.flatten(0, 1))
    graph, held = torch.cuda.CUDAGraph(), torch.full_like(ref, float("nan"))
    with torch.cuda.graph(graph):
        held.copy_(draft_attention(*args))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(held, out)


@pytest.fixture(scope="module")
def tiny_dspark(tmp_path_factory):
    from mini.checkpoint.make import make_checkpoint
    from mini.model import load_model
    root = make_checkpoint("tiny-v4.1-dspark", tmp_path_factory.mktemp("tiny_dspark") / "ckpt")
    model, cfg, _ = load_model(root, dtype=torch.float32)
    return root, model, cfg


def test_make_checkpoint_writes_the_draft_and_the_forward_hands_over_its_features(tiny_dspark):
    from mini.model import Batch, KVCache, SeqChunk
    _, model, cfg = tiny_dspark
    assert model.dspark is not None and len(model.dspark.stages) == 3
    ids = list(range(3, 40))
    batch = Batch.build([SeqChunk(ids, 0, 0, [0])], cfg, "cpu", model.hasher)
    model.forward(batch, KVCache(cfg, 1, 1, 64, "cpu", torch.float32))
    assert model.target_features.shape == (len(ids), 3 * cfg.dim)


def test_rings_hold_the_last_window_of_target_positions(tiny_dspark):
    from mini.model.dspark import DSparkRings, main_x, write_rings
    _, model, cfg = tiny_dspark
    W, S = cfg.window_size, cfg.window_size + 9
    feats = torch.randn(S, 3 * cfg.dim)
    rings = DSparkRings(cfg, 2, "cpu", torch.float32)
    write_rings(model.dspark, cfg, feats, torch.arange(S), torch.ones(S, dtype=torch.long), rings)
    assert not rings.rings[0][0].any()  # the other slot is untouched
    # slot j holds the newest position p with p % W == j: here S-W..S-1
    one = DSparkRings(cfg, 1, "cpu", torch.float32)
    write_rings(model.dspark, cfg, feats[-W:], torch.arange(S - W, S), torch.zeros(W, dtype=torch.long), one)
    assert main_x(model.dspark, cfg, feats).shape == (S, cfg.dim)
    for a, b in zip(rings.rings, one.rings):
        assert torch.allclose(a[1], b[0], atol=1e-6)


def test_logits_dspark_writes_drafts_along_the_decode(tiny_dspark, tmp_path):
    from mini.cli import main
    root, _, cfg = tiny_dspark
    out = tmp_path / "d.npz"
    assert main(["logits", "--model", str(root), "--ids", "5,6,7,8", "--force-tokens", "9,10,11,12", "--dspark",
                 "--dtype", "float32", "--out", str(out)]) == 0
    z = np.load(out)
    k, V = cfg.dspark_block_size, cfg.vocab_size
    assert z["decode"].shape == (3, V) and z["tokens"].tolist() == [9, 10, 11]
    assert z["dspark_logits"].shape == (3, k, V) and z["dspark_confidence"].shape == (3, k)
    assert (z["dspark_draft_ids"] == z["dspark_logits"].argmax(-1)).all()  # greedy drafts
    # greedy decode: the anchors are the model's own argmax
    assert main(["logits", "--model", str(root), "--ids", "5,6,7,8", "--decode", "2", "--dspark",
                 "--dtype", "float32", "--out", str(out)]) == 0
    assert np.load(out)["dspark_logits"].shape == (2, k, V)
    # a wrong count of forced tokens, and a model without a draft module, are usage errors
    assert main(["logits", "--model", str(root), "--ids", "5,6", "--decode", "4", "--force-tokens", "9,10,11,12",
                 "--dspark", "--out", str(out)]) == 2


def test_logits_dspark_refuses_a_model_without_a_draft(tmp_path, capsys):
    from mini.cli import main
    assert main(["logits", "--model", "tiny-v4.1", "--ids", "5,6", "--dspark", "--out", str(tmp_path / "x.npz")]) == 2
    assert "no DSpark draft module" in capsys.readouterr().err


def test_a_batch_of_drafts_is_each_draft_alone(tiny_model, batch_invariant_gemms):
    """Sequences at different ring fills (one still filling, one wrapped) drafted together give each one's draft
    made alone: a draft reads only its own slot, positions and anchor. fp32 with the GEMMs made batch-invariant;
    the mHC sums (shared with the backbone) still move by an ulp with the row count, hence 1e-5, not equality."""
    from mini.model.dspark import DSparkRings, propose, write_rings
    model, _ = tiny_model("tiny-v4.1-dspark")
    cfg, w = model.config, model.dspark
    g = torch.Generator().manual_seed(3)
    lengths = (40, cfg.window_size + 22)
    rings = DSparkRings(cfg, 3, "cpu", torch.float32)
    for slot, n in zip((2, 0), lengths):
        feats = torch.randn(n, 3 * cfg.dim, generator=g)
        write_rings(w, cfg, feats, torch.arange(n), torch.full((n,), slot), rings)
    anchors, last, slots = torch.tensor([11, 200]), torch.tensor([n - 1 for n in lengths]), torch.tensor([2, 0])
    both = propose(w, cfg, model.embed, model.head, rings, anchors, last, slots)
    for b in range(2):
        alone = propose(w, cfg, model.embed, model.head, rings, anchors[b:b + 1], last[b:b + 1], slots[b:b + 1])
        assert torch.equal(alone.ids[0], both.ids[b])
        assert torch.allclose(alone.logits[0], both.logits[b], rtol=0, atol=1e-5)
        assert torch.allclose(alone.confidence[0], both.confidence[b], rtol=0, atol=1e-5)
