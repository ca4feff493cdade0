"""What each estimator costs a step, and its peak memory, beside MeZO's (BENCHMARKS.md, "Fewer forward
passes: structured directions on validation loss").

Runs `python -m distzo bench` once per estimator, each in a fresh process (a process's peak memory
belongs to one run), on the embedded default: SmolLM2-135M, mr-polarity, batch 16, fp32, q=1, 1x1,
each estimator at its documented setting. Every run other than MeZO's also times MeZO's step (the
same eps, q, difference and distribution, optim=sgd) on the same batches in the same rounds, so its
step / MeZO's step is a ratio taken within one run, also per forward pass; the peak memory of each
run is its own, compared with MeZO's run plus the estimator's state. Extra arguments after `--` go to
every bench run.

    python benchmarks/estimator_cost.py --out estimator-cost.json
    python benchmarks/estimator_cost.py --estimators mezo lozo -- model=tiny task=synthetic-cue   # a quick check
"""

from __future__ import annotations

from bench_runs import bench_each

# Each method at the setting docs/estimators.md documents (its Settings' defaults unless named here).
SETTINGS = {"lozo-m": ["estimator=lozo", "estimator.factor_momentum=0.9"]}
# The step may cost at most this much more than MeZO's per forward pass (the bound).
BOUND = 1.15


def main() -> None:
    names = ["mezo", "lozo", "lozo-m", "subzero", "sparse_mezo"]
    rows = bench_each(__doc__, "estimators", names,
                      lambda name: [*SETTINGS.get(name, [f"estimator={name}"]), "bench.reference=false"])
    gib = 2**30
    base = rows.get("mezo")
    print("| estimator | forward passes | directions' state, and with their factors (MiB) | step | MeZO's step, same "
          "rounds | step / MeZO's per forward pass | training peak (GiB) | MeZO's peak + what the directions hold "
          "(GiB) | within |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        e = r.get("estimator_cost", {})
        state, held = e.get("directions_state_bytes", 0), e.get("directions_memory_bytes", 0)
        peak = r["peak_memory_bytes"]["training"]
        allowed = base["peak_memory_bytes"]["training"] + held if base else None
        ratio = e.get("step_over_mezo_per_forward", 1.0 if name == "mezo" else None)
        within = (ratio is not None and ratio <= BOUND) and (allowed is None or peak <= allowed * 1.01)
        print(f"| {name} | {e.get('forward_passes', '-')} | {state / 2**20:.2f}, {held / 2**20:.2f} | "
              f"{r['step_time_s']:.3f} s | "
              f"{e.get('mezo_step_time_s', r['step_time_s'] if name == 'mezo' else '-')} | {ratio} | "
              f"{peak / gib:.3f} | {allowed / gib if allowed else float('nan'):.3f} | {'yes' if within else 'no'} |")


if __name__ == "__main__":
    main()
