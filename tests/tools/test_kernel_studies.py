"""tools/attention_before_after.py and tools/flashmla_core.py: the finished attention-side studies run through the
kernels suite's machinery under their own names (they need a GPU: phases `kernels` and `flashmla` of
scripts/gpu.sh)."""
import argparse

import attention_before_after
import flashmla_core
import pytest

from mini.bench import kernels


@pytest.mark.parametrize("tool, names", [
    (attention_before_after, ["attention_rope", "indexer_topk", "rope_chains", "attn_glue"]),
    (flashmla_core, ["flashmla"])])
def test_the_studies_are_the_tools_and_not_the_suites(tool, names):
    p = argparse.ArgumentParser()
    kernels.add_args(p, tool.BENCHES)
    assert p.parse_args([]).only == names
    assert not set(names) & set(kernels.BENCHES)
    assert list(kernels.BENCHES) == ["attention", "attention_decode", "indexer", "indexer_decode", "mhc", "rope", "norm",
                                    "decode_small",
                                    "decode_gate", "decode_gemv", "decode_gemv_fp8", "order_keys", "top_ids",
                                    "dspark_markov"]


def test_the_tile_sweeps_are_a_tool_over_the_suites_benches():
    """tools/kernel_tile_sweep.py times the suite's own benches with its config lists; the suite has no --sweep."""
    import kernel_tile_sweep
    p = argparse.ArgumentParser()
    kernels.add_args(p, kernel_tile_sweep.BENCHES)
    assert p.parse_args([]).only == ["attention", "indexer", "mhc"]
    assert set(kernel_tile_sweep.SWEEPS) <= set(kernels.BENCHES)
    with pytest.raises(SystemExit):
        kernels.add_args(p := argparse.ArgumentParser())
        p.parse_args(["--sweep"])
