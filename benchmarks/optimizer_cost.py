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

from bench_runs import bench_each

ARGS = {"fzoo": ["estimator.difference=forward", "estimator.distribution=rademacher", "estimator.q=8"],
        "hizoo": ["estimator.clean=true"]}  # and sgd beside it on the same three-probe plan


def main() -> None:
    rows = bench_each(__doc__, "optimizers", ["sgd", "momentum", "adam", "sign", "fzoo", "hizoo", "meazo"],
                      lambda name: [f"optim.name={name}", *ARGS.get(name, []), "bench.reference=false"])
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


if __name__ == "__main__":
    main()
