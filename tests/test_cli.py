"""The CLI end to end on the tiny models: generate, logits (prefill/decode agree), make-checkpoint + load."""
import subprocess
import sys

import numpy as np
import pytest
import torch

from mini.cli import main


@pytest.mark.parametrize("model", ["tiny-v4.1", "tiny-v4"])
def test_generate_prints_text_and_speed(model, capsys):
    assert main(["generate", "--model", model, "--prompt", "Hello, mini", "--max-tokens", "4", "--ignore-eos",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr()
    assert "4 tokens in" in out.err and "tokens/s" in out.err


def test_generate_chat_format(capsys):
    assert main(["generate", "--prompt", "Hi", "--chat", "--max-tokens", "2", "--ignore-eos", "--device", "cpu"]) == 0
    assert "2 tokens in" in capsys.readouterr().err


def test_generate_with_images(tmp_path, capsys):
    """`mini generate --image` (twice): the prompt carries both spans (tiny-v4.1-vl: 10 tokens each for 60x50)."""
    import numpy as np
    from PIL import Image
    path = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 60, 3), dtype=np.uint8)).save(path)
    common = ["generate", "--model", "tiny-v4.1-vl", "--prompt", "Hi", "--max-tokens", "2", "--ignore-eos",
              "--device", "cpu"]
    assert main(common) == 0
    text_only = int(capsys.readouterr().err.split("prompt ")[1].split()[0])
    assert main([*common, "--image", str(path), "--image", str(path)]) == 0
    assert f"prompt {text_only + 20} tokens" in capsys.readouterr().err
    assert main(["generate", "--prompt", "Hi", "--image", str(path), "--device", "cpu"]) == 2
    assert "no vision tower" in capsys.readouterr().err


def test_logits_decode_matches_prefill_of_the_extended_prompt(tmp_path):
    """`mini logits` decode rows must equal the prefill logits of the prompt extended by the greedy tokens."""
    ids = [0, 17, 42, 300, 5, 99, 7]
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    common = ["--model", "tiny-v4.1", "--device", "cpu", "--dtype", "float32"]
    assert main(["logits", *common, "--ids", ",".join(map(str, ids)), "--decode", "3", "--out", str(a)]) == 0
    first = np.load(a)
    assert first["prefill"].shape == (len(ids), 512) and first["decode"].shape == (3, 512)
    tokens = first["tokens"].tolist()
    assert tokens[0] == int(first["prefill"][-1].argmax())
    extended = ids + tokens[:2]
    assert main(["logits", *common, "--ids", ",".join(map(str, extended)), "--out", str(b)]) == 0
    second = np.load(b)["prefill"]
    np.testing.assert_allclose(first["decode"][:2], second[len(ids):], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(first["prefill"], second[: len(ids)], rtol=1e-4, atol=1e-4)


def test_logits_rejects_bad_ids(tmp_path, capsys):
    assert main(["logits", "--model", "tiny-v4.1", "--device", "cpu", "--ids", "1,x", "--out",
                 str(tmp_path / "x.npz")]) == 2
    assert "--ids" in capsys.readouterr().err
    assert main(["logits", "--model", "tiny-v4.1", "--device", "cpu", "--ids", "1,99999", "--out",
                 str(tmp_path / "x.npz")]) == 2


def test_make_checkpoint_then_generate(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["make-checkpoint", "tiny-v4.1", str(out), "--seed", "3"]) == 0
    assert (out / "model.safetensors.index.json").exists() and (out / "config.json").exists()
    assert main(["generate", "--model", str(out), "--prompt", "Hi", "--max-tokens", "3", "--ignore-eos",
                 "--device", "cpu"]) == 0
    assert "3 tokens in" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- messages
def _fails_cleanly(argv, capsys) -> str:
    """`mini argv` ends with exit code 2 and one error line on stderr, no traceback; returns that line."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0] == err.splitlines()[-1], err
    assert not err.startswith("usage:"), err  # the error alone, not the usage block
    return lines[0]


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--model", "/no/such/dir", "--prompt", "x"], "no such directory"),
    (["generate", "--model", "tiny-v9", "--prompt", "x"], "not a preset"),
    (["generate", "--prompt", "x", "--max-tokens", "0"], "--max-tokens: must be >= 1, got 0"),
    (["generate", "--prompt", "x", "--max-tokens", "many"], "--max-tokens: must be an integer"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["generate", "--prompt", "x", "--device", "tpu"], "--device: must be cpu, cuda or cuda:N"),
    (["generate", "--prompt", "x", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["serve", "--model", "/no/such/dir"], "no such directory"),
    (["serve", "--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
    (["serve", "--max-body-mb", "0"], "--max-body-mb"),
    (["logits", "--ids", "1", "--out", "x.npz", "--decode", "-1"], "--decode"),
    (["make-checkpoint", "tiny-v9", "out"], "invalid choice: 'tiny-v9'"),
    (["generate", "--model", "v4-flash", "--prompt", "x"], "mini make-checkpoint v4-flash DIR --yes"),
])
def test_common_mistakes_end_with_one_line_and_exit_code_2(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MINI_CACHE", str(tmp_path))  # no real-size preset written there
    monkeypatch.chdir(tmp_path)
    assert needle in _fails_cleanly(argv, capsys)


def test_a_directory_without_config_is_not_a_checkpoint(tmp_path, capsys):
    assert "no config.json" in _fails_cleanly(["generate", "--model", str(tmp_path), "--prompt", "x"], capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
@pytest.mark.parametrize("cmd", [["generate", "--prompt", "x"], ["serve"]])
def test_device_cuda_without_a_gpu(cmd, capsys):
    assert "no CUDA GPU is visible" in _fails_cleanly([*cmd, "--device", "cuda"], capsys)


def test_real_size_presets_need_yes_and_the_space(tmp_path, capsys, monkeypatch):
    line = _fails_cleanly(["make-checkpoint", "v4-flash", str(tmp_path / "ckpt")], capsys)
    assert "real-size" in line and "--yes" in line and "156 GB" in line
    import shutil
    from collections import namedtuple
    monkeypatch.setattr(shutil, "disk_usage", lambda p: namedtuple("usage", "total used free")(10**12, 0, 10**9))
    line = _fails_cleanly(["make-checkpoint", "v4-flash", str(tmp_path / "ckpt"), "--yes"], capsys)
    assert "not enough free space" in line and "156.0 GB" in line
    assert not (tmp_path / "ckpt").exists()


def test_make_checkpoint_prints_the_size_and_draws_a_bar(tmp_path, capsys):
    assert main(["make-checkpoint", "tiny-v4.1", str(tmp_path / "c")]) == 0
    err = capsys.readouterr().err
    assert "tiny-v4.1: 0.002 GB of random weights" in err and "GB free there" in err
    assert "writing c" in err and "100%" in err  # tqdm's bar


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"]])
def test_help_imports_no_torch(argv):
    """`mini --help` stays fast (0.26 s measured; torch alone takes seconds to import): it must not import torch."""
    code = f"import sys; from mini.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n" \
           "assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "usage: mini" in r.stdout
