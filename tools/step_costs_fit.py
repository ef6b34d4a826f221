"""The engine's speculation cost model (`mini.engine.speculative.STEP_COSTS`: per batch size B, the draft step's
cost and one verify row's, in plain decode steps) from `mini bench spec-decode`'s JSON, measured at real width:

    draft = draft_ms / decode_ms        row = (verify_ms / decode_ms - 1) / k

(a verify step of B sequences x (1 + k) rows costs one decode step plus k rows). Prints the tuple to paste into
`STEP_COSTS` beside the current one and, for both, the least acceptance at which each draft length pays
(`paying_draft`), so a refit shows what it changes. Several JSON files may be given (e.g. B = 1, 64 and 16, 256 run
apart); a B found in none keeps nothing (the model interpolates between the B it has).

    python3 tools/step_costs_fit.py out/spec_decode/spec_decode.json
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def fit(results: list[dict]) -> tuple[tuple[int, float, float], ...]:
    """((B, draft, row), ...) by B from spec-decode results (their `definition.spec_tokens` and metrics)."""
    costs = {}
    for r in results:
        k, m = r["definition"]["spec_tokens"], r["metrics"]
        for key in m:
            hit = re.fullmatch(r"b(\d+)_c\d+\.decode_ms", key)
            if not hit:
                continue
            at = key[:-len("decode_ms")]
            if at + "verify_ms" not in m or at + "draft_ms" not in m:
                continue
            decode = m[key]
            costs[int(hit.group(1))] = (round(m[at + "draft_ms"] / decode, 3),
                                        round((m[at + "verify_ms"] / decode - 1) / k, 3))
    return tuple((b, *costs[b]) for b in sorted(costs))


def thresholds(costs, decoding: int, longest: int = 5) -> list[float]:
    """The least acceptance (0.01 steps) at which `paying_draft` drafts 1..longest tokens among `decoding`."""
    from unittest import mock

    from mini.engine import speculative
    out = []
    with mock.patch.object(speculative, "STEP_COSTS", costs):
        for n in range(1, longest + 1):
            out.append(next((a / 100 for a in range(101) if speculative.paying_draft(a / 100, longest, decoding) >= n),
                            float("inf")))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="spec-decode JSON files (mini bench spec-decode --json)")
    args = p.parse_args(argv)
    from mini.engine.speculative import STEP_COSTS
    new = fit([json.loads(Path(f).read_text()) for f in args.json])
    if not new:
        raise SystemExit("step_costs_fit: no B with decode_ms, draft_ms and verify_ms in the files given")
    print(f"STEP_COSTS = {new}  # (B, draft step, verify row)")
    print(f"current:     {STEP_COSTS}")
    for b, *_ in new:
        print(f"B = {b}: least acceptance for 1..5 drafts, fitted {thresholds(new, b)}, current "
              f"{thresholds(STEP_COSTS, b)}")


if __name__ == "__main__":
    main()
