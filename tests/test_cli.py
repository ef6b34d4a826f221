"""The CLI end to end on the tiny models: generate, logits (prefill/decode agree), make-checkpoint + load."""
import numpy as np
import pytest

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
