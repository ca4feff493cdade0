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

from bench_runs import interleaved_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="config overrides for both (after --)")
    ns = parser.parse_args()

    def show(step: int, losses: dict) -> None:
        print(f"step {step}: losses {losses['auto'].tolist()} with the cache, {losses['false'].tolist()} without",
              flush=True)

    base = ["task=trivia", "objective=f1", "batch_size=16", "task.max_new_tokens=8", *ns.overrides]
    variants = {cache: [*base, f"engine.decode_cache={cache}"] for cache in ("auto", "false")}
    med, same, built = interleaved_steps(variants, ns.rounds, ns.warmup, show)
    cfg = built["auto"].cfg
    print(json.dumps({"model": str(cfg.model.name), "batch_size": cfg.batch_size,
                      "max_new_tokens": cfg.task.max_new_tokens, "cache_used": built["auto"].engine.decoder.off is None,
                      "step_s_cache": round(med["auto"], 4), "step_s_no_cache": round(med["false"], 4),
                      "speedup": round(med["false"] / med["auto"], 3), "losses_equal": same}, indent=2))
    print(f"step time: with the cache {med['auto']:.3f} s, without {med['false']:.3f} s; "
          f"{med['false'] / med['auto']:.2f}x faster (median of {ns.rounds} interleaved rounds); "
          f"losses equal at every step: {same}")
    for c in built.values():
        c.close()


if __name__ == "__main__":
    main()
