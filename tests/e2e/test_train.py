"""The training driver on the tiny model: learning, determinism, and the run directory's contents."""

import json

import pytest
import torch
from safetensors.torch import load_file

from distzo.run.training import train
from distzo.telemetry.jsonl import read_jsonl
from tests.conftest import TINY, make_config


def run(tmp_path, name, *overrides):
    out = tmp_path / name
    summary = train(make_config(*TINY, *overrides), out)
    return out, summary


def test_training_lowers_the_loss_of_a_learnable_task(tmp_path):
    out, summary = run(tmp_path, "learn", "steps=300", "optim.lr=1e-3", "save_final=false")
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if r["type"] == "eval" and r["split"] == "validation"]
    before, after = evals[0], evals[-1]
    assert before["step"] == 0 and after["step"] == 300
    assert after["loss"] < before["loss"] - 0.03, (before, after)
    assert after["accuracy"] > 0.6 and summary["validation_accuracy_after"] == after["accuracy"]


def test_same_seed_same_trajectory_and_weights(tmp_path):
    a, _ = run(tmp_path, "a", "steps=12", "seed=5")
    b, _ = run(tmp_path, "b", "steps=12", "seed=5")
    c, _ = run(tmp_path, "c", "steps=12", "seed=6")

    def trajectory(d):
        return [(r["step"], r["loss"], r["projected_grad"]) for r in read_jsonl(d / "metrics.jsonl")
                if r["type"] == "train"]

    assert trajectory(a) == trajectory(b) and trajectory(a) != trajectory(c)
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_run_directory_contents(tmp_path):
    out, summary = run(tmp_path, "out", "steps=4", "eval_every=2", "optim.schedule=linear")
    records = read_jsonl(out / "metrics.jsonl")
    train_lines = [r for r in records if r["type"] == "train"]
    assert [r["step"] for r in train_lines] == [1, 2, 3, 4]
    for r in train_lines:
        assert {"step", "loss", "projected_grad", "lr", "tokens", "step_time_s"} <= r.keys()
    assert train_lines[0]["lr"] > train_lines[-1]["lr"] > 0  # linear decay
    evals = [(r["step"], r["split"]) for r in records if r["type"] == "eval"]
    assert evals == [(0, "validation"), (2, "validation"), (4, "validation"), (4, "test")]
    assert all(0 <= r["accuracy"] <= 1 for r in records if r["type"] == "eval")
    for r in records:  # synthetic-cue's 200 validation and 200 test examples, every one scored
        if r["type"] == "eval":
            assert r["examples"] == 200 and r["accuracy"] * 200 == pytest.approx(round(r["accuracy"] * 200), abs=1e-9)
    by_split = {(r["step"], r["split"]): r["accuracy"] for r in records if r["type"] == "eval"}
    assert summary["test_accuracy"] == by_split[(4, "test")]
    assert (summary["validation_accuracy_before"], summary["validation_accuracy_after"]) == \
        (by_split[(0, "validation")], by_split[(4, "validation")])
    losses = {(r["step"], r["split"]): r["loss"] for r in records if r["type"] == "eval"}
    assert (summary["validation_loss_before"], summary["validation_loss_after"], summary["test_loss"]) == \
        (losses[(0, "validation")], losses[(4, "validation")], losses[(4, "test")])  # what a sweep may minimise
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    weights = load_file(out / "final" / "model.safetensors")
    assert "model.embed_tokens.weight" in weights and (out / "final" / "config.json").is_file()


def test_resuming_a_finished_run_rewrites_a_valid_summary_with_its_figures(tmp_path):
    """resume=auto on a run that has finished runs no step: summary.json and the summary line of
    metrics.jsonl are rewritten as strict JSON (no step time to report is null, not NaN) and keep the
    earlier session's figures before training."""
    out, first = run(tmp_path, "done", "steps=2", "checkpoint.every=2")
    _, again = run(tmp_path, "done", "steps=2", "checkpoint.every=2", "resume=auto")

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    written = json.loads((out / "summary.json").read_text(), parse_constant=refuse)
    assert written["resumed_from_step"] == 2 and written["step_time_s"] is None
    lines = [json.loads(line, parse_constant=refuse) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {k: v for k, v in lines[-1].items() if k not in ("type", "time")} == written
    assert written["validation_accuracy_before"] == again["validation_accuracy_before"] == \
        first["validation_accuracy_before"] is not None


def test_final_folder_loads_back_as_a_local_model(tmp_path):
    out, _ = run(tmp_path, "first", "steps=3")
    from distzo.models import load_model

    cfg = make_config("model=hf", f"model.path={out / 'final'}")
    model, _ = load_model(cfg.model)
    saved = load_file(out / "final" / "model.safetensors")
    assert torch.equal(model.model.embed_tokens.weight, saved["model.embed_tokens.weight"])


def test_non_finite_loss_stops_with_a_clear_error(tmp_path):
    from distzo.run.training import TrainingError

    with pytest.raises(TrainingError, match="3 steps in a row had non-finite losses .* Start a new run"):
        # float16 weights overflow after the first (huge) update: inf - inf = nan in the next forward
        run(tmp_path, "nan", "steps=5", "optim.lr=1e8", "model.dtype=float16")


def test_a_stop_on_an_evaluation_step_keeps_that_evaluation(tmp_path):
    """SIGTERM during step 4 of a run that validates every 4 steps: the run stops after the step's
    snapshot, before its evaluation; resume=auto evaluates step 4 first, so metrics.jsonl holds the
    uninterrupted run's evaluations, the same figures (the same weights, bitwise)."""
    import os
    import signal

    from distzo.run.callbacks import Callback
    from distzo.run.signals import Stopped

    settings = (*TINY, "steps=8", "eval_every=4", "task.val_size=16", "task.test_size=16", "checkpoint.every=2",
                "save_final=false")
    whole, _ = run(tmp_path, "whole", *settings)

    class StopAt4(Callback):
        def on_step_end(self, trainer, record):
            if record.step == 4:
                os.kill(os.getpid(), signal.SIGTERM)  # the stop is noticed once step 4 is done

    stopped = tmp_path / "stopped"
    with pytest.raises(Stopped, match="after step 4"):
        train(make_config(*settings), stopped, callbacks=[StopAt4()])
    train(make_config(*settings, "resume=auto"), stopped)

    def evaluations(d):
        return [(r["step"], r["split"], r["loss"], r["accuracy"]) for r in read_jsonl(d / "metrics.jsonl")
                if r["type"] == "eval"]

    assert [e[:2] for e in evaluations(whole)] == [(0, "validation"), (4, "validation"), (8, "validation"),
                                                   (8, "test")]
    assert evaluations(stopped) == evaluations(whole)


def test_a_stop_after_the_last_step_lets_the_run_finish_and_says_so(tmp_path, caplog):
    """SIGTERM during the final test evaluation: the run finishes (its evaluations and summary take
    less than a resume would redo) and the log says that, not that a snapshot and exit follow."""
    import os
    import signal

    from distzo.run.callbacks import Callback

    class StopInTest(Callback):
        def on_evaluate(self, trainer, split, result):
            if split == "test":
                os.kill(os.getpid(), signal.SIGTERM)

    with caplog.at_level("WARNING", logger="distzo"):
        summary = train(make_config(*TINY, "steps=2", "task.val_size=16", "task.test_size=16", "save_final=false"),
                        tmp_path / "run", callbacks=[StopInTest()])
    assert summary["steps"] == 2 and (tmp_path / "run" / "summary.json").is_file()
    assert "SIGTERM received after the last step: finishing the final evaluations" in caplog.text
    assert "then a snapshot and exit" not in caplog.text
