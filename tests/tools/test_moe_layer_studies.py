"""tools/moe_layer_studies.py: the moe-layer suite's study flags live in the tool, not in the suite (the layer itself
needs a GPU: phases gate, humming and moe_layer of scripts/gpu.sh run it)."""
import argparse

import moe_layer_studies

from mini.bench import moe_layer

STUDY_FLAGS = ["--sweep", "--humming-tiles", "128x4", "--old-gate-plan", "--gate-configs", "--only-gate-plan",
               "--gate-sweep-tokens", "1", "64", "--route-blocks", "256"]


def _parser(add_args) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_args(p)
    return p


def test_the_tool_takes_the_suites_options_and_its_studies():
    args = _parser(moe_layer_studies.add_args).parse_args(["--tokens", "64", "--moe-gemm", "triton", *STUDY_FLAGS])
    assert args.tokens == 64 and args.sweep and args.humming_tiles == ["128x4"] and args.route_blocks == [256]
    study = moe_layer_studies.Studies(args)
    assert study.only_gate_plan


def test_the_suite_has_no_study_flags():
    p = _parser(moe_layer.add_args)
    assert not any(f in p.format_help() for f in ("--sweep", "--humming-tiles", "--old-gate-plan", "--route-blocks"))
