"""`mini bench ep-prefill` as an A/B of the exchange's micro-batch counts (MINI_EP_OVERLAP, mini/parallel/exchange.py:
1 = not overlapped) on one build (issue 18; phase ep2_overlap of scripts/gpu/parallel.sh). The suite's options, and
`--overlap 1,2,...`: the timed steps interleaved (setting by setting within each step round, so a drift of the
machine hits every setting alike), each setting profiled; the top-level metrics are the first setting's and
`overlap<N>.*` every setting's, with `overlap<N>.logits_identical` (1: every rank's logits with N equal the first
setting's bit for bit) and its control `logits_repeat_identical` (one setting run twice: 0 means the forward itself
is not reproducible here). Reported as the suite reports (suite `ep-prefill`).

    torchrun --nproc-per-node 2 tools/ep_prefill_overlap.py --layers 16 --overlap 1,2,4
    python3 tools/ep_prefill_overlap.py --nproc 2 --preset tiny-v4.1 --device cpu --dtype float32 --overlap 1,2
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mini.bench import ep_prefill  # noqa: E402
from mini.bench.ep_prefill import lockstep, slowest  # noqa: E402
from mini.parallel.groups import DistContext  # noqa: E402
from mini.testing.suites import run_as_script, run_on_ranks  # noqa: E402


def add_args(p) -> None:
    ep_prefill.add_args(p)
    p.add_argument("--overlap", type=_micro_batch_list, default=[1, 2],
                   help="micro-batches per MoE layer to compare on one build, e.g. 1,2 (A/B in one job: the timed "
                        "steps interleaved, each setting profiled, logits compared)")


def _micro_batch_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--overlap takes micro-batch counts >= 1 separated by commas, e.g. 1,2; "
                                         f"got {text!r}")
    return values


def _rank(ctx: DistContext, args) -> dict:
    r, cfg, setup_s = ep_prefill.setup(ctx, args)
    settings = args.overlap
    logits, steps, stages = {}, {s: [] for s in settings}, {}
    for s in settings:
        r.exchange.micro_batches = s
        lockstep(r, ctx.device, args.warmup)
        logits[s] = r.step()
    repeat_identical = torch.equal(r.step(), logits[settings[-1]])  # the control: one setting run twice
    for _ in range(args.steps):  # interleaved, so a drift of the machine hits every setting alike
        for s in settings:
            r.exchange.micro_batches = s
            steps[s] += lockstep(r, ctx.device, 1)
    for s in settings:
        r.exchange.micro_batches = s
        stages[s] = ep_prefill.profiled(r, ctx, args)
        steps[s] = slowest(ctx, steps[s])
    # 1 where every rank's logits with each setting equal the first setting's bit for bit
    same = [float(repeat_identical)] + [float(torch.equal(logits[s], logits[settings[0]])) for s in settings]
    same = torch.tensor(same, device=ctx.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    out = ep_prefill.result(ctx, args, cfg, r, setup_s, settings, steps[settings[0]], stages[settings[0]])
    metrics = out["metrics"]
    metrics["logits_repeat_identical"] = same[0].item()
    for i, s in enumerate(settings):
        metrics.update({f"overlap{s}.{k}": v for k, v in ep_prefill.setting_metrics(args, steps[s], stages[s]).items()})
        metrics[f"overlap{s}.logits_identical"] = same[1 + i].item()
    out["raw"]["step_ms_by_overlap"] = {str(s): steps[s] for s in settings}
    return out


def run(args) -> dict:
    return run_on_ranks("ep-prefill", _rank, args, min_ranks=2)


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__name__, "ep-prefill", "ep-prefill's micro-batch A/B of the exchange", argv,
                         "tools/ep_prefill_overlap.py")


if __name__ == "__main__":
    raise SystemExit(main())
