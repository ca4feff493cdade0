"""transformers' Trainer and TRL's SFTTrainer with distzo's ZO steps (distzo.hf, docs/hf.md): a Trainer
script from transformers' documentation with `Trainer` swapped for `ZOTrainer` (examples/hf_trainer.py)
trains, evaluates, saves, calls its callback back and ends with the weights `distzo.train` gives on the
same data, order and seed; the same script on a 2x2 mesh equals its 1x1 run; ZOSFTTrainer trains a
LoRA adapter on prompt/completion pairs that PEFT loads back; a Trainer checkpoint resumes bitwise
after SIGKILL; load_best_model_at_end, save_strategy="best" and EarlyStoppingCallback end with the best
evaluation's weights (also resumed, on a LoRA adapter, on a 2x1 mesh); auto_find_batch_size shrinks the
micro-batch only; hyperparameter_search gives each trial its folder; a second train() starts over;
what cannot apply to a ZO step is refused in one line each."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.trainer_utils import get_last_checkpoint

from tests.distributed.launch import ForkedJob, run_forked, torchrun_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "hf_trainer.py"
SFT_SCRIPT = ROOT / "examples" / "trl_sft.py"
STEPS = 16


def example(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_tiny_llama(folder: Path) -> Path:
    """A tiny random Llama saved with the embedded default's tokenizer (what AutoModelForCausalLM and
    AutoTokenizer load in the script), in `folder`."""
    from distzo.models.loading import load_tokenizer, random_model

    tokenizer = load_tokenizer("smollm2")
    random_model("llama", len(tokenizer), {}, 0, torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def trained(model_folder, tmp_path_factory):
    """The script's run in this process, 1x1."""
    script = example(SCRIPT)
    out = tmp_path_factory.mktemp("hf-1x1")
    counter = script.CountEvents()
    trainer = script.build(str(model_folder), str(out), STEPS, None, callbacks=[counter])
    result = trainer.train()
    final_eval = trainer.evaluate()
    trainer.save_model(str(out / "final"))
    return trainer, result, final_eval, counter, out


def test_a_trainer_script_trains_evaluates_saves_and_calls_back(trained, model_folder):
    trainer, result, final_eval, counter, out = trained
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS // 2 and sum(losses[-2:]) < sum(losses[:2])  # logged every 2 steps; it falls
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 3 and evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # steps 8, 16, and the call after
    # prepared for evaluation before training (as Trainer's train() prepares it), not by the first evaluation
    assert not any("eval_model_preparation_time" in h for h in evals)
    assert "eval_token_accuracy" in final_eval  # compute_metrics ran on the Trainer's evaluation loop
    predicted = trainer.predict(trainer.eval_dataset)
    assert predicted.metrics["test_loss"] == pytest.approx(final_eval["eval_loss"], rel=1e-6)
    assert predicted.predictions.shape[0] == len(trainer.eval_dataset)
    assert counter.events == {"train_begin": 1, "step_end": STEPS, "log": STEPS // 2 + 3 + 1, "evaluate": 3,
                              "train_end": 1}
    assert result.global_step == STEPS and trainer.state.global_step == STEPS
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out / "final")
    mine = trainer.model.state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in saved.state_dict().items())
    start = AutoModelForCausalLM.from_pretrained(model_folder).state_dict()
    assert max(float((mine[k] - start[k]).abs().max()) for k in start) > 1e-3  # it trained


