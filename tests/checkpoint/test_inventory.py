"""The inventory of the real configs against spec §4.2 (names, dtypes, shapes), §1.4 (expert bytes) and the
third-party shard-header counts of §4.1 (minus the DSpark/MTP and vision tensors mini skips)."""
from collections import Counter

import pytest
import torch

from mini.checkpoint import expected_tensors, expert_index, expert_range, skip_reason
from mini.config import preset

BF16, F32, F8, E8M0, I8, I64 = (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e8m0fnu,
                                torch.int8, torch.int64)


@pytest.fixture(scope="module")
def v41():
    # the released config has a vision tower, hence `bias_vl` in every gate
    cfg = preset("v4.1-flash").replace(vision=True)
    return cfg, expected_tensors(cfg)


def _spec(specs, name):
    s = specs[name]
    return s.dtype, list(s.shape)


# spec §4.2, per block (V4.1-Flash): name -> (dtype, shape), checked at a KV+index source of ratio 2 (layer 2)
V41_BLOCK_TABLE = {
    "attn_norm.weight": (BF16, [5120]), "ffn_norm.weight": (BF16, [5120]),
    "hc_attn_fn": (F32, [24, 20480]), "hc_ffn_fn": (F32, [24, 20480]),
    "hc_attn_base": (F32, [24]), "hc_ffn_base": (F32, [24]), "hc_attn_scale": (F32, [3]), "hc_ffn_scale": (F32, [3]),
    "attn.attn_sink": (F32, [64]),
    "attn.wq_a.weight": (F8, [1280, 5120]), "attn.wq_a.scale": (E8M0, [40, 160]),
    "attn.q_norm.weight": (BF16, [1280]),
    "attn.wq_b.weight": (F8, [32768, 1280]), "attn.wq_b.scale": (E8M0, [1024, 40]),
    "attn.wkv.weight": (F8, [512, 5120]), "attn.wkv.scale": (E8M0, [16, 160]),
    "attn.kv_norm.weight": (BF16, [512]),
    "attn.wo_a.weight": (F8, [8192, 4096]), "attn.wo_a.scale": (E8M0, [256, 128]),
    "attn.wo_b.weight": (F8, [5120, 8192]), "attn.wo_b.scale": (E8M0, [160, 256]),
    "attn.compressor.wkv.weight": (BF16, [512, 5120]), "attn.compressor.wgate.weight": (BF16, [512, 5120]),
    "attn.compressor.norm.weight": (BF16, [512]),
    "attn.indexer.wk.weight": (BF16, [128, 512]), "attn.indexer.k_norm.weight": (BF16, [128]),
    "attn.indexer.wq_b.weight": (F8, [4096, 1280]), "attn.indexer.wq_b.scale": (E8M0, [128, 40]),
    "attn.indexer.weights_proj.weight": (BF16, [32, 5120]),
    "ffn.gate.weight": (BF16, [384, 5120]), "ffn.gate.bias": (F32, [384]), "ffn.gate.bias_vl": (F32, [384]),
    "ffn.experts.0.w1.weight": (I8, [2304, 2560]), "ffn.experts.0.w1.scale": (E8M0, [2304, 160]),
    "ffn.experts.383.w3.weight": (I8, [2304, 2560]), "ffn.experts.383.w3.scale": (E8M0, [2304, 160]),
    "ffn.experts.7.w2.weight": (I8, [5120, 1152]), "ffn.experts.7.w2.scale": (E8M0, [5120, 72]),
    "ffn.shared_experts.w1.weight": (F8, [2304, 5120]), "ffn.shared_experts.w1.scale": (E8M0, [72, 160]),
    "ffn.shared_experts.w3.weight": (F8, [2304, 5120]), "ffn.shared_experts.w3.scale": (E8M0, [72, 160]),
    "ffn.shared_experts.w2.weight": (F8, [5120, 2304]), "ffn.shared_experts.w2.scale": (E8M0, [160, 72]),
    # Engram (layers 1 and 14; layer 14 has 384016682 rows)
    "engram.embed.weight": (F8, [384016682, 256]), "engram.embed.scale": (E8M0, [384016682, 8]),
    "engram.wkv.weight": (F8, [25600, 6144]), "engram.wkv.scale": (E8M0, [800, 192]),
    "engram.q_weight": (BF16, [4, 5120]), "engram.k_weight": (BF16, [4, 5120]),
}


