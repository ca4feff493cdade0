"""What the general path costs against a dedicated adapter, on a model that has both (SmolLM2, Llama).

Builds the same training twice in one process, `model.adapter=dedicated` and `model.adapter=general`
(same seed, same weights, same batches), and times full ZO steps (`distzo.run.training.zo_step`: perturbed
forwards, exchange, update) in interleaved rounds, so both see the same machine state. Prints the
median step time of each, their ratio, and whether the two trajectories' losses agree bitwise:

    python benchmarks/general_path_cost.py                        # embedded default, batch 16, 8 rounds
    python benchmarks/general_path_cost.py --rounds 4 -- model=tiny task=synthetic-cue
"""

from __future__ import annotations

import argparse

from bench_runs import interleaved_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="config overrides for both (after --)")
    ns = parser.parse_args()

    med, same, built = interleaved_steps({path: ["batch_size=16", *ns.overrides, f"model.adapter={path}"]
                                          for path in ("dedicated", "general")}, ns.rounds, ns.warmup)
    for path, c in built.items():
        print(f"{path}: {c.engine.adapter.describe()}")
    print(f"step time: dedicated {med['dedicated']:.3f} s, general {med['general']:.3f} s; general / dedicated "
          f"{med['general'] / med['dedicated']:.3f} (median of {ns.rounds} interleaved rounds)")
    print(f"losses of the two trajectories bitwise equal at every step: {same}")
    for c in built.values():
        c.close()


if __name__ == "__main__":
    main()
