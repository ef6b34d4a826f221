"""tools/vision_speed.py at a tiny size on the CPU: the encoder's timing and FLOP count, and the time to first token
through the engine's image path (build_batch with the span, SpanCache, forward) on one emulated rank."""
import json

import vision_speed

from mini.config import preset
from mini.model.image_input import plan_image


def test_small_run_writes_its_figures(tmp_path):
    out = tmp_path / "vs.json"
    assert vision_speed.main(["--small", "--warmup", "0", "--repeat", "1", "--text", "16",
                              "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["span_tokens"] == 58 and r["patches"] == 21 * 21  # the tiny plan's largest square: 7 x 7 tokens
    assert r["encoder_ms"] > 0 and r["tflops"] > 0 and r["ttft_ms"] > 0
    assert r["prompt_tokens"] == 16 + 58 and "EmulatedEP" in r["emulated"]


def test_flops_of_the_real_shape():
    """V4.1-Flash's largest image: 93 x 93 patches; the per-block GEMMs and attention add to ~17 TFLOP."""
    cfg = preset("v4.1-flash").replace(vision=True)
    plan = plan_image(8000, 8000, cfg)
    assert (plan.n_vit_h, plan.n_vit_w, plan.n_tokens) == (93, 93, 994)
    n, c, i = 93 * 93, 1024, 2816
    block = 2 * n * c * (3 * c + c + 2 * i + i) + 4 * n * n * c
    assert abs(vision_speed.encoder_flops(cfg, plan) - 32 * block) / (32 * block) < 0.01  # embedding + aligner: <1%


def test_kernel_kinds_of_the_profile():
    """The profile's split names the H200's kernels of each kind (names as the encoder's profile showed them)."""
    assert vision_speed.kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3") == "attention"
    assert vision_speed.kind_of("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert vision_speed.kind_of("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNT") == "gemm"
    assert vision_speed.kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert vision_speed.kind_of("_split_rope_kernel") == "vision_triton"
    assert vision_speed.kind_of("_add_rms_norm_kernel") == "vision_triton"
    assert vision_speed.kind_of("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>") == "other"
