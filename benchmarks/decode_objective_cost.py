"""What a decoding objective's step costs with the decode cache, against decoding without it.

objective=f1 (MeZO §3.3) decodes each evaluation's answers token by token through the engine. Builds
the same training twice in one process, `engine.decode_cache=auto` and `engine.decode_cache=false`
(same seed, weights and batches), times full ZO steps (`distzo.run.training.zo_step`) in interleaved
rounds, and prints the median step time of each, their ratio, and whether the two trajectories'
losses (minus the answers' mean F1, so the decoded tokens) agree at every step:

    python benchmarks/decode_objective_cost.py                     # embedded default, trivia, batch 16, 8 tokens
    python benchmarks/decode_objective_cost.py --rounds 2 -- model=tiny task.max_new_tokens=4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="config overrides for both (after --)")
    ns = parser.parse_args()

    from distzo.config.compose import compose_config
    from distzo.parallel.mesh import Mesh
    from distzo.run.components import build_components
    from distzo.run.training import zo_step

    built = {}
    for cache in ("auto", "false"):
        cfg = compose_config(["task=trivia", "objective=f1", "batch_size=16", "task.max_new_tokens=8", *ns.overrides,
                              f"engine.decode_cache={cache}"])
        built[cache] = build_components(cfg, Mesh.single(), 0)
    times: dict[str, list[float]] = {c: [] for c in built}
    same = True
    for step in range(1, ns.warmup + ns.rounds + 1):
        losses = {}
        for cache, c in built.items():
            start = time.perf_counter()
            losses[cache] = zo_step(c, step).losses.tolist()
            if step > ns.warmup:
                times[cache].append(time.perf_counter() - start)
        same = same and losses["auto"] == losses["false"]
        print(f"step {step}: losses {losses['auto']} with the cache, {losses['false']} without", flush=True)
    used = built["auto"].engine.decoder.off is None
    med = {c: statistics.median(t) for c, t in times.items()}
    cfg = built["auto"].cfg
    print(json.dumps({"model": str(cfg.model.name), "batch_size": cfg.batch_size,
                      "max_new_tokens": cfg.task.max_new_tokens, "cache_used": used,
                      "step_s_cache": round(med["auto"], 4), "step_s_no_cache": round(med["false"], 4),
                      "speedup": round(med["false"] / med["auto"], 3), "losses_equal": same}, indent=2))
    print(f"step time: with the cache {med['auto']:.3f} s, without {med['false']:.3f} s; "
          f"{med['false'] / med['auto']:.2f}x faster (median of {ns.rounds} interleaved rounds); "
          f"losses equal at every step: {same}")
    for c in built.values():
        c.close()


if __name__ == "__main__":
    main()
