"""The launch entry: local ranks (spawned, gloo) print what one process prints; torchrun and --nproc conflict."""
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from mini.parallel import launch

ARGS = ["--device", "cpu", "generate", "--model", "tiny-v4.1", "--prompt", "hello", "--prompt", "the world",
        "--prompt", "abc", "--max-tokens", "3", "--num-blocks", "16", "--dtype", "float32"]


@pytest.mark.slow
def test_two_local_ranks_print_what_one_prints(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launch.main(ARGS) == 0
    one = capsys.readouterr().out
    assert one.count(" -> ") == 3 and one.startswith("'hello' -> ")
    assert launch.main(["--nproc", "2", *ARGS]) == 0
    assert capsys.readouterr().out == one


def test_nproc_under_torchrun_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="nproc-per-node"):
        launch.main(["--nproc", "2", *ARGS])


@pytest.mark.slow
def test_generate_with_an_image_under_torchrun_prints_what_one_process_prints(tmp_path):
    """`torchrun --nproc-per-node 2 -m mini generate --image ...` (gloo on the CPU): rank 0 runs the prompt with its
    image, rank 1 serves its MoE layers, and the text is one process's."""
    png = tmp_path / "noise.png"
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (90, 140, 3), dtype=np.uint8)).save(png)
    cmd = ["generate", "--model", "tiny-v4.1-vl", "--device", "cpu", "--dtype", "float32", "--prompt", "and this?",
           "--max-tokens", "4", "--num-blocks", "16", "--ignore-eos"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]

    def run(*prefix, image=png):
        return subprocess.run([sys.executable, *prefix, "-m", "mini", *cmd, "--image", str(image)], env=env,
                              capture_output=True, text=True, timeout=300)
    one, two = run(), run(*torchrun)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-3000:], two.stderr[-3000:])
    assert one.stdout.strip() and two.stdout == one.stdout
    bad = run(*torchrun, image=tmp_path / "missing.png")  # every rank fails alike; rank 0 says why
    assert bad.returncode != 0 and "error: [Errno 2]" in bad.stderr and "missing.png" in bad.stderr, bad.stderr
