"""transformers' best-checkpoint features under ZOTrainer (docs/hf.md, "The best checkpoint"):
load_best_model_at_end, metric_for_best_model, save_strategy="best" and EarlyStoppingCallback end with
the best evaluation's weights, bitwise those of its checkpoint, as Trainer chooses it (a scripted
metric whose best falls mid-run); the best travels through a resume; on a 2x1 mesh every rank loads
it and rank 0 alone writes; on a PEFT model the adapter is loaded; a best checkpoint that is gone is
refused. The script is tests/e2e/test_hf.py's (examples/hf_trainer.py, examples/trl_sft.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from tests.distributed.launch import torchrun_script
from tests.e2e.test_hf import SCRIPT, SFT_SCRIPT, STEPS, example, save_tiny_llama


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


# An evaluation's "scripted" figure by the step it scores (compute_metrics' figures are whatever it
# returns): the best, the highest (greater_is_better is Trainer's default for a metric other than
# loss), falls mid-run at step 8, the first of two equal figures; step 0 (eval_on_start) is no candidate.
SCRIPTED = {0: 0.9, 4: 0.1, 8: 0.5, 12: 0.3, 16: 0.5}
BEST = dict(eval_steps=4, load_best_model_at_end=True, metric_for_best_model="scripted")


def scripted(trainer, figures=SCRIPTED):
    """The trainer with compute_metrics reporting figures[global step] as eval_scripted."""
    trainer.compute_metrics = lambda eval_pred: {"scripted": figures[trainer.state.global_step]}
    return trainer


class StopAt(TrainerCallback):
    """Ends training after `step` (control.should_training_stop), as a user's early-stopping callback does."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


def evaluations(trainer, key: str = "eval_loss") -> dict[int, float]:
    return {h["step"]: h[key] for h in trainer.state.log_history if key in h}


@pytest.fixture(scope="module")
def best_run(model_folder, tmp_path_factory):
    """load_best_model_at_end, evaluating and saving every 4 steps, every checkpoint kept."""
    out = tmp_path_factory.mktemp("hf-best")
    trainer = scripted(example(SCRIPT).build(str(model_folder), str(out), STEPS, None, save_steps=4,
                                             training={**BEST, "save_total_limit": None}))
    trainer.train()
    return trainer, out


def test_load_best_model_at_end_ends_with_the_best_checkpoints_weights(best_run):
    """Trainer's rule picks step 8; after train() the model holds checkpoint-8's weights bitwise, not
    the last step's (checkpoint-16's); evaluate() then repeats step 8's loss (the same weights,
    operations and shapes). (save_total_limit=1 leaving the best alone: the 2x1 and epoch tests.)"""
    trainer, out = best_run
    assert evaluations(trainer, "eval_scripted") == {s: SCRIPTED[s] for s in (4, 8, 12, 16)}
    assert trainer.state.best_global_step == 8 and trainer.state.best_metric == 0.5
    best = out / "checkpoint-8"
    assert trainer.state.best_model_checkpoint == str(best)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in (12, 16, 4, 8)]
    assert not list(out.glob("tmp-*"))
    saved, mine = load_file(best / "model.safetensors"), trainer.model.state_dict()
    assert all(torch.equal(saved[k], mine[k]) for k in saved)
    last = load_file(out / "checkpoint-16" / "model.safetensors")  # the last step's
    assert any(not torch.equal(last[k], mine[k]) for k in last)
    assert trainer.evaluate()["eval_loss"] == evaluations(trainer)[8]


def test_load_best_model_at_end_carries_the_best_across_a_resume(best_run, model_folder, tmp_path):
    """Stopped after step 12 (every checkpoint kept), then resumed from checkpoint-12: the best so far
    (step 8) and, with restore_callback_states_from_checkpoint, EarlyStoppingCallback's patience
    counter come from its trainer_state.json, and the
    run ends with the uninterrupted run's best weights (a resumed run that forgot step 8 would take
    step 16's equal figure)."""
    from transformers import EarlyStoppingCallback

    script, out = example(SCRIPT), tmp_path / "resumed"
    first = scripted(script.build(str(model_folder), str(out), STEPS, None, save_steps=4,
                                  callbacks=[StopAt(12), EarlyStoppingCallback(early_stopping_patience=3)],
                                  training={**BEST, "save_total_limit": None}))
    first.train()
    assert first.state.global_step == 12
    second = scripted(script.build(str(model_folder), str(out), STEPS, None, save_steps=4,
                                   callbacks=[EarlyStoppingCallback(early_stopping_patience=3)],
                                   training={**BEST, "save_total_limit": None,
                                             "restore_callback_states_from_checkpoint": True}))
    second.train(resume_from_checkpoint=str(out / "checkpoint-12"))
    reference, _ = best_run
    assert second.state.best_global_step == 8 and second.state.best_model_checkpoint == str(out / "checkpoint-8")
    want, got = reference.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    stopper = next(c for c in second.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback))
    assert stopper.early_stopping_patience_counter == 2  # step 12's miss, restored, and step 16's


