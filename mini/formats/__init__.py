"""Number formats of the DeepSeek-V4 checkpoints and the model's fake quantization (spec §4.3, §5).

e8m0.py   unsigned power-of-two scales (E8M0)
fp4.py    E2M1 codes, round-to-nearest-even, MXFP4 pack/unpack/dequant
fp8.py    FP8 e4m3 block-scaled weights: dequantize, quantize (for make-checkpoint)
quant.py  fake quantization that is part of the model: FP8 activations/window KV, FP4 compressed KV / index q,k
"""
from mini.formats.e8m0 import e8m0_to_float, float_to_e8m0, pow2_ceil_scale
from mini.formats.fp4 import (E2M1_VALUES, dequant_mxfp4, e2m1_codes, e2m1_round, pack_fp4, quantize_mxfp4,
                              unpack_fp4_codes)
from mini.formats.fp8 import dequant_fp8, quantize_fp8
from mini.formats.quant import fake_quant_fp4, fake_quant_fp8, no_fake_quant

__all__ = ["E2M1_VALUES", "dequant_fp8", "dequant_mxfp4", "e2m1_codes", "e2m1_round", "e8m0_to_float",
           "fake_quant_fp4", "fake_quant_fp8", "float_to_e8m0", "no_fake_quant", "pack_fp4", "pow2_ceil_scale", "quantize_fp8",
           "quantize_mxfp4", "unpack_fp4_codes"]