def test_v41_block_names_dtypes_shapes_match_spec_table(v41):
    _, specs = v41
    for suffix, want in V41_BLOCK_TABLE.items():
        layer = 14 if suffix.startswith("engram.") else 2
        assert _spec(specs, f"layers.{layer}.{suffix}") == want, suffix
    assert _spec(specs, "layers.1.engram.embed.weight") == (F8, [384006168, 256])
    assert _spec(specs, "embed.weight") == (BF16, [129280, 5120])
    assert _spec(specs, "head.weight") == (BF16, [129280, 5120])
    assert _spec(specs, "norm.weight") == (BF16, [5120])
    assert not any(n.startswith(("hc_head", "mtp.")) or n.endswith((".ape", "tid2eid")) for n in specs)


def test_v41_layer_schedule_decides_compressor_indexer_engram(v41):
    _, specs = v41

    def layers_with(suffix):
        return sorted(i for i in range(40) if f"layers.{i}.{suffix}" in specs)

    assert layers_with("attn.compressor.wkv.weight") == [2, 8, 14, 20]  # KV sources
    assert layers_with("attn.compressor.wgate.weight") == [2, 8, 14]  # ratio 1 has no gate
    assert layers_with("attn.indexer.wk.weight") == [2, 8, 14, 20]  # index keys live with the KV
    assert layers_with("attn.indexer.wq_b.weight") == [2, 8, 14, 20, 24, 28, 32, 36]
    assert layers_with("attn.indexer.weights_proj.weight") == [2, 8, 14, 20, 24, 28, 32, 36]
    assert layers_with("engram.wkv.weight") == [1, 14]
    assert layers_with("ffn.gate.bias_vl") == list(range(40))
    assert layers_with("ffn.experts.383.w2.scale") == list(range(40))
    assert _spec(specs, "layers.20.attn.compressor.wkv.weight") == (BF16, [512, 5120])


def test_v41_routed_expert_bytes_match_spec_1_4(v41):
    _, specs = v41
    expert = sum(specs[f"layers.5.ffn.experts.17.{w}.{t}"].nbytes for w in ("w1", "w2", "w3")
                 for t in ("weight", "scale"))
    assert expert == 3 * (2304 * 2560 + 2304 * 160) == 18_800_640  # 18.80 MB
    per_layer = Counter()
    for name, s in specs.items():
        if expert_index(name) >= 0:
            per_layer[int(name.split(".")[1])] += s.nbytes
    assert set(per_layer) == set(range(40))
    assert all(b == 384 * 18_800_640 for b in per_layer.values())  # 7.219 GB per layer
    assert sum(per_layer.values()) == 40 * 7_219_445_760  # 288.8 GB of routed experts


def _counts(specs):
    return dict(Counter(s.dtype for s in specs.values()))


def test_v41_counts_match_shard_header_inventory(v41):
    # §4.1: 96,085 tensors = BF16 520, F32 387, F8_E4M3 357, F8_E8M0 47,589, I8 47,232. mini skips the three
    # DSpark stages (each a window-only block with a 128-expert MoE: 9 F32, 8 FP8 + scales, 384 FP4 + scales;
    # plus mtp.0.main_proj FP8 + scale) and their BF16 tensors; it loads the 266 BF16 vision tensors (32 ViT blocks
    # x 8, patch embedding 2, final norm, aligner 4, 3 span delimiters), so the rest must be:
    _, specs = v41
    dspark_f32, dspark_f8 = 3 * 9, 3 * 8 + 1
    dspark_i8 = 3 * 128 * 3
    assert _counts(specs) == {F32: 387 - dspark_f32, F8: 357 - dspark_f8, I8: 47_232 - dspark_i8,
                              E8M0: 47_589 - dspark_f8 - dspark_i8, BF16: 234 + 266}


def test_v41_vision_tensors(v41):
    """spec §2.8: ViT dim 1024, fused wqkv with bias, SwiGLU w1 [2 * 2816, 1024], a Linear over 3 * 14^2 = 588
    pixels; the aligner's 3x3 unshuffle into w1 [5120, 9216], w2 [5120, 5120] with biases; the span delimiters."""
    _, specs = v41
    assert _spec(specs, "vision.patch_embed.proj.weight") == (BF16, [1024, 588])
    assert _spec(specs, "vision.blocks.31.attn.wqkv.weight") == (BF16, [3072, 1024])
    assert _spec(specs, "vision.blocks.31.attn.wqkv.bias") == (BF16, [3072])
    assert _spec(specs, "vision.blocks.0.mlp.w1.weight") == (BF16, [5632, 1024])
    assert _spec(specs, "vision.blocks.0.mlp.w2.weight") == (BF16, [1024, 2816])
    assert "vision.blocks.32.norm1.weight" not in specs
    assert _spec(specs, "aligner.w1.weight") == (BF16, [5120, 9216])
    assert _spec(specs, "aligner.w2.bias") == (BF16, [5120])
    assert _spec(specs, "image_newline") == (BF16, [5120])
    assert not any(n.startswith(("vision.", "aligner.", "image_")) for n in expected_tensors(preset("v4.1-flash")))


