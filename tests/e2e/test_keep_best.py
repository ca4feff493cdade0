"""keep_best (distzo/run/selection.py): the result of a run is the weights of its best validation
evaluation. The reference is the same run stopped at that step (a constant learning rate, so the
steps up to it are the same): the same operations on the same shapes, so its final weights, test
figures and validation figures are bitwise the same."""

from __future__ import annotations

import json
import shutil
import weakref
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

import distzo
from distzo.errors import ConfigError
from distzo.run.components import build_components
from distzo.run.training import TrainingError
from distzo.state.resume import ResumeError, truncate_logs
from distzo.state.snapshots import list_snapshots, read_snapshot
from distzo.telemetry.jsonl import read_jsonl
from tests.distributed.launch import torchrun

# Validation on 32 examples every 5 steps of 20 at a learning rate that overshoots: on this seed the
# accuracy peaks at step 15 and the loss at step 10. The tests find the best step from the run's own
# evaluations and assert that it is not the last one.
RUN = ["model=tiny", "task=synthetic-cue", "log_every=1000", "batch_size=8", "optim.lr=1e-3", "seed=9",
       "task.val_size=32", "task.test_size=32", "checkpoint.every=0", "eval_every=5"]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def evals(run_dir: Path, split: str) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["type"] == "eval" and r["split"] == split]


@pytest.fixture(scope="module")
def best_runs(tmp_path_factory):
    """keep_best=accuracy and keep_best=loss on one process, 20 steps (the run directories; each run's
    output in its train.log)."""
    root = tmp_path_factory.mktemp("keep-best")
    for metric in ("accuracy", "loss"):
        r = torchrun(1, *RUN, "steps=20", f"keep_best={metric}", f"hydra.run.dir={root / metric}", cwd=root)
        assert r.returncode == 0, r.stderr[-3000:]
    return {metric: root / metric for metric in ("accuracy", "loss")}


