"""The launch entry: local ranks (spawned, gloo) print what one process prints; torchrun and --nproc conflict."""
import pytest

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
