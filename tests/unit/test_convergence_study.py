"""The loss study's verdict (benchmarks/convergence.py `table`), on hand-made curves whose answer is
known: MeZO's target is the mean of its whole-budget seeds' final losses; a method's fraction is its
worst seed's forward passes to that loss over MeZO's budget; a run cut by --deadline-s settles nothing
unless it reached the target before the cut."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "convergence.py"


def convergence():
    spec = importlib.util.spec_from_file_location("convergence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(task: str, method: str, seed: int, losses: list[float], outcome: str = "budget", lr: float = 1e-4) -> dict:
    """A record whose curve is evaluated every 100 forward passes, from 0."""
    return {"task": task, "method": method, "lr": lr, "seed": seed, "outcome": outcome,
            "evals": [{"forwards": 100 * i, "loss": loss, "accuracy": 0.5} for i, loss in enumerate(losses)]}


def mezo(task: str) -> list[dict]:
    # final losses 0.9, 1.0, 1.1: the target is 1.0 at 400 forward passes
    return [run(task, "mezo", s, [2.0, 1.6, 1.3, 1.1, end], lr=2e-5) for s, end in enumerate([0.9, 1.0, 1.1])]


def test_target_and_fraction(capsys):
    conv = convergence()
    fast = [run(t, "fast", s, [2.0, 1.2, 0.95 + 0.01 * s, 0.9, 0.8]) for t in ("a", "b") for s in range(3)]
    study = conv.loss_study(mezo("a") + mezo("b") + fast)
    assert study["a"]["budget"] == 400 and abs(study["a"]["target"] - 1.0) < 1e-12
    assert study["a"]["reached"][("mezo", 2e-5)] == {0: 400, 1: 400, 2: None}
    assert study["a"]["reached"][("fast", 1e-4)] == {0: 200, 1: 200, 2: 200}
    conv.loss_table(mezo("a") + mezo("b") + fast)
    out = capsys.readouterr().out
    assert "| a (1.0000 at 400) | fast | 0.0001 | 3 | 200, 200, 200 | 0.50 |" in out
    assert "validation loss at 100 / 200 / 400 forward passes" in out
    assert "Goal met" in out and "fast at lr 0.0001" in out


def test_one_slow_seed_fails_the_goal(capsys):
    conv = convergence()
    runs = [run(t, "fast", s, [2.0, 1.2, 0.95, 0.9, 0.8] if s < 2 else [2.0, 1.5, 1.2, 0.99, 0.9])
            for t in ("a", "b") for s in range(3)]
    conv.loss_table(mezo("a") + mezo("b") + runs)
    out = capsys.readouterr().out
    assert "| 0.75 |" in out  # the slow seed reaches 1.0 at 300 of 400
    assert "Goal not met" in out and "a 0.75x, b 0.75x" in out


def test_the_best_misses_the_fewest_tasks(capsys):
    conv = convergence()
    never = [run(t, "never", s, [2.0, 1.5, 1.2, 1.1, 1.05]) for t in ("a", "b") for s in range(3)]
    half = [run(t, "half", s, [2.0, 1.5, 1.2, 0.99, 0.9] if t == "a" else [2.0, 1.5, 1.2, 1.1, 1.05], lr=3e-4)
            for t in ("a", "b") for s in range(3)]
    conv.loss_table(mezo("a") + mezo("b") + never + half)
    out = capsys.readouterr().out.split("Goal not met")[1]
    assert "Best: half at lr 0.0003, a 0.75x, b not within the budget" in out and "never" not in out


def test_a_cut_run_settles_nothing_unless_it_reached(capsys):
    conv = convergence()
    cut_mezo = run("a", "mezo", 3, [2.0, 0.1], outcome="deadline", lr=2e-5)  # left out of the target
    cut = [run("a", "fast", s, [2.0, 1.2], outcome="deadline") for s in range(3)]
    reached = [run("a", "good", s, [2.0, 0.99], outcome="deadline") for s in range(3)]
    study = conv.loss_study(mezo("a") + [cut_mezo] + cut + reached)
    assert abs(study["a"]["target"] - 1.0) < 1e-12
    conv.loss_table(mezo("a") + [cut_mezo] + cut + reached)
    out = capsys.readouterr().out
    assert ">100 (cut), >100 (cut), >100 (cut) | - (cut) |" in out
    assert "| good | 0.0001 | 3 | 100, 100, 100 | 0.25 |" in out
    assert "Goal met" in out and "good" in out.split("Goal met")[1] and "fast" not in out.split("Goal met")[1]


def test_runs_with_other_settings_are_other_rows_and_three_forward_steps_meet_the_marks(capsys):
    """A method of three forward passes a step is evaluated at 102, 201, 402 for the marks 100, 200, 400;
    a run given a setting beyond the study's (an extra override) is its own row, where one given only
    where it ran (device=, threads=) is not."""
    conv = convergence()
    study_args = ["optim.lr=2e-05", "seed=0", "threads=2", "steps=400"]

    def hizoo(task: str, seed: int, extra: list[str], losses: list[float]) -> dict:
        r = run(task, "hizoo", seed, [], lr=2e-5)
        r["overrides"], r["forwards_per_step"] = study_args + extra, 3
        r["evals"] = [{"forwards": f, "loss": loss, "accuracy": 0.5}
                      for f, loss in zip((0, 102, 201, 303, 402), losses)]
        return r

    plain = [hizoo("a", s, ["device=cuda"] if s else [], [2.0, 1.5, 1.2, 1.0, 0.95]) for s in range(3)]
    other = [hizoo("a", 0, ["optim.alpha=1e-4"], [2.0, 1.9, 1.8, 1.7, 1.6])]
    conv.loss_table(mezo("a") + plain + other)
    out = capsys.readouterr().out
    assert "| a (1.0000 at 400) | hizoo | 2e-05 | 3 | 303, 303, 303 | 0.76 | 1.5000 (1.5000-1.5000) / " \
           "1.2000 (1.2000-1.2000) / 0.9500 (0.9500-0.9500) |" in out
    assert "| hizoo optim.alpha=1e-4 | 2e-05 | 1 | >400 | > 1.00 | 1.9000 (1.9000-1.9000) / " in out


def test_the_target_is_the_mezo_lr_with_the_most_whole_seeds():
    conv = convergence()
    one_other = run("a", "mezo", 0, [2.0, 0.5, 0.4, 0.3, 0.2], lr=1e-4)  # one seed at another lr, listed first
    study = conv.loss_study([one_other] + mezo("a"))
    assert abs(study["a"]["target"] - 1.0) < 1e-12
