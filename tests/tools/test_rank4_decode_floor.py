"""tools/rank4_decode_floor.py: rank4-decode's memory floor checked by hand, the suite run with the floor on the tiny
model on the CPU, and the kernel split's parts."""
import argparse

import pytest
import rank4_decode_floor as fl
import torch

from mini.bench import rank4_decode as rd
from mini.config import preset
from mini.testing.suites import check_result

TINY = ["--preset", "tiny-v4.1", "--batch", "3", "--context", "20,70", "--steps", "2", "--warmup", "1",
        "--profile-steps", "0", "--device", "cpu", "--dtype", "float32", "--block-tokens", "16"]


def _args(extra=()):
    p = argparse.ArgumentParser()
    fl.add_args(p)
    return p.parse_args(TINY + list(extra))


def test_kv_read_per_seq_by_hand():
    """tiny-v4.1: 8 layers, W 128, head_dim 64, index_head_dim 32, top-k 24, ratios (0,0,2,2,1,1,1,1), indexers at
    2 (ratio 2), 4 (ratio 1, candidate source), 6 (ratio 1, uses 8 blocks x 4 = 32 candidate groups)."""
    cfg = preset("tiny-v4.1")
    assert (cfg.window_size, cfg.head_dim, cfg.index_head_dim, cfg.index_topk) == (128, 64, 32, 24)
    W = cfg.window_size
    # context 100: 101 positions seen; ratio 2 -> 50 groups, ratio 1 -> 101
    got = fl.kv_read_per_seq(cfg, 100)
    assert got["window"] == 8 * min(101, W) * 64
    assert got["compressed"] == (2 * 24 + 4 * 24) * 64  # every compressed layer reads its top 24
    assert got["index_keys"] == (50 + 101 + 32) * 32  # layer 6 scores only its 32 candidate groups
    # context 10: 11 seen; ratio 2 -> 5 groups (fewer than top-k), ratio 1 -> 11 (under the candidate cap)
    got = fl.kv_read_per_seq(cfg, 10)
    assert got == {"window": 8 * 11 * 64, "compressed": (2 * 5 + 4 * 11) * 64, "index_keys": (5 + 11 + 11) * 32}


