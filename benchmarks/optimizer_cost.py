"""What each ZO optimizer costs a step, and its peak memory, beside sgd's (BENCHMARKS.md, "Optimizers:
what each costs a step", which has this measurement on a GPU by `bench` directly).

Runs `python -m distzo bench` once per optimizer, each in a fresh process (a process's peak memory
cannot be split between two models), on the embedded default: SmolLM2-135M, mr-polarity, batch
16, fp32, MeZO q=1, 1x1. Each non-sgd run also times sgd's step on the same batches in the same
rounds (bench's optimizer section), so its step / sgd ratio is taken within one run; the peak
memory of each run is its own. Extra arguments after `--` go to every bench run.

    python benchmarks/optimizer_cost.py --out optimizer-cost.json
    python benchmarks/optimizer_cost.py --optimizers sgd adam -- model=tiny task=synthetic-cue   # a quick check
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench_runs import run_bench

ARGS = {"fzoo": ["estimator.difference=forward", "estimator.distribution=rademacher", "estimator.q=8"]}


def bench(optimizer: str, extra: list[str], run_dir: Path) -> dict:
    return run_bench([f"optim.name={optimizer}", *ARGS.get(optimizer, []), "bench.reference=false", *extra], run_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizers", nargs="+", default=["sgd", "momentum", "adam", "sign", "fzoo"])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("extra", nargs="*")
    ns = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ns.optimizers:
            rows[name] = bench(name, ns.extra, Path(tmp) / name)
            print(f"{name}: done", file=sys.stderr, flush=True)
    gib = 2**30
    print("| optimizer | state (GiB) | step | forward passes alone | step / forward | step / sgd's step (same rounds) "
          "| peak memory, inference / training (GiB) | training / inference |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        o = r.get("optimizer", {})
        print(f"| {name} | {o.get('state_bytes', 0) / gib:.3f} | {r['step_time_s']:.3f} s | "
              f"{r['forward_time_s']:.3f} s "
              f"| {r['overhead_ratio']} | {o.get('step_over_sgd', 1.0 if name == 'sgd' else '-')} | "
              f"{r['peak_memory_bytes']['inference'] / gib:.3f} / {r['peak_memory_bytes']['training'] / gib:.3f} | "
              f"{r['memory_ratio']} |")
    if ns.out:
        ns.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
