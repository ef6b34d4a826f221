"""tools/wo_a_study.py: its bound check on CPU (small groups), the study itself on the GPU."""
import pytest
import torch
import wo_a_study as study


def test_bound_passes_the_exact_sums_and_fails_a_planted_error(monkeypatch):
    monkeypatch.setattr(study, "G", 2)
    monkeypatch.setattr(study, "R", 8)
    monkeypatch.setattr(study, "K", 64)
    monkeypatch.setattr(study, "ROTATE", 1)
    (q, s, copy), = study.weights("cpu")
    assert copy.shape == (2, 8, 64) and q.shape == (16, 64) and s.shape == (1, 2)
    x = (torch.randn(3, 2 * 64) * 2).bfloat16()
    y = torch.einsum("tgd,grd->tgr", x.view(3, 2, 64).float(), copy.float()).flatten(1).bfloat16()
    assert study.within_bound(y, x, copy)
    y[1, 9] += y[1, 9].abs() * 0.1 + 1e-3
    assert not study.within_bound(y, x, copy)


@pytest.mark.gpu
def test_study_runs_and_every_path_is_within_bound_gpu():
    result = study.run([1, 6])
    assert {"cublas_bmm", "gemv_fp8"} < set(result["cases"]["T1"])  # and the Gluon build's candidates
    assert "gemv_fp8" not in result["cases"]["T6"] and any(k.startswith("gluon") for k in result["cases"]["T6"])
    assert all(c["within_bound"] and c["us"] > 0 for case in result["cases"].values() for c in case.values())