def test_the_weights_are_distzo_trains_on_the_same_data_order_and_seed(trained, model_folder, tmp_path):
    """distzo.train on the Trainer's datasets and collator (TrainerDataTask), the configuration the
    ZOTrainer composed and its learning rates: the same operations on the same shapes, so the
    weights agree bitwise (the Trainer's evaluations in between only read them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import distzo
    from distzo.hf.data import TrainerDataTask

    trainer = trained[0]
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    task = TrainerDataTask(trainer.train_dataset, trainer.eval_dataset, trainer.data_collator, tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(model_folder)
    distzo.train(trainer.zo_config(STEPS), tmp_path / "distzo", model=model, tokenizer=tokenizer, task=task,
                 validate_config=False, lr_at=trainer.zo_lr_at(STEPS))
    mine, theirs = trainer.model.state_dict(), model.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_each_steps_rate_is_the_one_transformers_scheduler_gives_in_any_order(trained, monkeypatch):
    """zo_lr_at advances the scheduler only as far as the steps asked for; asked in any order, and
    past the end, it gives each step the rate a torch optimizer under transformers' scheduler has
    (linear, with 3 warm-up steps)."""
    from transformers import get_scheduler

    args = trained[0].args
    monkeypatch.setattr(args, "lr_scheduler_type", "linear")
    monkeypatch.setattr(args, "warmup_steps", 3)
    holder = torch.nn.Parameter(torch.zeros(1))
    sgd = torch.optim.SGD([holder], lr=args.learning_rate)
    scheduler = get_scheduler(args.lr_scheduler_type, sgd, num_warmup_steps=args.get_warmup_steps(STEPS),
                              num_training_steps=STEPS)
    expected = []
    for _ in range(STEPS):
        expected.append(sgd.param_groups[0]["lr"])
        sgd.step()
        scheduler.step()
    lr_at = trained[0].zo_lr_at(STEPS)
    order = [5, 0, STEPS - 1, 3, STEPS + 7, 1] + list(range(STEPS))
    assert [lr_at(i) for i in order] == [expected[min(i, STEPS - 1)] for i in order]
    assert len(set(expected)) == STEPS  # up from 0 for 3 steps, then down: a new rate every step


def test_the_script_on_a_2x2_mesh_equals_its_1x1_run(trained, model_folder, tmp_path):
    """torchrun --nproc-per-node 4 examples/hf_trainer.py --mesh 2x2 --accumulation 2: the global
    batch per_device x accumulation x D is the 1x1 run's (4 x 4 x 1 = 4 x 2 x 2 = 16), its two data
    ranks each taking half (the P ranks of a shard see the same examples), in micro-batches of the
    same 4 examples as the 1x1 run's; only the float64 sums of the micro-batches' losses are added
    in another order, within tests/distributed/test_mesh.py's data-parallel bound, 1e-6.
    With --use-cpu, Trainer itself is distributed over the four processes: distzo's mesh builds its
    groups on accelerate's default group (and leaves it to accelerate at the end: the script's
    evaluate() after train() needs it), and Trainer's evaluation at step 8 finds the model prepared
    (its first one would have moved every parameter under the engine, model.to("cpu:0"), and the
    run would have trained one copy and evaluated another: 7e-2 off)."""
    out = tmp_path / "2x2"
    r = torchrun_script(4, SCRIPT, "--model", str(model_folder), "--output", str(out), "--steps", str(STEPS),
                        "--mesh", "2x2", "--accumulation", "2", "--use-cpu", cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = load_file(trained[4] / "final" / "model.safetensors")
    got = load_file(out / "final" / "model.safetensors")
    assert ref.keys() == got.keys()
    assert max(float((ref[k] - got[k]).abs().max()) for k in ref) < 1e-6


def test_a_checkpoint_resumes_bitwise_after_sigkill(trained, model_folder, tmp_path):
    """save_steps=4; the run is killed (SIGKILL) after its checkpoint at step 4 or 8, then
    `train(resume_from_checkpoint=True)` continues from the last one: the final weights are the
    uninterrupted run's, bitwise."""
    out = tmp_path / "killed"
    args = ["--script", str(SCRIPT), "--model", str(model_folder), "--output", str(out), "--steps", str(STEPS),
            "--save-steps", "4"]
    job = ForkedJob(1, args, cwd=tmp_path)  # `python examples/hf_trainer.py ...`, forked from the preloaded server
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "checkpoint-4").exists() and job.running():  # renamed into place
        time.sleep(0.05)  # when complete
    os.kill(job.ranks[0].pid, signal.SIGKILL)  # when it lands (a loaded machine may be a few steps later) does not
    assert job.wait(timeout=60).returncode == 128 + signal.SIGKILL  # matter: only complete checkpoints carry the
    assert not (out / "final").exists()  # name resume looks for; it did not finish
    last = get_last_checkpoint(str(out))
    assert last is not None and (Path(last) / "zo_state" / "weights.safetensors").exists()
    assert (Path(last) / "trainer_state.json").exists()
    r = run_forked(1, [*args, "--resume"], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = load_file(trained[4] / "final" / "model.safetensors")
    got = load_file(out / "final" / "model.safetensors")
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    # save_total_limit=2: the older checkpoints went, the newest two stay; a checkpoint the kill cut short
    # was written again by the resumed run, and no staging folder is left
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-16"]
    assert not list(out.glob("tmp-checkpoint-*"))


def test_train_again_in_the_same_output_dir_starts_over(model_folder, tmp_path):
    """A second train() (the same trainer, or a new one on the same output_dir, as a notebook or a
    script run twice does) starts distzo's logs in output_dir/zo/ over, as Trainer overwrites its
    checkpoints, and trains as the first did (the same seed, data and steps: the same loss)."""
    import json

    script, out = example(SCRIPT), tmp_path / "again"
    first = script.build(str(model_folder), str(out), 4, None)
    loss = first.train().training_loss
    again = first.train().training_loss
    assert again < loss  # the same trainer's model goes on from the weights its first train() left
    second = script.build(str(model_folder), str(out), 4, None)
    assert second.train().training_loss == loss  # a new trainer (the model as loaded) trains as the first did
    steps = [json.loads(line)["step"] for line in (out / "zo" / "trajectory.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # the last run's alone
    assert (out / "zo.previous" / "trajectory.jsonl").is_file()  # the one before it, set aside


def test_tokens_seen_memory_metrics_model_only_checkpoints_and_rotation(model_folder, tmp_path):
    """include_num_input_tokens_seen counts each step's tokens (the global batch's, as distzo logs
    them); skip_memory_metrics=False adds train()'s memory figures; save_only_model=True writes the
    model alone (no zo_state/), and resuming from it is refused naming the setting; an earlier run's
    checkpoints of higher steps in the same output_dir (older files) are the first save_total_limit
    removes, as Trainer orders them by time."""
    import json
    import os
    import time

    from distzo.hf import ZOTrainerError

    out = tmp_path / "books"
    for step in (18, 20):  # an earlier run's, an hour old
        (out / f"checkpoint-{step}").mkdir(parents=True)
        os.utime(out / f"checkpoint-{step}", (time.time() - 3600,) * 2)
    training = dict(include_num_input_tokens_seen="non_padding", skip_memory_metrics=False, save_only_model=True)
    trainer = example(SCRIPT).build(str(model_folder), str(out), 8, None, save_steps=4, training=training)
    result = trainer.train()
    lines = [json.loads(line) for line in (out / "zo" / "metrics.jsonl").read_text().splitlines()]
    tokens = [line["tokens"] for line in lines if line.get("type") == "train"]
    assert len(tokens) == 8 and trainer.state.num_input_tokens_seen == sum(tokens)
    assert "train_mem_cpu_alloc_delta" in result.metrics and not trainer.is_in_train
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]  # save_total_limit=2
    assert (out / "checkpoint-8" / "model.safetensors").is_file() and not (out / "checkpoint-8" / "zo_state").exists()
    again = example(SCRIPT).build(str(model_folder), str(out), 8, None, save_steps=4)
    with pytest.raises(ZOTrainerError, match="has no zo_state/ .* save_only_model=True"):
        again.train(resume_from_checkpoint=str(out / "checkpoint-8"))


def test_a_second_train_trains_distzos_own_adapter_on(model_folder, tmp_path):
    """ZOArguments(peft='lora') on a plain model: distzo attaches its LoRA at the first train(); a
    second train() on the same model trains that adapter on (one hook a layer, B not reset to zero),
    as a full model trains on from its weights; another adapter on it is refused in one line."""
    from distzo.errors import DistzoError

    trainer = example(SCRIPT).build(str(model_folder), str(tmp_path / "lora"), 4, None, peft="lora")
    first = trainer.train().training_loss
    q_proj = trainer.model.model.layers[0].self_attn.q_proj
    assert float(q_proj.lora_B.abs().max()) > 0
    again = trainer.train().training_loss
    assert len(q_proj._forward_hooks) == 1 and again < first  # from where the first left it, not from B = 0
    trainer.zo_args.overrides = ["peft.r=4"]
    with pytest.raises(DistzoError, match=r"carries distzo's lora r=8 alpha=16 targets=\[q_proj, v_proj\] adapter .* "
                                          r"asks for lora r=4 alpha=16"):
        trainer.train()
    trainer.zo_args.overrides, trainer.zo_args.peft = [], "lora_fa"
    with pytest.raises(DistzoError, match=r"asks for lora_fa r=8"):
        trainer.train()
    # a target that selects nothing on this model is no difference (attach_lora skips it as well)
    trainer.zo_args.peft, trainer.zo_args.overrides = "lora", ["peft.targets=[v_proj,q_proj,c_attn]"]
    assert trainer.train().training_loss < again
    trainer.zo_args.overrides, trainer.zo_args.peft = [], "none"
    with pytest.raises(DistzoError, match="peft=none would train the frozen model under it"):
        trainer.train()
    assert (tmp_path / "lora" / "zo.previous" / "metrics.jsonl").is_file()  # the refused train()s lost no logs


def test_hyperparameter_search_gives_each_trial_its_folder_and_reports_its_evaluations(model_folder, tmp_path):
    """Trainer.hyperparameter_search (optuna) over the learning rate: each trial trains a fresh
    model_init model in output_dir/run-<n>/ (its checkpoints and distzo's zo/), reports every
    evaluation to optuna (what its pruners read), and its objective is its last evaluation's."""
    import json

    import optuna
    from transformers import AutoModelForCausalLM

    class Recorder(optuna.pruners.BasePruner):
        """Prunes nothing; records what each trial reported when asked."""

        def __init__(self):
            self.reports = {}

        def prune(self, study, trial):
            self.reports[trial.number] = dict(trial.intermediate_values)
            return False

    out, recorder = tmp_path / "search", Recorder()
    trainer = example(SCRIPT).build(str(model_folder), str(out), 8, None, save_steps=4,
                                    training=dict(eval_steps=4, save_total_limit=None))
    trainer.model_init = lambda trial=None: AutoModelForCausalLM.from_pretrained(model_folder)
    best = trainer.hyperparameter_search(
        hp_space=lambda trial: {"learning_rate": trial.suggest_categorical("learning_rate", [1e-3, 1e-4])},
        compute_objective=lambda metrics: metrics["eval_loss"], n_trials=2, direction="minimize", backend="optuna",
        pruner=recorder, sampler=optuna.samplers.TPESampler(seed=0))
    objectives = {}
    for n in (0, 1):
        run = out / f"run-{n}"
        assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
        assert (run / "zo" / "metrics.jsonl").is_file()
        history = json.loads((run / "checkpoint-8" / "trainer_state.json").read_text())["log_history"]
        losses = {h["step"]: h["eval_loss"] for h in history if "eval_loss" in h}
        assert recorder.reports[n] == losses  # every evaluation reported at its step
        objectives[n] = losses[8]
    assert not list(out.glob("checkpoint-*"))  # none in output_dir itself
    assert best.objective == min(objectives.values()) and best.run_id == str(min(objectives, key=objectives.get))
    from distzo.hf import ZOTrainerError

    with pytest.raises(ZOTrainerError, match=r"hyperparameter_search\(backend='ray'\) is not supported by ZOTrainer"):
        trainer.hyperparameter_search(n_trials=1, backend="ray")  # refused before a trial starts (no ray here)


def run_out_of_memory(*args, **kwargs):
    """What the CUDA caching allocator raises when an allocation does not fit (simulated, on any device)."""
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


def oom_above(trainer, micro: int, after_forwards: int = 0) -> list[int]:
    """A forward hook on a decoder layer raising the CUDA allocator's out-of-memory error while the
    run's micro-batch is above `micro` examples, once `after_forwards` forwards have run; returns
    the micro-batch of each forward (rows do not tell: distzo packs a micro-batch's prompts)."""
    seen = []

    def hook(module, inputs, output):
        seen.append(trainer.zo.cfg.micro_batch_size)
        if len(seen) > after_forwards and seen[-1] > micro:
            run_out_of_memory()

    trainer.model.model.layers[0].register_forward_hook(hook)
    return seen


def test_auto_find_batch_size_halves_the_micro_batch_not_the_step(trained, model_folder, tmp_path):
    """auto_find_batch_size: an out-of-memory error in a forward of micro-batches above 2 examples makes
    Trainer call the loop again with a smaller batch until one fits; distzo shrinks the micro-batch
    only, so the run is the 1x1 run's, its 16 examples a step now in micro-batches of 2. Pieces of
    another size round the float32 losses differently, hence tests/e2e/test_micro_batches.py's bound:
    1e-4 of how far training moved the weights."""
    out = tmp_path / "auto"
    trainer = example(SCRIPT).build(str(model_folder), str(out), STEPS, None,
                                    training=dict(auto_find_batch_size=True))
    seen = oom_above(trainer, 2)
    trainer.train()
    assert seen[0] == 4 and seen[-1] == 2  # accelerate tries smaller batches (x0.9, rounded down) until one fits
    want = load_file(trained[4] / "final" / "model.safetensors")
    start = load_file(model_folder / "model.safetensors")
    got = trainer.model.state_dict()
    moved = max(float((want[k] - start[k]).abs().max()) for k in want)
    diff = max(float((want[k] - got[k]).abs().max()) for k in want)
    assert moved > 1e-3 and diff < 1e-4 * moved, (diff, moved)


def test_auto_find_batch_size_does_not_retry_after_an_update(trained, model_folder, tmp_path):
    """An out-of-memory error after the first steps changed the weights, or in any evaluation or while
    writing a checkpoint (a smaller training micro-batch shrinks neither): one error saying what to
    set, not a retry, naming the newest complete checkpoint to resume from. The
    settings it names keep a step's batch, so the resume they lead to is accepted and ends with the
    1x1 run's weights (within tests/e2e/test_micro_batches.py's bound, the micro-batches being
    smaller)."""
    from distzo.hf import ZOTrainerError

    out = tmp_path / "late"
    trainer = example(SCRIPT).build(str(model_folder), str(out), STEPS, None, save_steps=2,
                                    training=dict(auto_find_batch_size=True))
    oom_above(trainer, 2, after_forwards=40)  # 4 probes x 4 micro-batches a step: during step 3
    with pytest.raises(ZOTrainerError, match=r"step 3 ran out of memory with micro-batches of 4 examples after 2 "
                                             r"step\(s\) .* per_device_train_batch_size=2 and "
                                             r"gradient_accumulation_steps=8 \(the same 16 examples"):
        trainer.train()
    resumed = example(SCRIPT).build(str(model_folder), str(out), STEPS, None, save_steps=2, per_device=2,
                                    accumulation=8)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    want, start = load_file(trained[4] / "final" / "model.safetensors"), load_file(model_folder / "model.safetensors")
    got = resumed.model.state_dict()
    moved = max(float((want[k] - start[k]).abs().max()) for k in want)
    assert max(float((want[k] - got[k]).abs().max()) for k in want) < 1e-4 * moved
    evaluating = example(SCRIPT).build(str(model_folder), str(tmp_path / "eval"), STEPS, None,
                                       training=dict(auto_find_batch_size=True, eval_on_start=True))
    evaluating.compute_metrics = run_out_of_memory
    with pytest.raises(ZOTrainerError, match=r"the evaluation after step 0 ran out of memory; .* "
                                             r"per_device_eval_batch_size=4"):
        evaluating.train()  # eval_on_start: before any update, and still not retried
    saving = example(SCRIPT).build(str(model_folder), str(tmp_path / "save"), STEPS, None, save_steps=1,
                                   training=dict(auto_find_batch_size=True))
    save_model, saves = saving.save_model, []

    def save_then_run_out(*a, **kw):  # the second checkpoint's model file: out of memory
        saves.append(a)
        if len(saves) == 2:
            run_out_of_memory()
        return save_model(*a, **kw)

    saving.save_model = save_then_run_out
    with pytest.raises(ZOTrainerError, match=r"writing the checkpoint of step 2 ran out of memory .* then resume "
                                             rf"from {re.escape(str(tmp_path / 'save' / 'checkpoint-1'))}$"):
        saving.train()
    assert not (tmp_path / "save" / "checkpoint-2").exists()
    resuming = example(SCRIPT).build(str(model_folder), str(tmp_path / "save"), STEPS, None, save_steps=1,
                                     training=dict(auto_find_batch_size=True))
    resuming.save_model = run_out_of_memory
    with pytest.raises(ZOTrainerError, match=r"writing the checkpoint of step 2 ran out of memory .* then resume "
                                             rf"from {re.escape(str(tmp_path / 'save' / 'checkpoint-1'))}$"):
        resuming.train(resume_from_checkpoint=str(tmp_path / "save" / "checkpoint-1"))  # the one it continues


def test_zosfttrainer_trains_a_lora_adapter_that_peft_loads_back(model_folder, tmp_path):
    """TRL's SFTTrainer on prompt/completion pairs with a LoRA peft_config, its steps ZO: the
    completion loss falls; the saved adapter loads with PeftModel.from_pretrained and gives the
    trained model's logits."""
    script = example(SFT_SCRIPT)
    trainer = script.build(str(model_folder), str(tmp_path / "sft"), 16)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert sum(losses[-2:]) < sum(losses[:2])
    trainer.save_model(str(tmp_path / "sft" / "adapter"))
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_folder), tmp_path / "sft" / "adapter")
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert torch.allclose(want, got, atol=1e-5, rtol=1e-5)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # exactly the adapter trained


