"""A probe of MXFP4 decoding through a GEMM: every E2M1 code under every E8M0 scale byte, read back one weight at a
time with one-hot activations. Shared by the GPU kernels' tests (Triton grouped GEMM, Humming adapter).

Row n = 16·s + c of the [4096, K] weight holds, in each 32-wide scale block b, the single code (c + 5b) % 16 at
position (c + s + 7b) % 32 and code 0 elsewhere, under scale byte (s + 64b) % 256: every (code, scale byte) pair
appears in every block, at positions that move through both nibbles of a byte. Activation row k is the one-hot
e_k, so output [k, n] = W[n, k] exactly (one product; the zeros add +0). The expected output is that product in
float64 from the CPU decoder (mini.formats.dequant_mxfp4). Columns with a weight that is not finite (it
overflows the output dtype, or scale byte 255: NaN in E8M0) are not compared (`mismatches`): there the zero
activations of the other rows times inf are NaN in IEEE arithmetic, 0 in the compiled kernels' tensor cores, and
neither is a decoding question.
"""
import torch

from mini.formats import dequant_mxfp4

N_ROWS = 16 * 256


def probe_weights(K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [4096, K/2] low nibble first, scale bytes uint8 [4096, K/32])."""
    assert K % 32 == 0
    n = torch.arange(N_ROWS)
    s, c = n // 16, n % 16
    codes = torch.zeros(N_ROWS, K, dtype=torch.uint8)
    scales = torch.empty(N_ROWS, K // 32, dtype=torch.uint8)
    for b in range(K // 32):
        codes[n, 32 * b + (c + s + 7 * b) % 32] = ((c + 5 * b) % 16).to(torch.uint8)
        scales[:, b] = ((s + 64 * b) % 256).to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scales


def expected(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [K, 4096]: e_k @ W^T for every k (W from the CPU decoder, fp32: overflow is inf there already)."""
    w = dequant_mxfp4(codes.cpu(), scales.cpu()).double()  # [4096, K]
    with torch.no_grad():
        return torch.eye(w.shape[1], dtype=torch.float64) @ w.t()


def mismatches(got: torch.Tensor, want: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
               show: int = 8) -> tuple[int, str]:
    """(number of differing outputs, a description of the first `show`): NaN equals NaN, inf must be inf of the
    same sign, finite values equal after `want` is rounded to the output's dtype. Output [k, n] is the decode of
    the code at W[n, k] under its block's scale byte (when the column's other weights are finite)."""
    g, w = got.double().cpu(), want.to(got.dtype).double()
    # Columns holding a weight that is not finite (scale byte 255, or a product past the output dtype's range) are
    # left out: what 0 x inf gives inside a tensor-core GEMM is not decoding (the compiled kernels give 0 there,
    # IEEE says NaN), and no valid checkpoint holds such a weight (byte 255 is refused at load).
    bad = ~((g == w) | (g.isnan() & w.isnan())) & w.isfinite().all(0, keepdim=True)
    where = bad.nonzero().tolist()
    lines = []
    for k, n in where[:show]:
        byte = int(codes[n, k // 2])
        code = byte & 15 if k % 2 == 0 else byte >> 4
        lines.append(f"out[{k}, {n}] (code {code}, scale byte {int(scales[n, k // 32])}): got {g[k, n].item()!r}, "
                     f"want {w[k, n].item()!r}")
    return len(where), "; ".join(lines)
