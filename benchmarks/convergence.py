"""Forward passes (and wall time) each ZO optimizer needs to reach the validation accuracy that
`optim.name=sgd` reaches at step 200 (BENCHMARKS.md, "Optimizers: forward passes to sgd's accuracy").

One invocation trains one setting and appends what it saw to a JSON-lines file; `table` turns the
file into the markdown table of BENCHMARKS.md. Each run evaluates the validation split every
`--eval-every` forward passes (40 by default: every 20 steps of a two-probe optimizer) and stops at
the first evaluation that reaches `--target`, at `--max-forwards`, or when it clearly cannot get
there: a validation loss above 1.5x its starting value or non-finite (diverged), or, from half the
budget on, an accuracy that has not covered half the way from its start to the target.

    python benchmarks/convergence.py run --task mr --optim sgd --lr 2e-5 --target 0.692 --out conv.jsonl
    python benchmarks/convergence.py run --task mr --optim adam --lr 1e-4 --target 0.692 --out conv.jsonl
    python benchmarks/convergence.py table conv.jsonl

Tasks: `mr` is the embedded default's movie-review polarity (mr-polarity, 500 validation examples);
`vader` the three-class Amazon snippets that examples/vader_three_class.py builds from the
vaderSentiment sdist (500 validation examples); `endings` the bundled multiple-choice mr-endings.
Forward passes are counted per step as the estimator's plan has probes (MeZO: 2; FZOO's one-sided
plan: q + 1); evaluations are not counted. Wall time is the training steps' time, evaluations
excluded (both are recorded).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TASKS = {
    "mr": [],
    "endings": ["task=mr-endings"],
    "vader": ["task=custom", "task.path={data}", "task.labels=[negative,neutral,positive]",
              "task.template='{{text}} Overall it was'", "task.label_words=[' bad',' so-so',' good']",
              "task.val_size=500", "task.test_size=500"],
}
# The estimator settings each optimizer runs with (FZOO: its one-sided batch of Rademacher probes).
OPTIM_ARGS = {
    "fzoo": ["estimator.difference=forward", "estimator.distribution=rademacher", "estimator.q=8"],
}


def vader_csv() -> Path:
    """The three-class CSV, built once (examples/vader_three_class.py fetches the sdist with pip)."""
    out = Path(tempfile.gettempdir()) / "distzo-vader" / "amazon3.csv"
    if not out.exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "vader_three_class.py"), "--set", "amazon",
                        "--out", str(out)], check=True)
    return out


def overrides(ns) -> list[str]:
    task = [o.format(data=vader_csv()) if "{data}" in o else o.replace("{{", "{").replace("}}", "}")
            for o in TASKS[ns.task]]
    optim = [] if ns.optim == "sgd" and not ns.name_key else [f"optim.name={ns.optim}"]
    return [*task, *optim, *OPTIM_ARGS.get(ns.optim, []), f"optim.lr={ns.lr}", f"seed={ns.seed}",
            f"threads={ns.threads}", "eval_every=0", "checkpoint.every=0", "save_final=false", "log_every=1000",
            f"steps={ns.max_forwards}", *ns.extra]


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                              cwd=Path(__import__("distzo").__file__).parents[1],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def run(ns) -> None:
    import torch

    import distzo

    args = overrides(ns)
    cfg = distzo.compose(*args)
    run_dir = Path(tempfile.mkdtemp(prefix=f"conv-{ns.task}-{ns.optim}-"))
    record = {"task": ns.task, "optim": ns.optim, "lr": ns.lr, "seed": ns.seed, "target": ns.target,
              "max_forwards": ns.max_forwards, "overrides": args, "commit": git_commit(),
              "date": datetime.date.today().isoformat(), "machine": f"{socket.gethostname()} {platform.machine()}, "
              f"{os.cpu_count()} CPUs, torch {torch.__version__}", "load_at_start": os.getloadavg()[0],
              "command": "python benchmarks/convergence.py " + " ".join(sys.argv[1:]), "evals": []}
    started = time.time()
    with distzo.Trainer(cfg, run_dir) as trainer:
        per_step = len(trainer.components.estimator.dealt_plan()) + trainer.components.estimator.shared_clean
        record["forwards_per_step"] = per_step

        def evaluate(forwards: int, train_s: float) -> dict:
            r = trainer.evaluate("validation")
            entry = {"forwards": forwards, "steps": trainer.step_count, "accuracy": r["accuracy"], "loss": r["loss"],
                     "train_s": round(train_s, 1), "wall_s": round(time.time() - started, 1)}
            record["evals"].append(entry)
            print(json.dumps(entry), flush=True)
            return entry

        first = evaluate(0, 0.0)
        forwards, train_s, next_eval, outcome = 0, 0.0, ns.eval_every, "budget"
        while forwards < ns.max_forwards:
            rec = trainer.step()
            forwards += per_step
            train_s += rec.step_time_s
            if rec.skipped:
                outcome = "non-finite loss"
                break
            if forwards >= next_eval:
                next_eval += ns.eval_every
                e = evaluate(forwards, train_s)
                if e["accuracy"] >= ns.target and not ns.full:
                    outcome = "reached"
                    break
                if not math.isfinite(e["loss"]) or e["loss"] > 1.5 * first["loss"]:
                    outcome = "diverged"
                    break
                if not ns.full and forwards >= ns.max_forwards / 2 and e["accuracy"] < first["accuracy"] + 0.5 * (
                        ns.target - first["accuracy"]):
                    outcome = "too slow"
                    break
    record["outcome"] = outcome
    record["reached_at"] = next((e for e in record["evals"] if e["accuracy"] >= ns.target), None)
    record["best"] = max(record["evals"], key=lambda e: e["accuracy"])
    with open(ns.out, "a") as fh:
        fh.write(json.dumps(record) + "\n")
    print(f"{ns.task} {ns.optim} lr={ns.lr} seed={ns.seed}: {outcome}", flush=True)


def table(ns) -> None:
    records = [json.loads(line) for line in open(ns.file) if line.strip()]
    print("| task | optimizer | lr | seed | forward passes to the target | steps | training time | best validation "
          "accuracy (at forwards) | outcome |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        hit = r["reached_at"]
        best = r["best"]
        print(f"| {r['task']} (target {r['target']}) | {r['optim']} | {r['lr']:g} | {r['seed']} | "
              f"{hit['forwards'] if hit else '> ' + str(r['evals'][-1]['forwards'])} | "
              f"{hit['steps'] if hit else '-'} | {str(hit['train_s']) + ' s' if hit else '-'} | "
              f"{best['accuracy']:.3f} ({best['forwards']}) | {r['outcome']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="train one setting until it reaches the target (or cannot)")
    p.add_argument("--task", choices=sorted(TASKS), default="mr")
    p.add_argument("--optim", default="sgd")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, required=True, help="validation accuracy to reach")
    p.add_argument("--max-forwards", type=int, default=400)
    p.add_argument("--eval-every", type=int, default=40, help="forward passes between evaluations")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--full", action="store_true", help="run the whole budget (the sgd baseline that sets a target)")
    p.add_argument("--name-key", action="store_true", help="pass optim.name=sgd explicitly")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("extra", nargs="*", help="further overrides")
    p.set_defaults(fn=run)
    t = sub.add_parser("table", help="the markdown table of a results file")
    t.add_argument("file", type=Path)
    t.set_defaults(fn=table)
    ns = parser.parse_args()
    ns.fn(ns)


if __name__ == "__main__":
    main()