@pytest.mark.parametrize("metric", ["accuracy", "loss"])
def test_the_result_is_the_run_stopped_at_its_best_evaluation(tmp_path, best_runs, metric):
    run = best_runs[metric]
    s = summary(run)
    validation = {r["step"]: r for r in evals(run, "validation") if r["step"] > 0}
    sign = -1 if metric == "loss" else 1
    best = max(validation, key=lambda step: (sign * validation[step][metric], -step))  # the first of equals
    assert s["keep_best"] == metric and s["best_step"] == best and best < 20 and s["steps"] == 20
    ref = tmp_path / "ref"
    r = torchrun(1, *RUN, f"steps={best}", f"hydra.run.dir={ref}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_weights(run, ref)
    ref_summary = summary(ref)
    for key in ("validation_accuracy_after", "test_accuracy"):
        assert s[key] == ref_summary[key]
    [test], [ref_test] = evals(run, "test"), evals(ref, "test")
    # the test split saw step `best`'s weights; its line is logged at the step reached, as sinks need
    assert test["step"] == 20 and test["weights_step"] == best and test["loss"] == ref_test["loss"]
    assert validation[best]["loss"] == evals(ref, "validation")[-1]["loss"]
    assert f"keep_best={metric}: the result is the weights of step {best}" in (run / "train.log").read_text()
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["best"]


def test_a_mesh_and_offloaded_blocks_keep_the_same_best(tmp_path, best_runs):
    """mesh=2x1 with offload=cpu: the best is picked from the same all-reduced figures and the engine
    is rebuilt as resume builds one, so the result is the single process's, bitwise."""
    run = tmp_path / "mesh"
    r = torchrun(2, *RUN, "steps=20", "keep_best=accuracy", "mesh=2x1", "offload=cpu", f"hydra.run.dir={run}",
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "keep_best=accuracy: the result is the weights of step" in r.stdout + r.stderr
    assert summary(run)["best_step"] == summary(best_runs["accuracy"])["best_step"]
    assert_same_weights(run, best_runs["accuracy"])


def killed_copy(run: Path, to: Path, step: int) -> Path:
    """`run`'s directory as a SIGKILL after `step` leaves it (the logs up to that step, no final/ and no
    summary; tests/distributed/test_resume.py kills real runs): a tiny run's 20 steps take less time
    than a kill takes to land, so the kill is staged on the files instead."""
    shutil.copytree(run, to)
    shutil.rmtree(to / "final")
    (to / "summary.json").unlink()
    truncate_logs(to, step)
    for snapshot in list_snapshots(to):
        if int(snapshot.name.split("-")[1]) > step:
            shutil.rmtree(snapshot)
    return to


def test_a_run_killed_after_its_best_resumes_to_the_same_result(tmp_path, best_runs):
    best = summary(best_runs["accuracy"])["best_step"]
    run = killed_copy(best_runs["accuracy"], tmp_path / "run", best + 2)
    r = torchrun(1, *RUN, "steps=20", "keep_best=accuracy", "resume=auto", f"hydra.run.dir={run}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"Re-applying the {best + 2} step(s)" in r.stdout + r.stderr
    assert summary(run)["best_step"] == best
    assert_same_weights(run, best_runs["accuracy"])


@pytest.mark.parametrize("moment", ["before its evaluation", "while writing best/"])
def test_a_run_interrupted_at_its_best_step_resumes_to_the_same_result(tmp_path, best_runs, moment):
    """Killed after the best step was logged: before its evaluation (best/ still holds the earlier
    best), resume evaluates it, as the uninterrupted run did, and keeps it; after its evaluation but
    while best/ was being replaced (it is gone), resume writes the step's weights there again."""
    best = summary(best_runs["accuracy"])["best_step"]
    run = killed_copy(best_runs["accuracy"], tmp_path / "run", best)
    shutil.rmtree(run / "checkpoints" / "best")
    if moment == "before its evaluation":
        kept = [r for r in read_jsonl(run / "metrics.jsonl") if not (r["type"] == "eval" and r["step"] == best)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
        before = [e for e in evals(run, "validation") if e["step"] > 0]
        earlier = max(before, key=lambda e: (e["accuracy"], -e["step"]))["step"]  # best/'s step then
        ref = tmp_path / "earlier"  # the same run to that step: its last evaluation is its best
        r = torchrun(1, *RUN, f"steps={earlier}", "keep_best=accuracy", f"hydra.run.dir={ref}", cwd=tmp_path)
        assert r.returncode == 0 and summary(ref)["best_step"] == earlier, r.stderr[-3000:]
        shutil.copytree(ref / "checkpoints" / "best", run / "checkpoints" / "best")
    r = torchrun(1, *RUN, "steps=20", "keep_best=accuracy", "resume=auto", f"hydra.run.dir={run}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"keep_best=accuracy: new best, validation accuracy {summary(run)['validation_accuracy_after']:.4f} at " \
           f"step {best}" in r.stdout + r.stderr
    assert summary(run)["best_step"] == best
    assert [e["step"] for e in evals(run, "validation")] == [e["step"] for e in evals(best_runs["accuracy"],
                                                                                       "validation")]
    assert_same_weights(run, best_runs["accuracy"])


def test_a_best_whose_weights_were_removed_is_rebuilt_from_the_logged_steps_on_resume(tmp_path, best_runs):
    """best/ gone (removed, or a run started without keep_best): the resume re-applies the logged
    steps from the initial weights (this run keeps no snapshot), writes best/ from the weights of the
    best step as they pass, and continues; the result is the uninterrupted run's, bitwise."""
    best = summary(best_runs["accuracy"])["best_step"]
    run = killed_copy(best_runs["accuracy"], tmp_path / "run", 18)
    shutil.rmtree(run / "checkpoints" / "best")
    with open(run / "metrics.jsonl", "a") as fh:  # step 19's line, written before the kill cut its trajectory record
        fh.write(json.dumps({"type": "train", "step": 19, "loss": 0.5}) + "\n")
    r = torchrun(1, *RUN, "steps=20", "keep_best=accuracy", "resume=auto", f"hydra.run.dir={run}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"at step {best}, rebuilt by re-applying the logged steps" in r.stdout + r.stderr, r.stderr[-2000:]
    assert summary(run)["best_step"] == best and read_snapshot(run / "checkpoints" / "best")[1]["step"] == best
    assert [e["step"] for e in evals(run, "validation")] == [e["step"] for e in evals(best_runs["accuracy"],
                                                                                       "validation")]
    assert_same_weights(run, best_runs["accuracy"])
    with pytest.raises(ResumeError, match="it holds the weights alone"):  # nor does a run start from best/
        distzo.Trainer(distzo.compose(*RUN, "steps=20"), run_dir=tmp_path / "other",
                       resume_from=best_runs["accuracy"] / "checkpoints" / "best")


def test_a_best_before_the_newest_snapshot_is_rebuilt_from_an_earlier_one_or_refused(tmp_path, caplog):
    """The best's weights gone and the run continuing from a snapshot after the best step: the resume
    starts from the newest snapshot before it, re-applies the logged steps to the best step (best/),
    then on to where the run was, and ends as the uninterrupted run. Where trajectory.jsonl no longer
    holds those steps, or one of them was drawn by another generator (its record says so, or for
    records from before they named it, the snapshot to start from or one after it): one error naming
    the cause, before anything is cut or built. Nor does a resume_from that names a snapshot after the
    best step rebuild them (it is where to continue from)."""
    settings = [*RUN, "steps=20", "keep_best=accuracy", "checkpoint.every=2", "checkpoint.keep=100"]
    whole = tmp_path / "whole"
    distzo.train(distzo.compose(*settings), run_dir=whole)
    best = summary(whole)["best_step"]
    assert best % 2 and 2 < best < 16, best  # between snapshots, one before it and two after it up to step 18
    caplog.set_level("INFO", logger="distzo")
    before = best // 2 * 2  # the newest snapshot at or before the best step
    # Who drew a step's Gaussian directions (another session, on another GPU): its trajectory record
    # says; for records logged before they named it, the start's snapshot or one between the best step
    # and the snapshot the run continues from says.
    gpu = "cuda:gaussian-pairs:sm_90"
    other = {"start-generator": before, "generator": best + 1}
    refusals = {
        "gap": rf"trajectory.jsonl does not hold every step from {before + 1} to 18",
        "drawn_by": rf"step {best}'s Gaussian directions were drawn by {gpu}, this run draws by ",
        "start-generator": rf"its Gaussian directions were drawn by {gpu}, this run draws by .* \(step-{before:08d}\)",
        "generator": rf"its Gaussian directions were drawn by {gpu}, this run draws by .* \(snapshot "
                     rf"step-{best + 1:08d}\)",
        "resume_from": r"resume_from names the snapshot to continue from"}
    for name in ("rebuilt", *refusals):
        run = killed_copy(whole, tmp_path / name, 18)
        shutil.rmtree(run / "checkpoints" / "best")
        if name == "gap":  # the steps after that snapshot, up to the best, no longer logged
            kept = [r for r in read_jsonl(run / "trajectory.jsonl") if not before < r["step"] <= best]
            (run / "trajectory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
        if name == "drawn_by":  # the best step drawn on a GPU
            marked = [dict(r, drawn_by=gpu) if r["step"] == best else r for r in read_jsonl(run / "trajectory.jsonl")]
            (run / "trajectory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in marked))
        if name in other:  # records from before they named their generator, and a snapshot drawn on a GPU
            unnamed = [{k: v for k, v in r.items() if k != "drawn_by"} for r in read_jsonl(run / "trajectory.jsonl")]
            (run / "trajectory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in unnamed))
            state_file = run / "checkpoints" / f"step-{other[name]:08d}" / "state.json"
            state_file.write_text(json.dumps(dict(json.loads(state_file.read_text()), gaussian_generator=gpu)))
        logs = {n: (run / n).read_bytes() for n in ("metrics.jsonl", "trajectory.jsonl")}
        if name in refusals:
            how = dict(resume_from=run / "checkpoints" / "step-00000018") if name == "resume_from" else {}
            with pytest.raises(ResumeError, match=rf"at step {best}, has no weights left: there is no "
                               rf"checkpoints/best/.*; nor can re-applying the logged steps rebuild them: "
                               rf"{refusals[name]}.* Start the run"):
                distzo.Trainer(distzo.compose(*settings, "resume=never" if how else "resume=auto"), run_dir=run,
                               **how)
            assert {n: (run / n).read_bytes() for n in logs} == logs
            continue
        with distzo.Trainer(distzo.compose(*settings, "resume=auto"), run_dir=run) as trainer:
            assert trainer.start_step == 18
            assert (f"Resuming from {run / 'checkpoints' / f'step-{before:08d}'} (step {before} of 20)" in caplog.text
                    and f"Re-applying the {18 - before} step(s)" in caplog.text), caplog.text[-2000:]
            held = read_snapshot(run / "checkpoints" / "best")
            assert held[1]["step"] == best and not held[1].get("pending_update")
            assert all(torch.equal(held[0][k], v) for k, v in read_snapshot(whole / "checkpoints" / "best")[0].items())
            assert trainer.fit()["best_step"] == best
        assert_same_weights(run, whole)


def test_resuming_before_the_best_step_takes_the_best_so_far_from_the_runs_own_snapshot(tmp_path, best_runs):
    """Continuing from an earlier snapshot (`resume_from`, or an estimator whose logged steps cannot be
    re-applied) than the step best/ holds: the best up to there is an earlier evaluation, whose weights
    are the run's snapshot of that step, copied to best/; the steps after it run again and the result
    is the uninterrupted run's."""
    run = tmp_path / "run"
    cfg = distzo.compose(*RUN, "steps=20", "keep_best=accuracy", "checkpoint.every=1", "checkpoint.keep=100")
    distzo.train(cfg, run_dir=run)
    assert_same_weights(run, best_runs["accuracy"])
    best = summary(run)["best_step"]
    earlier = max(e["step"] for e in evals(run, "validation") if 0 < e["step"] < best)
    shutil.rmtree(run / "final")
    with distzo.Trainer(cfg, run_dir=run, resume_from=run / "checkpoints" / f"step-{earlier + 2:08d}") as trainer:
        assert trainer.best.best.step == earlier  # taken from the logs
        assert read_snapshot(run / "checkpoints" / "best")[1]["step"] == earlier  # and its weights copied
        assert trainer.fit()["best_step"] == best
    assert_same_weights(run, best_runs["accuracy"])


def test_when_the_last_evaluation_is_the_best_nothing_is_rebuilt_and_best_holds_it(tmp_path, best_runs):
    best = summary(best_runs["accuracy"])["best_step"]
    run = tmp_path / "run"
    r = torchrun(1, *RUN, f"steps={best}", "keep_best=accuracy", f"hydra.run.dir={run}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert summary(run)["best_step"] == best and "rebuilding the model" not in r.stdout + r.stderr
    assert read_snapshot(run / "checkpoints" / "best")[1]["step"] == best
    assert not (run / "checkpoints" / "best" / "optimizer.safetensors").exists()  # the weights alone
    [test] = evals(run, "test")
    assert "weights_step" not in test


def test_the_rebuild_releases_the_last_steps_model_and_the_trainer_refuses_to_go_on(tmp_path):
    """The last step's model holds no storage when the best's is built, even where a callback still
    refers to it (its parameters are on the meta device by then), and the engine around it is gone:
    the two are never held together. fit(), step() and snapshot() after it would mix the two steps:
    refused."""
    held, at_build = {}, []

    class Hold(distzo.Callback):
        def on_train_begin(self, trainer):
            held["model"] = trainer.model  # a strong reference, as a user's callback may keep
            held["engine"] = weakref.ref(trainer.components.engine)

    def build_watched(*args, **kwargs):
        at_build.append((all(p.device.type == "meta" for p in held["model"].parameters()), held["engine"]() is None))
        return build_components(*args, **kwargs)

    cfg = distzo.compose(*RUN, "steps=20", "keep_best=accuracy")
    with distzo.Trainer(cfg, run_dir=tmp_path / "run", callbacks=[Hold()]) as trainer:
        with mock.patch("distzo.run.training.build_components", build_watched):
            result = trainer.fit()
        assert result["best_step"] < 20 and at_build == [(True, True)] and trainer.model is not held["model"]
        for call, name in ((trainer.fit, "fit"), (trainer.step, "step"), (trainer.snapshot, "snapshot")):
            with pytest.raises(TrainingError, match=rf"{name}\(\) after fit\(\): with keep_best the trainer holds"):
                call()


def test_keep_best_needs_evaluations_a_metric_the_task_reports_and_a_configured_model(tmp_path):
    with pytest.raises(ConfigError, match="eval_every=0 runs none; set eval_every"):
        distzo.train(distzo.compose(*RUN, "eval_every=0", "keep_best=accuracy"), run_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match="reports no f1 .*use keep_best=accuracy or keep_best=loss"):
        distzo.train(distzo.compose(*RUN, "steps=2", "keep_best=f1"), run_dir=tmp_path / "b")
    with pytest.raises(ConfigError, match="keep_best.*bleu"):
        distzo.compose(*RUN, "keep_best=bleu")
    from transformers import LlamaConfig, LlamaForCausalLM  # any model object: not rebuilt from the config

    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=4))
    with pytest.raises(ConfigError, match="handed a model object"):
        distzo.Trainer(distzo.compose(*RUN, "keep_best=accuracy"), run_dir=tmp_path / "c", model=tiny)


def test_the_first_of_equal_figures_wins_and_neither_step_0_nor_a_non_finite_figure_is_a_candidate(tmp_path):
    from distzo.run.selection import BestValidation

    acc = BestValidation("accuracy", tmp_path)
    assert not acc.offer(0, {"accuracy": 0.9, "loss": 0.1, "examples": 8})  # the untrained model
    assert acc.offer(5, {"accuracy": 0.5, "loss": 0.7, "examples": 8}) and acc.best.step == 5
    assert not acc.offer(10, {"accuracy": 0.5, "loss": 0.6, "examples": 8}) and acc.best.step == 5
    assert not acc.offer(15, {"accuracy": None, "loss": 0.6, "examples": 0})  # an empty split
    assert acc.offer(20, {"accuracy": 0.75, "loss": 0.9, "examples": 8}) and acc.best.step == 20
    loss = BestValidation("loss", tmp_path)
    assert loss.offer(5, {"accuracy": 0.5, "loss": 0.7, "examples": 8})
    assert not loss.offer(10, {"accuracy": 0.9, "loss": float("nan"), "examples": 8})
    assert loss.offer(15, {"accuracy": 0.1, "loss": 0.6, "examples": 8}) and loss.best.step == 15
    off = BestValidation(None, tmp_path)
    assert not off.enabled and not off.offer(5, {"accuracy": 1.0, "loss": 0.0, "examples": 8}) and off.best is None


def test_lora_keeps_its_best_adapter(tmp_path):
    """peft=lora: the snapshot holds the adapter alone, and the base is rebuilt from the configuration."""
    lora = [*RUN, "peft=lora", "optim.lr=1e-2"]  # on this seed the accuracy peaks at step 10
    run, ref = tmp_path / "run", tmp_path / "ref"
    r = torchrun(1, *lora, "steps=20", "keep_best=accuracy", f"hydra.run.dir={run}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    best = summary(run)["best_step"]
    assert best < 20
    r = torchrun(1, *lora, f"steps={best}", f"hydra.run.dir={ref}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = (load_file(d / "final" / "adapter_model.safetensors") for d in (run, ref))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert summary(run)["test_accuracy"] == summary(ref)["test_accuracy"]
