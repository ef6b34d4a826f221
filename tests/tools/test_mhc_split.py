"""tools/mhc_split.py: the mHC split-K study runs through the kernels suite's machinery under its own name (the
study itself needs a GPU: phase mhc_ab of scripts/gpu.sh)."""
import argparse

import mhc_split

from mini.bench import kernels


def test_the_study_is_the_tools_and_not_the_suites():
    p = argparse.ArgumentParser()
    kernels.add_args(p, mhc_split.BENCHES)
    assert p.parse_args([]).only == ["mhc_split", "mhc_rows"]
    assert not {"mhc_split", "mhc_rows"} & set(kernels.BENCHES)
