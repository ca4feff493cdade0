"""Forward passes each ZO method needs: the validation-loss study of structured directions (BENCHMARKS.md,
"Fewer forward passes: structured directions on validation loss") and the earlier accuracy-target
study of the optimizers ("Optimizers: forward passes to sgd's accuracy").

**The loss study** (`--method`): each run trains one method at one learning rate and seed for the whole
budget (`--full`), evaluating the validation split every `--eval-every` forward passes, and appends its
curve to a JSON-lines file. `table` then takes MeZO's mean validation loss at the budget over its seeds
as each task's target, and gives each method's forward passes to that loss per seed, the fraction of
MeZO's, and the goal's verdict (at most half of MeZO's forward passes on both tasks, every seed); `plot`
draws loss against forward passes, one line per method (the seeds' mean), the seeds' range shaded.

    for s in 0 1 2; do python benchmarks/convergence.py run --task mr --method mezo --lr 2e-5 --seed $s \
        --full --eval-every 50 --out study.jsonl; done
    python benchmarks/convergence.py run --task mr --method sparse --lr 1e-4 --full --eval-every 50 --out study.jsonl
    python benchmarks/convergence.py table study.jsonl
    python benchmarks/convergence.py plot study.jsonl docs/img/structured-directions.png

**The accuracy study** (`--optim`, `--target`):

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
import fcntl
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
# The methods of the loss study: each at the setting docs/estimators.md documents.
METHODS = {
    "mezo": [],
    "lozo": ["estimator=lozo"],
    "lozo-m": ["estimator=lozo", "estimator.factor_momentum=0.9"],
    "subzero": ["estimator=subzero"],
    "sparse": ["estimator=sparse_mezo"],
    "hizoo": ["estimator.clean=true", "optim.name=hizoo"],  # three forward passes a step
    "meazo": ["optim.name=meazo"],  # MeZO's plan, the step over the running rms of the projected gradients
}


def vader_csv() -> Path:
    """The three-class CSV: $DISTZO_VADER_CSV where set (a machine without a package index, such as a lent
    GPU: benchmarks/gpu_prepare.sh builds it), else built once here (examples/vader_three_class.py fetches
    the sdist with pip)."""
    if os.environ.get("DISTZO_VADER_CSV"):
        given = Path(os.environ["DISTZO_VADER_CSV"])
        if not given.is_file():
            raise SystemExit(f"DISTZO_VADER_CSV={given} is not a file; build it with "
                             f"python examples/vader_three_class.py --set amazon --out {given}")
        return given
    out = Path(tempfile.gettempdir()) / "distzo-vader" / "amazon3.csv"
    if not out.exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "vader_three_class.py"), "--set", "amazon",
                        "--out", str(out)], check=True)
    return out


def overrides(ns) -> list[str]:
    task = [o.format(data=vader_csv()) if "{data}" in o else o.replace("{{", "{").replace("}}", "}")
            for o in TASKS[ns.task]]
    optim = [] if ns.optim == "sgd" and not ns.name_key else [f"optim.name={ns.optim}"]
    method = METHODS[ns.method] if ns.method else []
    return [*task, *method, *optim, *OPTIM_ARGS.get(ns.optim, []), f"optim.lr={ns.lr}", f"seed={ns.seed}",
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
    record = {"task": ns.task, "optim": ns.optim, "method": ns.method, "lr": ns.lr, "seed": ns.seed,
              "target": ns.target,
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
            if ns.deadline_s is not None and time.time() - started > ns.deadline_s:
                evaluate(forwards, train_s)  # the curve ends where the run was cut
                outcome = "deadline"
                break
            if forwards >= next_eval:
                next_eval += ns.eval_every
                e = evaluate(forwards, train_s)
                if ns.target is not None and e["accuracy"] >= ns.target and not ns.full:
                    outcome = "reached"
                    break
                if not math.isfinite(e["loss"]) or e["loss"] > 1.5 * first["loss"]:
                    outcome = "diverged"
                    break
                if not ns.full and forwards >= ns.max_forwards / 2 and e["accuracy"] < first["accuracy"] + 0.5 * (
                        (ns.target or 1.0) - first["accuracy"]):
                    outcome = "too slow"
                    break
    record["outcome"] = outcome
    record["reached_at"] = next((e for e in record["evals"] if ns.target is not None and e["accuracy"] >= ns.target),
                                None)
    record["best"] = max(record["evals"], key=lambda e: e["accuracy"])
    with open(ns.out, "a") as fh:  # runs side by side append to one file: one at a time
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write(json.dumps(record) + "\n")
    print(f"{ns.task} {ns.method or ns.optim} lr={ns.lr} seed={ns.seed}: {outcome}", flush=True)


# Overrides a run was given that do not change what it computes (where and how fast only)
_PLACEMENT = ("device=", "threads=")


def variant(r: dict) -> str:
    """A run's method with the settings it was given beyond the study's (`run`'s extra overrides, e.g.
    "hizoo optim.alpha=1e-4"): runs of one method at one lr but other settings are other rows."""
    given = r.get("overrides", [])
    steps = next((i for i, o in enumerate(given) if o.startswith("steps=")), len(given))
    extra = [o for o in given[steps + 1:] if not o.startswith(_PLACEMENT)]
    return " ".join([r["method"], *extra])


def loss_at(r: dict, forwards: int) -> float | None:
    """The run's validation loss at `forwards` forward passes: the evaluation nearest to it, within one
    step's forward passes (a method of three a step is evaluated at 102, 201, 402 for 100, 200, 400)."""
    per_step = r.get("forwards_per_step", 1)
    near = min(r["evals"], key=lambda e: abs(e["forwards"] - forwards), default=None)
    return near["loss"] if near is not None and abs(near["forwards"] - forwards) < max(per_step, 1) else None