@pytest.mark.parametrize("args,later,message", [
    ({"torch_compile": True}, {}, "torch_compile compiles the stock forward"),
    ({"fsdp": "full_shard"}, {}, "fsdp shards the model for first-order training"),
    # TrainingArguments itself refuses these without deepspeed / a GPU installed: set as it leaves them
    ({}, {"deepspeed": "ds_config.json"}, "deepspeed shards gradients and optimizer states"),
    ({}, {"fp16": True}, "fp16 mixed precision scales gradients"),
    ({"save_on_each_node": True}, {}, "save_on_each_node writes each node's checkpoints on its own"),
    ({"neftune_noise_alpha": 5.0}, {}, "neftune_noise_alpha adds fresh random noise to the embeddings"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps"}, {},
     "lr_scheduler_type='reduce_lr_on_plateau' sets the learning rate from the metrics"),
    ({"lr_scheduler_type": "greedy", "eval_strategy": "steps"}, {}, "lr_scheduler_type='greedy' sets the learning"),
    ({"label_smoothing_factor": 0.1}, {}, "evaluation would score the label-smoothed loss"),
    ({"train_sampling_strategy": "group_by_length"}, {}, "train_sampling_strategy='group_by_length': distzo's"),
    ({"data_seed": 5, "seed": 0}, {}, r"data_seed=5: distzo draws .* set seed=5"),
])
def test_what_cannot_apply_is_refused_in_one_line(model_folder, tmp_path, args, later, message):
    from transformers import AutoModelForCausalLM, TrainingArguments

    from distzo.hf import ZOTrainer, ZOTrainerError

    model = AutoModelForCausalLM.from_pretrained(model_folder)
    training_args = TrainingArguments(output_dir=str(tmp_path), report_to=[], **args)
    for key, value in later.items():
        setattr(training_args, key, value)
    with pytest.raises(ZOTrainerError, match=message):
        ZOTrainer(model=model, args=training_args, train_dataset=[])
    with pytest.raises(ZOTrainerError, match="evaluation would score your compute_loss_func"):
        ZOTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to=[]), train_dataset=[],
                  compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss)
    with pytest.raises(ZOTrainerError, match="a torch optimizer or scheduler cannot apply to a ZO step"):
        ZOTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to=[]), train_dataset=[],
                  optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))


