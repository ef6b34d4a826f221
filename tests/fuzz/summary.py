"""Summary of a GPU fuzzer run: `python3 tests/fuzz/summary.py fuzz.jsonl` (the MINI_FUZZ_LOG lines of
test_fuzz_gpu.py): configs passed, each failure with its seed and config, and on how many configs each kernel ran
(a kernel that never ran was not tested by the run)."""
import collections
import json
import sys
from pathlib import Path

from harness import KERNELS


def main(path: str) -> int:
    p = Path(path)
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []
    ran = collections.Counter(k for r in rows for k in r["kernels"])
    print(f"{sum(r['ok'] for r in rows)} of {len(rows)} configs passed")
    for r in rows:
        if not r["ok"]:
            print(f"FAILED seed {r['seed']}: {r['config']}\n    " + "\n    ".join(r["failures"]))
    every = [f"{m.split('.')[-1]}.{n}" for m, names in KERNELS.items() for n in names]
    print("configs on which each kernel ran:", {k: ran.get(k, 0) for k in every})
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