def loss_study(records: list[dict]) -> dict:
    """Per task: MeZO's target (the mean validation loss at the budget of its seeds that ran the whole
    budget; of the MeZO runs, the lr with the most such seeds) and, per (method and its extra settings,
    lr), each seed's curve and forward passes to the target (None: not within the budget, or not before
    the run was cut: outcome 'deadline')."""
    out: dict = {}
    for r in records:
        task = out.setdefault(r["task"], {"runs": {}})
        task["runs"].setdefault((variant(r), r["lr"]), {})[r["seed"]] = r
    for task in out.values():
        whole = [[r for r in runs.values() if r.get("outcome") != "deadline"]
                 for (m, _), runs in task["runs"].items() if m == "mezo"]
        finals = [r["evals"][-1] for r in max(whole, key=len, default=[])]
        if not finals:
            continue
        task["budget"] = max(e["forwards"] for e in finals)
        task["target"] = sum(e["loss"] for e in finals) / len(finals)
        task["reached"] = {key: {seed: next((e["forwards"] for e in r["evals"] if e["loss"] <= task["target"]), None)
                                 for seed, r in runs.items()} for key, runs in task["runs"].items()}
    return out


def loss_table(records: list[dict]) -> None:
    study = loss_study(records)
    budgets = {t["budget"] for t in study.values() if "budget" in t}
    at = f"{' / '.join(str(b * k // 4) for k in (1, 2, 4) for b in budgets)} forward passes" if len(budgets) == 1 \
        else "a quarter / half / all of the budget"
    print("| task (MeZO's mean validation loss at its budget) | method | lr | seeds | forward passes to it, each "
          f"seed | / MeZO's | validation loss at {at} (mean, range) |")
    print("|---|---|---|---|---|---|---|")
    verdict: dict = {}
    for name, task in study.items():
        if "target" not in task:
            continue
        for (method, lr), runs in sorted(task["runs"].items(), key=lambda kv: (kv[0][0] != "mezo", kv[0])):
            reached = task["reached"][(method, lr)]
            # a run cut short (outcome 'deadline') settles the verdict only where it reached the target first
            complete = [s for s, r in runs.items() if r.get("outcome") != "deadline" or reached[s] is not None]
            worst = None if None in reached.values() else max(reached.values())
            frac = f"{worst / task['budget']:.2f}" if worst is not None else \
                f"> {1.0:.2f}" if len(complete) == len(runs) else "- (cut)"
            budget = task["budget"]
            cells = []
            for point in (budget // 4, budget // 2, budget):
                losses = [loss for r in runs.values() if (loss := loss_at(r, point)) is not None]
                cells.append(f"{sum(losses) / len(losses):.4f} ({min(losses):.4f}-{max(losses):.4f})"
                             + (f" [{len(losses)} seeds]" if len(losses) < len(runs) else "") if losses else "-")
            each = ", ".join(str(reached[s]) if reached[s] is not None else
                             f">{runs[s]['evals'][-1]['forwards']} (cut)" if runs[s].get("outcome") == "deadline" else
                             f">{budget}" for s in sorted(reached))
            print(f"| {name} ({task['target']:.4f} at {task['budget']}) | {method} | {lr:g} | {len(runs)} | {each} "
                  f"| {frac} | {' / '.join(cells)} |")
            if method != "mezo" and len(complete) >= 3:
                verdict.setdefault((method, lr), {})[name] = (worst / task["budget"]) if worst is not None else None
    tasks = [t for t in study if "target" in study[t]]
    print()
    met = [k for k, v in verdict.items()
           if len(v) == len(tasks) and all(f is not None and f <= 0.5 for f in v.values())]
    if met:
        print("Goal met (at most 0.5x MeZO's forward passes on every task, every seed): "
              + ", ".join(f"{m} at lr {lr:g}" for m, lr in met))
    else:
        def rank(fractions: dict) -> tuple:  # fewest tasks missed, then the worst fraction where reached
            reached = [f for f in fractions.values() if f is not None]
            return len(tasks) - len(reached), max(reached, default=9.9)

        ranked = sorted(verdict.items(), key=lambda kv: rank(kv[1]))
        if not ranked:
            print("Goal not assessed: no method has three seeds on every task.")
        else:
            def said(fr: dict) -> str:
                return ", ".join(f"{t} {f:.2f}x" if f is not None else f"{t} not within the budget"
                                 for t, f in sorted(fr.items()))

            best = [(key, fr) for key, fr in ranked if rank(fr) == rank(ranked[0][1])]
            print("Goal not met: no method reaches MeZO's loss in at most 0.5x its forward passes on every task, every "
                  "seed. Best: " + "; ".join(f"{m} at lr {lr:g}, {said(fr)}" for (m, lr), fr in best))


def plot(ns) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    *files, png = ns.files
    if not files:
        raise SystemExit("plot: give the results files, then the image to write")
    records = [r for r in read_records(files) if r.get("method")]
    study = loss_study(records)
    chosen = {m: float(lr) for m, lr in (c.split("=") for c in ns.methods)} if ns.methods else None
    fig, axes = plt.subplots(1, len(study), figsize=(6 * len(study), 4.2), squeeze=False)
    for ax, (name, task) in zip(axes[0], study.items()):
        for (method, lr), runs in sorted(task["runs"].items()):
            if chosen is not None and chosen.get(method) != lr:
                continue
            forwards = [e["forwards"] for e in next(iter(runs.values()))["evals"]]
            curves = [[e["loss"] for e in r["evals"]][:len(forwards)] for r in runs.values()]
            mean = [sum(c[i] for c in curves) / len(curves) for i in range(len(forwards))]
            line, = ax.plot(forwards, mean, label=f"{method} (lr {lr:g}, {len(curves)} seeds)")
            ax.fill_between(forwards, [min(c[i] for c in curves) for i in range(len(forwards))],
                            [max(c[i] for c in curves) for i in range(len(forwards))], color=line.get_color(),
                            alpha=0.2)
        if "target" in task:
            ax.axhline(task["target"], color="gray", linestyle=":", linewidth=1, label="MeZO's loss at its budget")
        ax.set_title(f"{name}: validation loss")
        ax.set_xlabel("forward passes")
        ax.set_ylabel("loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(png)


def read_records(files: list[Path]) -> list[dict]:
    """Every run of the results files, in order (a study kept in several files reads as one)."""
    return [json.loads(line) for f in files for line in open(f) if line.strip()]


def table(ns) -> None:
    records = read_records(ns.files)
    if any(r.get("method") for r in records):
        loss_table([r for r in records if r.get("method")])
        return
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
    p.add_argument("--method", choices=sorted(METHODS), default=None, help="a method of the loss study")
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=None, help="validation accuracy to reach (accuracy study)")
    p.add_argument("--max-forwards", type=int, default=400)
    p.add_argument("--eval-every", type=int, default=40, help="forward passes between evaluations")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--full", action="store_true", help="run the whole budget (the sgd baseline that sets a target)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="stop after this many seconds, keeping the curve so far (outcome 'deadline')")
    p.add_argument("--name-key", action="store_true", help="pass optim.name=sgd explicitly")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("extra", nargs="*", help="further overrides")
    p.set_defaults(fn=run)
    t = sub.add_parser("table", help="the markdown table of results files (their runs together)")
    t.add_argument("files", type=Path, nargs="+")
    t.set_defaults(fn=table)
    g = sub.add_parser("plot", help="validation loss against forward passes (the loss study)")
    g.add_argument("files", type=Path, nargs="+", help="results files, then the image to write")
    g.add_argument("--methods", nargs="*", help="method=lr pairs to draw (default: every run)")
    g.set_defaults(fn=plot)
    ns = parser.parse_args()
    ns.fn(ns)


if __name__ == "__main__":
    main()