def test_sft_settings_that_change_the_rows_or_the_loss_are_refused_in_one_line(model_folder, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig

    from distzo.hf import ZOSFTTrainer, ZOTrainerError

    for setting, message in [({"packing": True}, r"packing=True.*set packing=False"),
                             ({"padding_free": True}, r"padding_free=True.*set padding_free=False"),
                             ({"loss_type": "dft"}, r"would score loss_type='dft'.*loss_type='nll'")]:
        with pytest.raises(ZOTrainerError, match=message):
            ZOSFTTrainer(model=AutoModelForCausalLM.from_pretrained(model_folder),
                         args=SFTConfig(output_dir=str(tmp_path), bf16=False, report_to=[], **setting),
                         train_dataset=Dataset.from_dict(FORMATS["text"]),
                         processing_class=AutoTokenizer.from_pretrained(model_folder))


FORMATS = {
    "text": {"text": ["The capital of France is Paris.", "The capital of Peru is Lima, by the coast."]},
    "prompt/completion": {"prompt": ["The capital of France is", "The capital of Peru is"],
                          "completion": [" Paris.", " Lima, by the coast."]},
    "messages": {"messages": [[{"role": "user", "content": "Capital of France?"},
                               {"role": "assistant", "content": "Paris."}],
                              [{"role": "user", "content": "Capital of Peru?"},
                               {"role": "assistant", "content": "Lima, by the coast."}]]},
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_zo_steps_read_the_loss_trl_computes_for_each_dataset_format(model_folder, tmp_path, fmt):
    """TRL prepares each of its formats (text; prompt/completion with the completion-only loss;
    messages through the chat template); the loss distzo's engine evaluates on the prepared data
    equals the loss TRL's Trainer evaluates on the same data in one batch (transformers' shifted,
    -100-masked token mean). Only the order of float32 sums differs (distzo scores the real tokens,
    transformers the padded batch) over a few dozen tokens: a relative 1e-5."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig

    import distzo
    from distzo.hf import ZOSFTTrainer
    from distzo.hf.data import TrainerDataTask

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    model = AutoModelForCausalLM.from_pretrained(model_folder)
    data = Dataset.from_dict(FORMATS[fmt])
    args = SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=1, per_device_eval_batch_size=2, report_to=[],
                     completion_only_loss=fmt == "prompt/completion" or None, max_length=48, bf16=False)
    trainer = ZOSFTTrainer(model=model, args=args, train_dataset=data, eval_dataset=data, processing_class=tokenizer)
    theirs = trainer.evaluate()["eval_loss"]
    task = TrainerDataTask(trainer.train_dataset, trainer.eval_dataset, trainer.data_collator, tokenizer.pad_token_id)
    with distzo.Trainer(trainer.zo_config(1), tmp_path / "zo", model=model, tokenizer=tokenizer, task=task,
                        validate_config=False) as zo:
        mine = zo.evaluate()["loss"]
    assert mine == pytest.approx(theirs, rel=1e-5)
    if fmt == "prompt/completion":  # the prompt is not scored
        labels = trainer.data_collator([trainer.train_dataset[0]])["labels"][0]
        assert (labels == -100).sum() >= len(tokenizer("The capital of France is")["input_ids"])


def test_zosfttrainer_logs_the_tokens_trained_on_as_trl_does(model_folder, tmp_path):
    """TRL's SFTTrainer logs `num_tokens`: the tokens of the batches trained on this session, summed
    over the processes (the collated attention masks), as a float. A batch of the whole dataset each
    step: after k steps, k times the dataset's tokens. Trainer's total_flos counts the forward passes."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig

    from distzo.hf import ZOSFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    args = SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=3, per_device_train_batch_size=2, logging_steps=1,
                     save_strategy="no", report_to=[], max_length=48, bf16=False)
    trainer = ZOSFTTrainer(model=AutoModelForCausalLM.from_pretrained(model_folder), args=args,
                           train_dataset=Dataset.from_dict(FORMATS["text"]), processing_class=tokenizer)
    per_step = int(trainer.data_collator([trainer.train_dataset[i] for i in range(2)])["attention_mask"].sum())
    result = trainer.train()
    logged = [e["num_tokens"] for e in trainer.state.log_history if "loss" in e]
    assert logged == [float(per_step * k) for k in (1, 2, 3)] and per_step > 10
    # Trainer's total_flos, for what ZO runs: MeZO's two forward passes a step, 2 x N FLOPs a token each
    n = trainer.model.num_parameters(exclude_embeddings=True)
    assert result.metrics["total_flos"] == trainer.state.total_flos == 3 * per_step * 2 * (2 * n)


def _registered_estimators() -> list[str]:
    from distzo.registry import registry

    return registry("estimator").names()


@pytest.mark.parametrize("estimator", _registered_estimators())
def test_every_registered_estimator_trains_under_zotrainer_with_its_own_defaults(model_folder, tmp_path, estimator):
    """ZOArguments(estimator=name) alone: the estimator's own defaults from the registry (AGZO's eps
    1e-4 and forward difference, not MeZO's), and the trainable set it runs on when it has one (P-RGE:
    LoRA-FA). The loop trains: finite losses, and the trainable weights move."""
    from distzo.config.compose import typed
    from distzo.registry import registry

    script = example(SCRIPT)
    trainer = script.build(str(model_folder), str(tmp_path / "out"), 3, None, estimator=estimator, lr=1e-2)
    cfg = typed(trainer.zo_config(3))
    settings = registry("estimator").settings(estimator)(name=estimator)
    assert type(cfg.estimator) is type(settings) and cfg.estimator.eps == settings.eps
    assert cfg.estimator.difference == settings.difference and cfg.estimator.q == 2  # q: the script's own
    only = registry("estimator").get(estimator).peft_methods
    assert str(cfg.peft.method) == (only[0] if only else "none")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.train()
    assert math.isfinite(result.training_loss)
    # distzo's own trainable set (P-RGE's LoRA-FA) is added when training starts, its B at zero
    moved = [n for n, p in trainer.model.named_parameters()
             if (not torch.equal(p.detach(), before[n]) if n in before else bool(p.detach().abs().sum() > 0))]
    assert moved


def test_zoarguments_refuses_a_setting_of_another_estimator(model_folder, tmp_path):
    from distzo.errors import ConfigError

    trainer = example(SCRIPT).build(str(model_folder), str(tmp_path / "out"), 2, None, power_iters=2)
    with pytest.raises(ConfigError, match=r"ZOArguments\(power_iters=...\) is a setting of estimator=agzo, not of "
                                          r"estimator=mezo"):
        trainer.zo_config(2)


def test_zosfttrainer_says_what_it_trains_and_where(model_folder, tmp_path, caplog):
    """With a peft_config TRL wraps the model; the log names the adapter's parameters as what trains
    (not every weight) and the run directory the files go to (output_dir/zo, absolute)."""
    import logging

    trainer = example(SFT_SCRIPT).build(str(model_folder), str(tmp_path / "sft"), 2)
    with caplog.at_level(logging.INFO, logger="distzo"):
        trainer.train()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Training "))
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert line.startswith(f"Training {trainable:,} of ") and "(those the model marks trainable; peft=none)" in line
    assert line.endswith(f"run dir {(tmp_path / 'sft' / 'zo').resolve()}")


def test_evaluating_a_model_split_across_devices_outside_training_is_refused(model_folder, tmp_path):
    """After train() with offload='cpu' on a GPU the blocks stay in host memory while the rest is on
    the device; Trainer's evaluation would fail inside the stock forward with a device mismatch.
    Refused in one line instead (simulated here with one layer on the meta device)."""
    from distzo.hf.trainer import ZOTrainerError

    trainer = example(SCRIPT).build(str(model_folder), str(tmp_path / "split"), 2, None)
    trainer.model.model.layers[0].to("meta")
    with pytest.raises(ZOTrainerError, match=r"on several devices \(cpu, meta\): after train\(\) with "
                                             r"offload='cpu' its blocks stay in host memory"):
        trainer.evaluate()