def test_decode_floor_by_hand():
    """V4.1-Flash at B = 1, C = 4096 with one touched expert in one layer, every byte counted by hand."""
    cfg = preset("v4.1-flash")
    D, I, E, H, hd, qr, olr, og = 5120, 2304, 384, 64, 512, 1280, 1024, 8
    fp8 = lambda o, i: o * i + -(-o // 32) * -(-i // 32)  # noqa: E731 - data + E8M0 block scales
    mxfp4 = lambda o, i: o * i // 2 + o * i // 32  # noqa: E731
    assert fl.expert_bytes(cfg) == 2 * mxfp4(I, D) + mxfp4(D, I)
    f = fl.decode_floor(cfg, 1, 4096, [1] + [0] * 39, kv_elem_bytes=2, tbps=4.0)
    assert f["experts"] == 3 * (I * D // 2 + I * D // 32)
    assert f["embed_rows"] == D * 2
    assert f["engram_rows"] == 2 * 24 * (256 + 256 // 32)  # 2 layers x 24 hash columns x (fp8 row + scales)
    # per layer: wq_a, wq_b, wkv, wo_a, wo_b, the shared expert (FP8); the gate (bf16) and its bias (fp32); the two
    # mHC sites (fp32 fn, base, scale); attn / ffn / q / kv norms (bf16), the attention sink (fp32)
    per_layer = (fp8(qr, D) + fp8(H * hd, qr) + fp8(hd, D) + fp8(og * olr, H * hd // og) + fp8(D, og * olr)
                 + 2 * fp8(I, D) + fp8(D, I) + E * D * 2 + E * 4 + 2 * (24 * 4 * D + 24 + 3) * 4
                 + (2 * D + qr + hd) * 2 + H * 4)
    # compressors (bf16 wkv, + wgate at ratio 2, norm) of the KV sources 2, 8, 14 (ratio 2) and 20 (ratio 1)
    compressors = 3 * (2 * hd * D + hd) * 2 + (hd * D + hd) * 2
    # 8 indexers (FP8 wq_b, bf16 weights_proj); the 4 key owners' wk and k_norm (bf16)
    indexers = 8 * (fp8(32 * 128, qr) + 32 * D * 2) + 4 * (128 * hd + 128) * 2
    engram = 2 * (fp8(5 * D, 24 * 256) + 2 * 4 * D * 2)  # wkv (FP8), q_weight and k_weight (bf16)
    head_and_norm = 129280 * D * 2 + D * 2
    assert f["dense_weights"] == 40 * per_layer + compressors + indexers + engram + head_and_norm
    seen = 4097
    window = 40 * 128 * hd
    compressed = 38 * 512 * hd  # layers 2..39 all see >= 512 groups
    index = (3 * (seen // 2) + seen + 4 * seen) * 128  # 2, 8, 14 at ratio 2; 20; 24..36 under the 16,384 cap
    assert (f["kv_window"], f["kv_compressed"], f["kv_index_keys"]) == (2 * window, 2 * compressed, 2 * index)
    parts = [f[k] for k in ("dense_weights", "embed_rows", "engram_rows", "experts", "kv_window", "kv_compressed",
                            "kv_index_keys")]
    assert f["total"] == sum(parts) and f["ms"] == pytest.approx(f["total"] / 4e12 * 1e3)
    # B = 256 at 32K: the KV term scales with B, the candidate cap bites at 32,769 positions
    g = fl.decode_floor(cfg, 256, 32768, [96] * 40)
    assert g["kv_index_keys"] == 256 * 2 * (3 * (32769 // 2) + 32769 + 4 * 16384) * 128
    assert g["experts"] == 96 * 40 * fl.expert_bytes(cfg)
    assert 20 < g["ms"] < 30  # ~72 GB of experts + ~7 GB dense + ~17 GB KV at 4.26 TB/s


def test_the_suite_runs_with_the_floor():
    result = check_result("rank4-decode", fl.run(_args(["--tbps", "4.0"])))
    m = result["metrics"]
    assert result["definition"]["tbps"] == 4.0
    for C in (20, 70):
        p = f"b3_c{C}."
        for k in ("floor_ms", "vs_floor", "floor_gb_experts", "floor_gb_kv_index_keys", "floor_tok_per_s_per_gpu"):
            assert p + k in m, p + k
        assert m[p + "vs_floor"] == pytest.approx(m[p + "ms_per_step"] / m[p + "floor_ms"])
        assert not any(k.startswith(p + "kernel_ms.") for k in m)  # the split needs CUDA
    # the floor's KV grows with the context at a fixed batch
    assert m["b3_c70.floor_gb_kv_index_keys"] > m["b3_c20.floor_gb_kv_index_keys"]


def test_kernel_names_fall_into_their_parts():
    c = fl.kernel_class
    assert c("Memcpy HtoD (Pinned -> Device)") == "copies"
    assert c("void humming::moe_w4a16_kernel<...>") == "moe_experts" and c("_grouped_mxfp4_kernel") == "moe_experts"
    assert c("_swiglu_rows_kernel") == "moe_experts" and c("process_input_kernel") == "moe_experts"
    assert c("void flash::flash_fwd_splitkv_mla_kernel<...>") == "sparse_attention"
    assert c("_sparse_mla_kernel") == "sparse_attention" and c("flash_fwd_mla_combine_kernel") == "sparse_attention"
    assert c("_index_scores_kernel") == "indexer" and c("void at::native::sbtopk::gatherTopK<...>") == "indexer"
    assert c("_gate_kernel") == "gate_route" and c("_combine_kernel") == "gate_route" and c("_scan_kernel") == \
        "gate_route"
    assert c("_plan_one_kernel") == "gate_route"  # the routing plan of a decode step
    assert c("nvjet_tst_128x64_64x8_2x1_v_bz_TNT") == "gemm" and c("_mm_kernel") == "gemm"
    # the decode GEMV (mini/kernels/gemv.py) and its split-K pieces' sum (report 037 had them under "other")
    assert c("_gemv_fp8_row_kernel") == "gemm" and c("_gemv_kernel") == "gemm" and c("_sum_pieces_kernel") == "gemm"
    assert c("_mhc_partial_kernel") == "mhc_norm" and c("_rms_norm_kernel") == "mhc_norm"
    assert c("_act_quant_kernel") == "quant_rope" and c("_rope_quant_kernel") == "quant_rope"
    assert c("void at::native::vectorized_elementwise_kernel<4, ...>") == "other"


@pytest.mark.gpu
def test_graph_replay_equals_the_eager_step_gpu():
    """The captured step (EmulatedEP inside a CUDA graph, fast backend, bf16) gives the eager step's logits for the
    same inputs, and the touched experts come from the emulation (tiny-v4.1, 4 local experts x 8 layers)."""
    import mini.ops
    from mini.testing.emulated_ep import EmulatedEP
    from mini.testing.rank_model import rank_model
    from mini.checkpoint import expert_range
    cfg, dev = preset("tiny-v4.1"), torch.device("cuda")
    experts = expert_range(cfg, 0, 4)
    with mini.ops.using_backend("fast"):
        for routing in ("uniform", "skewed"):
            ex = EmulatedEP(4, 0, routing, experts)
            model = rank_model(cfg, dev, torch.bfloat16, 0, experts, None, ex)
            r = rd.DecodeRun(model, cfg, ex, 5, 300, 6, 16, dev, torch.bfloat16, 0)
            touched, _ = r.touched_experts()
            assert len(touched) == 8 and all(1 <= t <= 4 for t in touched)
            eager = r.eager().float().clone()
            r.capture()  # its warm-up writes padding rows into the buffers: fill step 0 again
            assert [n for n, _ in r.graphs.graphs] == [5]  # one graph: 5 sequences (keyed by (n, span))
            r.step_no = 0
            r.fill()
            # the same kernels on the same inputs; a stale buffer or a step outside the graph would differ by O(1)
            torch.testing.assert_close(r.replay().float(), eager, rtol=2e-2, atol=2e-2)
            parts, top = fl.kernel_split(r.replay, 1)  # the profiler sees the replay's kernels
            assert parts["total"] > 0 and top and parts.get("sparse_attention", 0) + parts.get("moe_experts", 0) > 0
            # every kernel with its launches: they add up to the parts' count
            assert sum(n for _, _, n in top) == pytest.approx(parts["launches.total"])


def test_graph_capture_time_refuses_the_cpu():
    """tools/graph_capture_time.py times CUDA graph capture: on the CPU it says so instead of timing nothing."""
    import graph_capture_time as gct

    from mini.testing.suites import SuiteError
    p = argparse.ArgumentParser()
    gct.add_args(p)
    args = p.parse_args(["--preset", "tiny-v4.1", "--device", "cpu", "--dtype", "float32", "--max-seqs", "3"])
    with pytest.raises(SuiteError, match="--device cuda"):
        gct.run(args)
