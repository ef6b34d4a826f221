"""`--enforce-eager` reaches the engine options from `mini serve` and the started server of tiny-goodput."""
import argparse

from mini.bench import SUITES, _parser
from mini.bench.serve import _StartedServer
from mini.server.app import add_serve_args, engine_opts_from_args


def _serve_args(*argv):
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(["--device", "cpu", *argv])


def test_serve_flag_sets_the_engine_option():
    assert engine_opts_from_args(_serve_args())["enforce_eager"] is False
    assert engine_opts_from_args(_serve_args("--enforce-eager"))["enforce_eager"] is True


def test_goodput_passes_the_flag_to_the_started_server():
    def cmd(*argv):
        return _StartedServer(_parser(SUITES["tiny-goodput"]).parse_args(["tiny-goodput", "--device", "cpu", *argv])).cmd
    assert "--enforce-eager" not in cmd() and "--enforce-eager" in cmd("--enforce-eager")
