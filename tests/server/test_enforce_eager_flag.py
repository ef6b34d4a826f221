"""The shared engine flags (mini.args) reach the engine options from `mini serve` and the started server of
tiny-goodput; their defaults are EngineOptions' own."""
import argparse

from mini.bench import SUITES
from mini.testing.serving_load import StartedServer
from mini.testing.suites import parser
from mini.args import ENGINE_FLAGS, add_serve_args, engine_opts
from mini.engine import EngineOptions


def _serve_args(*argv):
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(["--device", "cpu", *argv])


def test_serve_flag_sets_the_engine_option():
    assert engine_opts(_serve_args())["enforce_eager"] is False
    assert engine_opts(_serve_args("--enforce-eager"))["enforce_eager"] is True


def test_goodput_passes_the_flag_to_the_started_server():
    def cmd(*argv):
        return StartedServer(parser(SUITES["tiny-goodput"], SUITES, "mini bench").parse_args(["tiny-goodput", "--device", "cpu", *argv])).cmd
    assert "--enforce-eager" not in cmd() and "--enforce-eager" in cmd("--enforce-eager")


def test_engine_flag_defaults_are_the_engine_options_defaults():
    defaults = EngineOptions()
    for f in ENGINE_FLAGS:
        assert getattr(defaults, f.dest) == f.default, f.name
    opts = engine_opts(_serve_args("--max-num-seqs", "3", "--no-enable-prefix-caching", "--max-model-len", "99"))
    assert EngineOptions(**opts) == EngineOptions(device="cpu", max_num_seqs=3, enable_prefix_caching=False,
                                                  max_model_len=99)


def test_goodput_forwards_only_the_engine_flags_given():
    def cmd(*argv):
        return StartedServer(parser(SUITES["tiny-goodput"], SUITES, "mini bench").parse_args(["tiny-goodput", "--device", "cpu", *argv])).cmd
    base = cmd()
    assert base[base.index("--num-blocks") + 1] == "512"  # the CPU default of the started server
    assert not {"--max-num-seqs", "--block-tokens", "--no-enable-prefix-caching"} & set(base)
    given = cmd("--max-num-seqs", "5", "--no-enable-prefix-caching", "--num-blocks", "7")
    assert given[given.index("--max-num-seqs") + 1] == "5" and "--no-enable-prefix-caching" in given
    assert given[given.index("--num-blocks") + 1] == "7"