def test_v4_flash_counts_and_v4_only_tensors():
    cfg = preset("v4-flash")
    specs = expected_tensors(cfg)
    # §4.1 V4-Flash: BF16 433, F32 417, F8_E4M3 375, F8_E8M0 34,167, I64 3, I8 33,792; its one MTP block holds
    # BF16 8 (4 block norms, gate, enorm, hnorm, norm), F32 11 (6 hc, sink, gate bias, 3 hc_head), FP8 10
    # (5 attention, 3 shared, e_proj, h_proj) and 256 experts.
    assert _counts(specs) == {BF16: 433 - 8, F32: 417 - 11, F8: 375 - 10, E8M0: 34_167 - 10 - 768, I64: 3,
                              I8: 33_792 - 768}
    assert _spec(specs, "layers.0.ffn.gate.tid2eid") == (I64, [129280, 6])
    assert "layers.0.ffn.gate.bias" not in specs and "layers.3.ffn.gate.bias" in specs
    assert "layers.3.ffn.gate.tid2eid" not in specs
    assert _spec(specs, "layers.2.attn.compressor.ape") == (F32, [4, 1024])  # ratio 4: overlapping, 2x wide
    assert _spec(specs, "layers.2.attn.compressor.wkv.weight") == (BF16, [1024, 4096])
    assert _spec(specs, "layers.3.attn.compressor.ape") == (F32, [128, 512])  # ratio 128
    assert _spec(specs, "layers.2.attn.indexer.compressor.ape") == (F32, [4, 256])
    assert _spec(specs, "layers.2.attn.indexer.compressor.norm.weight") == (BF16, [128])
    assert _spec(specs, "layers.2.attn.indexer.wq_b.weight") == (F8, [8192, 1024])
    assert _spec(specs, "layers.2.attn.indexer.wq_b.scale") == (E8M0, [64, 8])  # 128x128 blocks
    assert _spec(specs, "layers.2.attn.indexer.weights_proj.weight") == (BF16, [64, 4096])
    assert "layers.3.attn.indexer.wq_b.weight" not in specs and "layers.0.attn.compressor.wkv.weight" not in specs
    assert _spec(specs, "hc_head_fn") == (F32, [4, 16384])
    assert _spec(specs, "hc_head_scale") == (F32, [1])
    assert _spec(specs, "layers.9.ffn.experts.255.w2.scale") == (E8M0, [4096, 64])


def test_expert_subset_and_ranges():
    cfg = preset("tiny-v4.1")
    sub = expected_tensors(cfg, range(4, 8))
    full = expected_tensors(cfg)
    assert {expert_index(n) for n in sub} == {-1, 4, 5, 6, 7}
    assert {n for n in full if expert_index(n) in (-1, 4, 5, 6, 7)} == set(sub)
    v41 = preset("v4.1-flash")
    assert [expert_range(v41, r, 4) for r in range(4)] == [range(96 * r, 96 * (r + 1)) for r in range(4)]
    with pytest.raises(ValueError, match="cannot split"):
        expert_range(v41, 0, 5)
    with pytest.raises(ValueError, match="cannot split"):
        expert_range(v41, 4, 4)
    with pytest.raises(ValueError, match="out of range"):
        expected_tensors(cfg, range(14, 17))


def test_skip_reasons():
    text_only = preset("v4.1-flash")
    assert skip_reason("mtp.0.ffn.experts.3.w1.weight", text_only) == "mtp"
    assert skip_reason("vision.blocks.0.attn.wqkv.weight", text_only) == "vision"
    assert skip_reason("aligner.w1.weight", text_only) == "vision"
    assert skip_reason("image_newline", text_only) == "vision"
    assert skip_reason("layers.3.ffn.gate.bias_vl", text_only) == "vision"
    assert skip_reason("layers.3.ffn.gate.bias_vl", text_only.replace(vision=True)) is None  # then it is loaded
    assert skip_reason("vision.blocks.0.attn.wqkv.weight", text_only.replace(vision=True)) is None  # and these
    assert skip_reason("image_newline", text_only.replace(vision=True)) is None
    assert skip_reason("layers.3.ffn.gate.bias", text_only) is None
    assert skip_reason("layers.3.attn.visionary", text_only) is None