def test_load_best_model_at_end_on_a_2x1_mesh(model_folder, tmp_path):
    """torchrun --nproc-per-node 2 examples/hf_trainer.py --mesh 2x1 --load-best loss
    --greater-is-better (the highest loss: an early evaluation): both ranks pick the same best, read
    its checkpoint once rank 0 has renamed it into place, and the result is that checkpoint's weights;
    rank 0 alone writes the checkpoints and prints the script's summary."""
    import json

    out = tmp_path / "2x1"
    r = torchrun_script(2, SCRIPT, "--model", str(model_folder), "--output", str(out), "--steps", str(STEPS),
                        "--mesh", "2x1", "--save-steps", "4", "--load-best", "loss", "--greater-is-better",
                        cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("'events'") == 1  # the script's summary (is_world_process_zero)
    assert all(r.stdout.count(f"Checkpoint at step {s} complete") == 1 for s in (4, 8, 12, 16))
    [best] = list(out.glob("checkpoint-*"))  # save_total_limit=1: the best alone
    history = json.loads((best / "trainer_state.json").read_text())["log_history"]
    losses = {h["step"]: h["eval_loss"] for h in history if "eval_loss" in h}
    assert best.name == f"checkpoint-{max(losses, key=losses.get)}"
    got, want = load_file(out / "final" / "model.safetensors"), load_file(best / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in got)


def test_early_stopping_callback_stops_and_ends_with_the_best(best_run, model_folder, tmp_path):
    """transformers' EarlyStoppingCallback (which needs load_best_model_at_end) with patience 1: step
    12's evaluation does not beat step 8's, so training stops there and ends with step 8's weights,
    those of the uninterrupted run's best."""
    from transformers import EarlyStoppingCallback

    out = tmp_path / "early"
    trainer = scripted(example(SCRIPT).build(str(model_folder), str(out), STEPS, None, save_steps=4,
                                             callbacks=[EarlyStoppingCallback(early_stopping_patience=1)],
                                             training={**BEST, "save_total_limit": None}))
    trainer.train()
    assert trainer.state.global_step == 12 and trainer.state.best_global_step == 8
    want, got = best_run[0].model.state_dict(), trainer.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_save_strategy_best_saves_each_new_best_only(model_folder, tmp_path):
    """save_strategy='best': a checkpoint at each evaluation that beats every earlier one (steps 4 and
    8), and no other (Trainer sets should_save from its best-metric rule; the step and epoch
    callbacks ask for none). eval_on_start's evaluation (step 0) is no candidate."""
    out = tmp_path / "best-only"
    trainer = scripted(example(SCRIPT).build(
        str(model_folder), str(out), STEPS, None,
        training=dict(eval_steps=4, save_strategy="best", metric_for_best_model="scripted", save_total_limit=None,
                      eval_on_start=True)))
    trainer.train()
    assert evaluations(trainer, "eval_scripted") == SCRIPTED
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-8")


def test_the_best_is_recorded_when_its_checkpoint_came_before_its_evaluation(model_folder, tmp_path):
    """Evaluations at each epoch's end (every 5 steps: 80 examples, 16 a step), checkpoints every 5
    steps, saved before the epoch's evaluation: the best (step 5) is recorded at the next checkpoint,
    whose writer finds checkpoint-5 there (Trainer's rule), and save_total_limit=1 leaves it alone at
    the end, with or without load_best_model_at_end."""
    out = tmp_path / "epochs"
    trainer = scripted(example(SCRIPT).build(
        str(model_folder), str(out), STEPS, None,
        training=dict(eval_strategy="epoch", save_strategy="steps", save_steps=5, metric_for_best_model="scripted",
                      save_total_limit=1)), figures={5: 0.9, 10: 0.1, 15: 0.2, 16: 0.3})
    trainer.train()
    assert list(evaluations(trainer, "eval_scripted")) == [5, 10, 15, 16]
    assert trainer.state.best_global_step == 5 and trainer.state.best_model_checkpoint == str(out / "checkpoint-5")
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-5"]


def test_a_missing_best_checkpoint_is_refused_on_resume(model_folder, tmp_path):
    """The best evaluation's checkpoint deleted before resuming: one error naming it and the fix
    (Trainer only warns, then ends with the last step's weights as if they were the best)."""
    import shutil

    from distzo.hf import ZOTrainerError

    script, out = example(SCRIPT), tmp_path / "gone"
    first = scripted(script.build(str(model_folder), str(out), STEPS, None, save_steps=4, callbacks=[StopAt(12)],
                                  training={**BEST, "save_total_limit": None}))
    first.train()
    assert first.state.best_model_checkpoint == str(out / "checkpoint-8")
    shutil.rmtree(out / "checkpoint-8")
    second = scripted(script.build(str(model_folder), str(out), STEPS, None, save_steps=4,
                                   training={**BEST, "save_total_limit": None}))
    with pytest.raises(ZOTrainerError, match="best evaluation's checkpoint .*checkpoint-8 .* is gone or incomplete"):
        second.train(resume_from_checkpoint=str(out / "checkpoint-12"))


def test_load_best_model_at_end_loads_the_best_peft_adapter(model_folder, tmp_path):
    """ZOSFTTrainer with a LoRA peft_config: the adapter of the best evaluation's checkpoint (step 8)
    is loaded back into the PEFT model (Trainer's load_adapter path), bitwise its saved tensors."""
    from peft import get_peft_model_state_dict

    script, out = example(SFT_SCRIPT), tmp_path / "sft-best"
    trainer = scripted(script.build(str(model_folder), str(out), 16, eval_dataset=script.pairs(),
                                    training=dict(eval_strategy="steps", save_strategy="steps", save_steps=4, **BEST)))
    trainer.train()
    assert trainer.state.best_global_step == 8
    saved = load_file(out / "checkpoint-8" / "adapter_model.safetensors")
    mine = get_peft_model_state_dict(trainer.model)
    assert saved.keys() == mine.keys() and all(torch.equal(saved[k], mine[k].cpu()) for k in saved)
    last = load_file(out / "checkpoint-16" / "adapter_model.safetensors")
    assert any(not torch.equal(last[k], mine[k].cpu()) for k in last)
