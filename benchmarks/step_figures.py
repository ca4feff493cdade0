"""The step-cost figures of BENCHMARKS.md, measured side by side in one invocation.

Runs `python -m distzo bench` (under torchrun for meshes) on the embedded default, global batch 16,
fp32, for:

  1x1, Gaussian, the machine's threads   step time vs the MeZO reference (same run), overhead ratio,
                                         peak memory of training vs inference alone
  1x1, Rademacher, the machine's threads overhead ratio
  2x1 / 1x2, one thread per rank         throughput of two ranks against one rank alone, timed in the
                                         same job (bench.single_rank: rank 0 runs a 1x1 copy of the
                                         training in rounds interleaved with the mesh's)

and prints a table of medians over --repeats invocations (each invocation's figures are themselves
medians over its timed steps or rounds, so every ratio is taken within one run). Extra arguments
after `--` go to every bench run (for example `-- model=tiny task=synthetic-cue` for a quick check
of the script).

    python benchmarks/step_figures.py --repeats 2 --out bench-figures.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench_runs import run_bench

CASES = [  # name, processes, overrides
    ("gaussian-1x1", 1, ["estimator.distribution=gaussian"]),
    ("rademacher-1x1", 1, ["estimator.distribution=rademacher", "bench.reference=false"]),
    # ten rounds: each round's two-rank step is paired with a one-rank step on the same batch
    ("1thread-2x1", 2, ["threads=1", "mesh=2x1", "bench.single_rank=true", "bench.steps=10"]),
    ("1thread-1x2", 2, ["threads=1", "mesh=1x2", "bench.single_rank=true", "bench.steps=10"]),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1, help="invocations of every case (figures are medians)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    ap.add_argument("extra", nargs="*", help="overrides for every bench run (after --)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="distzo-step-figures-"))
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in CASES}
    started = time.time()
    for rep in range(args.repeats):
        for name, nproc, overrides in CASES:
            print(f"[{time.time() - started:6.0f}s] repeat {rep + 1}/{args.repeats}: {name}", flush=True)
            runs[name].append(run_bench(["batch_size=16", *overrides, *args.extra], work / f"{name}-{rep}", nproc))

    def med(name: str, *path: str) -> float:
        values = []
        for r in runs[name]:
            v = r
            for key in path:
                v = v[key]
            values.append(v)
        return statistics.median(values)

    figures = {
        "gaussian_step_s": med("gaussian-1x1", "step_time_s"),
        "mezo_reference_step_s": med("gaussian-1x1", "mezo_reference", "step_time_s"),
        "gaussian_over_reference": med("gaussian-1x1", "mezo_reference", "distzo_over_reference"),
        "gaussian_overhead_ratio": med("gaussian-1x1", "overhead_ratio"),
        "rademacher_overhead_ratio": med("rademacher-1x1", "overhead_ratio"),
        "memory_ratio_training_over_inference": med("gaussian-1x1", "memory_ratio"),
        "tokens_per_s_1x1_1thread": med("1thread-2x1", "single_rank", "tokens_per_s"),
        "tokens_per_s_2x1_1thread": med("1thread-2x1", "tokens_per_s"),
        "tokens_per_s_1x2_1thread": med("1thread-1x2", "tokens_per_s"),
        "throughput_2x1_over_1x1": med("1thread-2x1", "single_rank", "throughput_ratio"),
        "throughput_1x2_over_1x1": med("1thread-1x2", "single_rank", "throughput_ratio"),
        "repeats": args.repeats,
        "extra_overrides": args.extra,
    }
    targets = {"gaussian_over_reference": ("<=", 0.6), "gaussian_overhead_ratio": ("<=", 1.6),
               "rademacher_overhead_ratio": ("<=", 1.2), "memory_ratio_training_over_inference": ("<=", 1.2),
               "throughput_2x1_over_1x1": (">=", 1.7), "throughput_1x2_over_1x1": (">=", 1.7)}
    print(f"\nfigures (medians of {args.repeats} invocation(s); each a median of its timed steps)")
    for key, value in figures.items():
        if isinstance(value, float):
            target = targets.get(key)
            mark = ""
            if target:
                ok = value <= target[1] if target[0] == "<=" else value >= target[1]
                mark = f"   target {target[0]} {target[1]}: {'met' if ok else 'NOT met'}"
            print(f"  {key:40s} {value:8.3f}{mark}")
    figures["runs"] = runs
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"written {args.out}")


if __name__ == "__main__":
    main()
