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
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="config overrides for both (after --)")
    ns = parser.parse_args()

    from distzo.config.compose import compose_config
    from distzo.parallel.mesh import Mesh
    from distzo.run.components import build_components
    from distzo.run.training import zo_step

    built = {}
    for path in ("dedicated", "general"):
        cfg = compose_config(["batch_size=16", *ns.overrides, f"model.adapter={path}"])
        built[path] = build_components(cfg, Mesh.single(), 0)
        print(f"{path}: {built[path].engine.adapter.describe()}", flush=True)
    times: dict[str, list[float]] = {p: [] for p in built}
    same = True
    for step in range(1, ns.warmup + ns.rounds + 1):
        losses = {}
        for path, c in built.items():
            start = time.perf_counter()
            losses[path] = zo_step(c, step).losses
            if step > ns.warmup:
                times[path].append(time.perf_counter() - start)
        same = same and torch.equal(losses["dedicated"], losses["general"])
    med = {p: statistics.median(t) for p, t in times.items()}
    print(f"step time: dedicated {med['dedicated']:.3f} s, general {med['general']:.3f} s; general / dedicated "
          f"{med['general'] / med['dedicated']:.3f} (median of {ns.rounds} interleaved rounds)")
    print(f"losses of the two trajectories bitwise equal at every step: {same}")
    for c in built.values():
        c.close()


if __name__ == "__main__":
    main()
