"""tools/pdl_study.py: its read split on CPU; on the GPU the three launch modes of a small chain give the same bits
(PDL changes when a kernel starts, never what it computes)."""
import pdl_study
import pytest


@pytest.mark.parametrize("N,K", pdl_study.SHAPES + [(100, 384), (64, 128)])
def test_pieces_are_whole_tiles_and_fill_the_gpu(N, K):
    for sms in (1, 132):
        p = pdl_study.pieces_for(N, K, sms)
        assert 1 <= p <= K // pdl_study.BLOCK_K and K % (p * pdl_study.BLOCK_K) == 0
        programs = -(-N // pdl_study.BLOCK_N) * p
        assert programs >= min(4 * sms, -(-N // pdl_study.BLOCK_N) * (K // pdl_study.BLOCK_K))


@pytest.mark.gpu
def test_launch_modes_give_the_same_bits_gpu(tmp_path):
    import json
    out = tmp_path / "pdl.json"
    assert pdl_study.main(["--layers", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["reads"] == 2 * len(pdl_study.SHAPES)
    for name in ("pdl", "pdl_prefetch"):
        assert result[name]["same_bits_as_base"] is True and result[name]["step_us"] > 0
