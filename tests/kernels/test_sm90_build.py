"""The dispatched kernels compile for Hopper (sm_90a) at the models' shapes, checked on any machine: see
sm90_build.py, run in a subprocess because this test session may have switched Triton to its interpreter."""
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_kernels_build_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90_build.py"))], env=env, cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count(" ok") == 131, run.stdout  # every build ran
