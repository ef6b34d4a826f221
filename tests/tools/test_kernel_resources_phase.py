"""scripts/gpu/kernels.sh's phase kernel_resources on this machine: it lists every cubin in the Triton cache with its
registers and stack bytes and prints the builds that spill. Two decode GEMV builds compiled for sm_90a into a fresh
cache (no GPU needed; a subprocess, as tests/kernels/test_sm90_build.py, since this session may interpret Triton):
the 64 x 256 candidate spills, the default does not (tests/kernels/sm90_build.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = """
import triton
from sm90_build import build
from mini.kernels.gemv import CANDIDATES, _gemv_kernel
for cfg, spills in ((CANDIDATES["64x128 s4"], False), (CANDIDATES["64x256 s3"], True)):
    build(_gemv_kernel, {"part_ptr": "*fp32", "count_ptr": "*i32"},
          dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TP=16, SPLIT=True, ONE_LAUNCH=False, EVEN_K=True,
               ACT_BLOCK=32, DOT_DTYPE=triton.language.bfloat16),
          num_warps=cfg.num_warps, num_stages=cfg.num_stages, spills=spills)
"""


@pytest.mark.slow
def test_kernel_resources_lists_the_cached_builds_and_their_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path / "cache"), "PHASE_DIR": str(tmp_path),
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "kernels"), env.get("PYTHONPATH", "")])}
    built = subprocess.run([sys.executable, "-c", BUILD], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    run = subprocess.run(["bash", "-c", "source scripts/gpu/kernels.sh && phase_kernel_resources"], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    listed = (tmp_path / "resources.txt").read_text().splitlines()
    assert len(listed) == 2 and all("_gemv_kernel warps=4" in line and "REG:" in line for line in listed), listed
    spilling = [line for line in listed if not line.endswith("STACK:0")]
    assert len(spilling) == 1 and "stages=3" in spilling[0], listed  # the 64 x 256 candidate (3 stages)
    assert "2 builds; those that spill:" in run.stdout and spilling[0].strip() in run.stdout, run.stdout
