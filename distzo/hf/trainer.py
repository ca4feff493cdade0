"""transformers' Trainer and TRL's SFTTrainer, with their training loop run by distzo's engine.

`ZOTrainer` is a `transformers.Trainer`: constructed, configured (`TrainingArguments`), evaluated
(`evaluate`, `predict`, `compute_metrics`), saved (`save_model`) and called back (`TrainerCallback`)
as a Trainer is. Only its inner training loop differs: each optimizer step is a ZO step of distzo's
engine (distzo.Trainer.step: the estimator's forward probes, the loss exchange over the mesh, the
optimizer's rule), with the same estimators, optimizers, offloading and P x D mesh as `distzo train`,
on the Trainer's own datasets and collator (`distzo.hf.data.TrainerDataTask`). `ZOSFTTrainer` is
the same loop on TRL's `SFTTrainer`, which prepares TRL's dataset formats (text, prompt/completion,
messages) and its completion-only labels. docs/hf.md maps every argument.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..errors import DistzoError
from ..registry import registry
from ..state.resume import ResumeError
from .arguments import ZOArguments, setting_overrides
from .data import TrainerDataTask

log = logging.getLogger("distzo")

ZO_STATE = "zo_state"  # a Trainer checkpoint's folder holding distzo's snapshot of that step
ZO_RUN = "zo"  # distzo's own run files (metrics.jsonl, trajectory.jsonl, run.json) under output_dir


class ZOTrainerError(DistzoError):
    """A Trainer setting that a ZO loop cannot honour; the message says which and what to do."""


def _refuse_what_cannot_apply(args: Any, optimizers: Any, optimizer_cls_and_kwargs: Any,
                              compute_loss_func: Any = None) -> None:
    """One line for each Trainer feature a ZO loop cannot honour (rather than ignoring it)."""
    if getattr(args, "deepspeed", None):
        raise ZOTrainerError("deepspeed shards gradients and optimizer states, and a ZO step has neither; drop "
                             "TrainingArguments(deepspeed=...) (distzo's offload='cpu' keeps the weights in host "
                             "memory instead)")
    if getattr(args, "fsdp", None) or getattr(args, "fsdp_config", None) and args.fsdp_config.get("fsdp_version"):
        raise ZOTrainerError("fsdp shards the model for first-order training; drop TrainingArguments(fsdp=...) "
                             "(ZO runs on a P x D mesh of replicas: ZOArguments(mesh=...), offload='cpu' for memory)")
    if getattr(args, "torch_compile", False):
        raise ZOTrainerError("torch_compile compiles the stock forward, and distzo's engine runs the model's layers "
                             "itself; drop TrainingArguments(torch_compile=True)")
    if getattr(args, "packing", False):
        raise ZOTrainerError("SFTConfig(packing=True) packs several examples into one row that only TRL's padding-free "
                             "attention keeps apart, and distzo scores a row as one sequence; set packing=False")
    objective = ("distzo's ZO steps minimise the token mean of the labels' negative log-likelihood (transformers' "
                 "causal-LM loss), while Trainer's evaluation would score {what}, so the logged losses and "
                 "metric_for_best_model would rank another objective than the one trained; {fix}")
    if getattr(args, "label_smoothing_factor", 0.0):
        raise ZOTrainerError(objective.format(what="the label-smoothed loss",
                                              fix="drop TrainingArguments(label_smoothing_factor=...)"))
    if compute_loss_func is not None:
        raise ZOTrainerError(objective.format(what="your compute_loss_func", fix="drop compute_loss_func=..."))
    if getattr(args, "loss_type", "nll") not in ("nll", "chunked_nll"):
        raise ZOTrainerError(objective.format(what=f"loss_type={args.loss_type!r}",
                                              fix="set SFTConfig(loss_type='nll')"))
    if getattr(args, "padding_free", False):
        raise ZOTrainerError("SFTConfig(padding_free=True) flattens a batch into one row that only TRL's padding-free "
                             "attention keeps apart, and distzo scores a row as one sequence (it packs and masks "
                             "batches itself, without padding); set padding_free=False")
    sampling = getattr(args, "train_sampling_strategy", "random")
    if sampling != "random":
        raise ZOTrainerError(f"train_sampling_strategy={sampling!r}: distzo's sampler draws each step's examples from "
                             "a shuffled order per epoch, a function of the seed and the step (so a mesh and a "
                             "resume see the same ones); drop train_sampling_strategy")
    data_seed, seed = getattr(args, "data_seed", None), getattr(args, "seed", None)
    if data_seed is not None and data_seed != seed:
        raise ZOTrainerError(f"data_seed={data_seed}: distzo draws the examples' order and the directions from one "
                             f"seed (TrainingArguments' seed, {seed}); drop data_seed or set seed={data_seed}")
    if getattr(args, "neftune_noise_alpha", None) is not None:
        raise ZOTrainerError("neftune_noise_alpha adds fresh random noise to the embeddings in every training forward, "
                             "and a ZO step compares forward passes that must see the same inputs (distzo runs the "
                             "model in eval mode, where NEFTune adds nothing); drop "
                             "TrainingArguments(neftune_noise_alpha=...)")
    schedule = str(getattr(getattr(args, "lr_scheduler_type", None), "value", getattr(args, "lr_scheduler_type", "")))
    if schedule in ("reduce_lr_on_plateau", "greedy"):
        raise ZOTrainerError(f"lr_scheduler_type={schedule!r} sets the learning rate from the metrics as they come, "
                             "and a ZO run's rates are a function of the step (a mesh and a resume replay them); "
                             "choose a schedule of the step: linear, cosine, constant_with_warmup, "
                             "warmup_stable_decay, ...")
    if getattr(getattr(args, "accelerator_config", None), "split_batches", False):
        raise ZOTrainerError("accelerator_config.split_batches=True splits per_device_train_batch_size over the "
                             "processes, and distzo's global batch is per_device_train_batch_size x "
                             "gradient_accumulation_steps x D (docs/hf.md); drop split_batches and divide "
                             "per_device_train_batch_size by D")
    if getattr(args, "save_on_each_node", False):
        raise ZOTrainerError("save_on_each_node writes each node's checkpoints on its own, and a ZOTrainer checkpoint "
                             "holds distzo's state written by rank 0 that every rank reads on resume: keep output_dir "
                             "on a file system all nodes share and drop TrainingArguments(save_on_each_node=True)")
    if getattr(args, "fp16", False):
        raise ZOTrainerError("fp16 mixed precision scales gradients, which a ZO step has none of, and distzo's engine "
                             "computes in fp32, tf32 or bf16; use TrainingArguments(bf16=True) instead of fp16=True")
    if optimizers is not None and any(o is not None for o in optimizers) or optimizer_cls_and_kwargs is not None:
        zo_optimizers = "|".join(registry("optimizer").names())
        raise ZOTrainerError("a torch optimizer or scheduler cannot apply to a ZO step, which has no gradients; drop "
                             f"optimizers=... and set ZOArguments(optimizer={zo_optimizers}) and "
                             "TrainingArguments(lr_scheduler_type=...)")


def _is_peft_model(model: Any) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def _every(steps_or_ratio: float, steps: int) -> int:
    """A Trainer cadence in steps: an int, or a fraction of the run (TrainingArguments' < 1)."""
    return max(1, math.ceil(steps_or_ratio * steps) if steps_or_ratio < 1 else int(steps_or_ratio))


def _compute(args: Any) -> str:
    """distzo's engine.compute for the Trainer's precision flags: bf16 and tf32 as transformers means
    them (the forward's arithmetic), the weights kept in the model's dtype."""
    if getattr(args, "bf16", False):
        return "bf16"
    return "tf32" if getattr(args, "tf32", None) else "fp32"


class ZOLoop:
    """The training loop both trainers share (mixed into transformers' Trainer and TRL's SFTTrainer)."""

    def _zo_init(self, zo_args: ZOArguments | None) -> None:
        self.zo_args = zo_args or ZOArguments()
        self.zo = None  # the distzo.Trainer while training runs
        self._zo_doing = None  # 'evaluation' or 'checkpoint' while one runs (what an out-of-memory error names)
        self._zo_trial = None  # hyperparameter_search's trial while train() runs
        self._zo_resumable = None  # the newest checkpoint this train() wrote with distzo's state
        self._zo_epoch_stop_said = False  # the warning that should_epoch_stop is not honoured, given once

    # --- distzo's configuration from the Trainer's ------------------------------------------------

    def zo_mesh(self) -> str:
        """P x D: ZOArguments.mesh, else 1 x the processes torchrun (or srun) launched."""
        from ..parallel.launch_env import launched_world_size

        return self.zo_args.mesh or f"1x{launched_world_size()}"

    def zo_global_batch(self) -> int:
        """per_device_train_batch_size x gradient_accumulation_steps x D (docs/hf.md)."""
        data = int(self.zo_mesh().lower().split("x")[1])
        return self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * data

    def zo_steps_per_epoch(self, n_train: int) -> int:
        """ZO steps in one pass over `n_train` training examples (at least one)."""
        return max(1, math.ceil(n_train / self.zo_global_batch()))

    def zo_max_steps(self, n_train: int) -> int:
        if self.args.max_steps and self.args.max_steps > 0:
            return int(self.args.max_steps)
        return int(math.ceil(self.args.num_train_epochs * self.zo_steps_per_epoch(n_train)))

    def zo_config(self, steps: int, micro_batch: int | None = None, schedule: tuple[str, int] | None = None):
        """The distzo configuration of this run (what `distzo.train` would be given). micro_batch:
        examples in one forward pass (default per_device_train_batch_size; auto_find_batch_size's).
        schedule: distzo's (optim.schedule, optim.warmup_steps), for a checkpoint that recorded others."""
        import distzo

        a, z = self.args, self.zo_args
        # Each step's rate comes from transformers' scheduler (zo_lr_at) and is logged with the step, so
        # distzo's own schedule stays constant: a resume with another max_steps or warm-up continues, as
        # Trainer's does, whatever the schedule.
        schedule_name, warmup = schedule or ("constant", 0)
        overrides = [
            "model=hf", *setting_overrides(z), f"peft={self.zo_peft()}", f"optim.lr={a.learning_rate}",
            f"optim.weight_decay={a.weight_decay}", f"optim.schedule={schedule_name}",
            f"optim.warmup_steps={warmup}",
            f"offload={z.offload}", f"mesh={self.zo_mesh()}",
            f"engine.compute={_compute(a)}", f"device={self.zo_device()}", f"steps={steps}",
            f"batch_size={self.zo_global_batch()}",
            f"micro_batch_size={micro_batch or a.per_device_train_batch_size}", f"seed={a.seed}", "eval_every=0",
            f"log_every={_every(a.logging_steps, steps)}", "checkpoint.every=0",
            "save_final=false", "task=custom", "task.kind=generation",
            "replica_check_every=0", *z.overrides]
        return distzo.compose(*overrides, validate=False)

    def zo_device(self) -> str:
        """ZOArguments.device; `auto` under TrainingArguments(use_cpu=True) is the CPU, where Trainer
        evaluates."""
        device = self.zo_args.device
        if getattr(self.args, "use_cpu", False) and device == "auto":
            return "cpu"
        return device

    def zo_peft(self) -> str:
        """distzo's trainable set: ZOArguments.peft; else none for a model that brings its own (a PEFT
        model's adapter, or whatever requires grad), or the one the estimator runs on (P-RGE: lora_fa)."""
        from ..zo.estimators import estimator_type

        if self.zo_args.peft is not None:
            return self.zo_args.peft
        only = estimator_type(self.zo_args.estimator).peft_methods
        if only and not _is_peft_model(self.model):
            return only[0]
        return "none"

    def zo_lr_at(self, steps: int):
        """Each step's learning rate, as transformers' scheduler of `lr_scheduler_type` (with its
        warm-up) gives it to a torch optimizer. The scheduler advances as far as the steps asked for
        (15 us a step: a 100,000-step schedule worked out in full cost 1.5 s before the first step)."""
        from transformers import get_scheduler

        holder = torch.nn.Parameter(torch.zeros(1))
        dummy = torch.optim.SGD([holder], lr=self.args.learning_rate)
        scheduler = get_scheduler(self.args.lr_scheduler_type, dummy,
                                  num_warmup_steps=self.args.get_warmup_steps(steps),
                                  num_training_steps=steps, scheduler_specific_kwargs=self.args.lr_scheduler_kwargs)
        rates: list[float] = []

        def lr_at(step: int) -> float:
            step = min(step, steps - 1)
            while len(rates) <= step:
                rates.append(float(dummy.param_groups[0]["lr"]))
                dummy.step()
                scheduler.step()
            return rates[step]

        return lr_at

    def zo_task(self) -> TrainerDataTask:
        """The Trainer's training data as the engine reads it: its columns and collator as Trainer's
        own training DataLoader has them (the model's unused columns removed), examples drawn by
        distzo's sampler (docs/hf.md)."""
        dataset, collator = self.train_dataset, self.data_collator
        if dataset is None:
            raise ZOTrainerError("ZOTrainer.train() needs a train_dataset (tokenized examples with input_ids, and "
                                 "labels or a collator that makes them)")
        try:
            import datasets
        except ImportError:  # pragma: no cover - datasets is a distzo dependency
            datasets = None
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        task = TrainerDataTask(dataset, self.eval_dataset, collator,
                               getattr(self.processing_class, "pad_token_id", None) or 0)
        if task.size("train"):  # what the collator makes, checked before anything starts
            task.train_batch(range(min(2, task.size("train"))))
        return task

    def _zo_check(self, cfg) -> None:
        """The configuration's checks that apply here (the data and model are the Trainer's own)."""
        from ..config.checks import check_values
        from ..config.compose import component_of, typed
        from ..run.checks import check_estimator

        cfg = typed(cfg)
        check_values(cfg)
        component_of(cfg.optim, "optimizer").check(cfg)
        check_estimator(cfg)

    # --- the loop ----------------------------------------------------------------------------------

    def _inner_training_loop(self, batch_size=None, args=None, resume_from_checkpoint=None, trial=None,
                             ignore_keys_for_eval=None):
        from transformers.trainer_callback import ExportableState, TrainerState
        from transformers.trainer_utils import TrainOutput

        import distzo

        args = self.args
        task = self.zo_task()
        steps = self.zo_max_steps(task.size("train"))
        recorded = _recorded_schedule(Path(resume_from_checkpoint) / ZO_STATE) if resume_from_checkpoint else None
        cfg = self.zo_config(steps, self._zo_micro_batch(batch_size), recorded)
        self._zo_check(cfg)
        self.state = TrainerState(stateful_callbacks=[cb for cb in self.callback_handler.callbacks + [self.control]
                                                      if isinstance(cb, ExportableState)])
        self.state.is_hyper_param_search = trial is not None
        self.state.compute_steps(args, steps)
        snapshot = None
        if resume_from_checkpoint is not None:
            snapshot = Path(resume_from_checkpoint) / ZO_STATE
            if not snapshot.is_dir():
                raise ZOTrainerError(f"{resume_from_checkpoint} has no {ZO_STATE}/ (distzo's state of that step): it "
                                     "was not written by a ZOTrainer, or with save_only_model=True (the model alone, "
                                     "as Trainer's, which nothing resumes from); resume from a checkpoint a ZOTrainer "
                                     "wrote without save_only_model")
            self.state = TrainerState.load_from_json(str(Path(resume_from_checkpoint) / "trainer_state.json"))
            self._load_callback_state()  # stateful callbacks (EarlyStoppingCallback's patience), as Trainer does
        # the micro-batch in use: where Trainer.train() restarts auto_find_batch_size's search on resume
        self.state.train_batch_size = cfg.micro_batch_size
        self._zo_trial = trial  # hyperparameter_search's: its own output folder (run-<n>/), its reports
        run_dir = self._zo_output_dir() / ZO_RUN
        if snapshot is None and self.is_world_process_zero():
            _start_over(run_dir)
        self._zo_prepare_for_evaluation()
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # PEFT
        lr_at = self.zo_lr_at(steps)
        try:
            zo = distzo.Trainer(cfg, run_dir=run_dir, model=model, tokenizer=self.processing_class, task=task,
                                validate_config=False, lr_at=lr_at, resume_from=snapshot)
        except ResumeError as exc:
            raise ZOTrainerError(_in_trainer_terms(str(exc))) from None
        self.zo = zo
        lr_at(zo.step_count)  # a resumed schedule catches up here, not inside the first step's time
        # the checkpoint this session continues from is complete: an out-of-memory refusal names it until a newer one is
        first_step, self._zo_doing = zo.step_count, None
        self._zo_resumable = Path(resume_from_checkpoint) if snapshot is not None else None
        try:
            if snapshot is not None:
                self._zo_find_best_checkpoint(zo.mesh)
            output = self._zo_loop(zo, steps, task, ignore_keys_for_eval, TrainOutput)
        except RuntimeError as exc:
            self._zo_refuse_a_late_retry(zo, first_step, exc)
            raise
        finally:
            zo.close()
            self.zo = None
        try:
            # skip_memory_metrics=False: train()'s memory (its tracker accepts calls from this method's name)
            self._memory_tracker.stop_and_update_metrics(output.metrics)
            self.log(output.metrics)
            self._zo_finish()  # the engine released: the model's own parameters hold the weights now
        except RuntimeError as exc:
            self._zo_refuse_a_late_retry(zo, first_step, exc, ended=True)
            raise
        return output

    def _zo_loop(self, zo, steps: int, task: TrainerDataTask, ignore_keys_for_eval, TrainOutput):
        """Trainer's flow around distzo's steps: the callbacks' events in Trainer's order, and logs,
        evaluations and checkpoints where the callbacks' control asks for them (DefaultFlowCallback
        turns logging/eval/save strategies into those requests, per step or per epoch)."""
        args, state, callbacks = self.args, self.state, self.callback_handler
        start, first_step = time.time(), zo.step_count
        per_epoch = self.zo_steps_per_epoch(task.size("train"))
        flops_per_token = self._zo_flops_per_token(zo)
        # the steps and epochs, the trial's name and parameters, and which process logs, reports and writes
        # (the callbacks read these; a resumed state holds rank 0's)
        state.init_training_references(self, steps, math.ceil(steps / per_epoch), self._zo_trial)
        self.control = callbacks.on_train_begin(args, state, self.control)
        if args.eval_on_start:  # the weights before this session's first step (not a candidate for the best)
            metrics = self.evaluate(ignore_keys=ignore_keys_for_eval)
            self._report_to_hp_search(self._zo_trial, state.global_step, metrics)
        self._zo_losses = [0.0, 0, 0.0]  # since the last log: sum, count; this session's sum
        self._globalstep_last_logged = state.global_step  # Trainer's: one log a step at most
        self.control = callbacks.on_epoch_begin(args, state, self.control)
        while zo.step_count < steps and not self.control.should_training_stop:
            self.control = callbacks.on_step_begin(args, state, self.control)
            self.control = callbacks.on_pre_optimizer_step(args, state, self.control)
            record = zo.step()
            self.control = callbacks.on_optimizer_step(args, state, self.control)
            state.global_step, state.epoch = zo.step_count, zo.step_count / per_epoch
            if args.include_num_input_tokens_seen not in ("no", False, None):
                state.num_input_tokens_seen += record.tokens  # the global batch's (distzo packs: no padding)
            if hasattr(self, "_total_train_tokens"):  # TRL's count of this session's tokens (its num_tokens)
                self._total_train_tokens += record.tokens
            state.total_flos += flops_per_token * record.tokens
            if args.torch_empty_cache_steps and zo.step_count % args.torch_empty_cache_steps == 0:
                _empty_cache()
            if not record.skipped:
                self._zo_losses = [self._zo_losses[0] + record.loss, self._zo_losses[1] + 1,
                                   self._zo_losses[2] + record.loss]
            self.control = callbacks.on_step_end(args, state, self.control)
            self._zo_log_evaluate_save(record, ignore_keys_for_eval)
            if self.control.should_epoch_stop:
                self._zo_ignore_epoch_stop()
            if zo.step_count % per_epoch == 0 or zo.step_count >= steps or self.control.should_training_stop:
                self.control = callbacks.on_epoch_end(args, state, self.control)
                self._zo_log_evaluate_save(record, ignore_keys_for_eval)
                if zo.step_count < steps and not self.control.should_training_stop:
                    self.control = callbacks.on_epoch_begin(args, state, self.control)
        with zo.materialized():
            pass  # the last update reaches the weights the Trainer evaluates and saves
        if args.load_best_model_at_end:  # rank 0 finds it after renaming its last checkpoint, and tells every rank
            self._zo_find_best_checkpoint(zo.mesh)
        runtime, done = time.time() - start, max(1, zo.step_count - first_step)
        train_loss = self._zo_losses[2] / done
        metrics = {"train_runtime": round(runtime, 4),
                   "train_samples_per_second": round(done * self.zo_global_batch() / max(runtime, 1e-9), 3),
                   "train_steps_per_second": round(done / max(runtime, 1e-9), 3), "total_flos": state.total_flos,
                   "train_loss": train_loss, "epoch": state.epoch}
        return TrainOutput(state.global_step, train_loss, metrics)

    @staticmethod
    def _zo_flops_per_token(zo) -> float:
        """A step's floating-point operations per token of its global batch, as transformers counts
        them (`Trainer.floating_point_ops`: 6 x the non-embedding parameters a token, for a forward
        and a backward pass) but for what a ZO step runs: 2 x those parameters for each of its
        forward passes (the estimator's whole plan, over the mesh). 0 for a model that does not
        count its parameters, as transformers gives."""
        model = zo.components.model
        if not hasattr(model, "num_parameters"):
            return 0.0
        return 2.0 * model.num_parameters(exclude_embeddings=True) * len(zo.components.estimator.plan())

    def _zo_ignore_epoch_stop(self) -> None:
        """control.should_epoch_stop (a callback's request to skip the rest of the epoch) is not
        honoured: distzo's sampler gives each step the examples of its place in the run (a mesh and a
        resume repeat them), so no epoch ends early. Said once; the request is cleared."""
        if not self._zo_epoch_stop_said and self.is_world_process_zero():
            log.warning("A callback set control.should_epoch_stop at step %d: ZOTrainer does not end an epoch early "
                        "(each step's examples are a function of the step); use should_training_stop to end the "
                        "run", self.state.global_step)
        self._zo_epoch_stop_said = True
        self.control.should_epoch_stop = False

    def _zo_prepare_for_evaluation(self) -> None:
        """What Trainer's first evaluation does to a model accelerate has not prepared (Trainer's own
        train() prepares it, a ZO run never does): `accelerator.prepare_model(evaluation_mode=True)`,
        which places it on the accelerator's device (mixed precision's autocast and torch.compile
        where set). Done here, before distzo's engine takes the parameters: in a mid-run evaluation
        the placement would give them new tensors under the engine (`model.to("cpu:0")` copies every
        one on a distributed CPU job), and an evaluation after it would read weights training no
        longer updates. It also keeps `eval_model_preparation_time` out of the mid-run evaluations'
        metrics, as under Trainer."""
        if self.accelerator._models:  # prepared already (an evaluation before train(), a second train())
            return
        prepared = self.accelerator.prepare_model(self.model, evaluation_mode=True)
        if prepared is not self.model:  # torch.compile's wrapper: what Trainer's evaluation runs
            self.model_wrapped = prepared

    def _zo_finish(self) -> None:
        """Trainer's end of training, after the engine is closed: with load_best_model_at_end the model
        takes the best evaluation's checkpoint (Trainer's own loader: the model file, or a PEFT model's
        adapter), and with save_total_limit=1 only that checkpoint stays; then on_train_end."""
        args, state = self.args, self.state
        if args.load_best_model_at_end and state.best_model_checkpoint is not None:
            self._load_best_model()
        if self.is_world_process_zero() and state.best_model_checkpoint is not None and args.save_total_limit == 1:
            best = Path(state.best_model_checkpoint).resolve()
            for folder in self._zo_output_dir().glob("checkpoint-*"):
                if folder.is_dir() and folder.resolve() != best:
                    shutil.rmtree(folder, ignore_errors=True)
        self.control = self.callback_handler.on_train_end(args, state, self.control)
        self._finish_current_push()  # an every_save upload still running
        self.is_in_train = False  # evaluate() casts for bf16_full_eval again

    def _zo_find_best_checkpoint(self, mesh) -> None:
        """state.best_model_checkpoint, checked by rank 0 for every rank (nodes' views of a network file
        system may differ for a while), on resume and before the best is loaded. A folder moved with
        output_dir is found there by name. One that is gone is dropped with a warning, as Trainer does;
        with load_best_model_at_end it is refused (Trainer would end with the last step's weights as
        if they were the best). Collective."""
        best = self.state.best_model_checkpoint
        if best is None:
            return
        candidates = (Path(best), self._zo_output_dir() / Path(best).name)
        found = mesh.decided_on_main(lambda: next((str(c) for c in candidates if (c / "trainer_state.json").is_file()),
                                                  None))
        if found is not None:
            self.state.best_model_checkpoint = found
            return
        if self.args.load_best_model_at_end:
            raise ZOTrainerError(f"load_best_model_at_end: the best evaluation's checkpoint {best} (step "
                                 f"{self.state.best_global_step}, {self.args.metric_for_best_model}="
                                 f"{self.state.best_metric}) is gone or incomplete; put that folder back, or set "
                                 "load_best_model_at_end=False to end with the last step's weights")
        if mesh.is_main:
            log.warning("The best checkpoint %s recorded in the state does not exist any more; ignoring it", best)
        self.state.best_model_checkpoint = None

    def hyperparameter_search(self, hp_space=None, compute_objective=None, n_trials: int = 20,
                              direction="minimize", backend=None, hp_name=None, **kwargs):
        """Trainer's search, each trial a ZO run (docs/hf.md): optuna, on one process; any other backend
        or a launched job is refused before a trial starts."""
        from transformers.hyperparameter_search import default_hp_search_backend
        from transformers.trainer_utils import HPSearchBackend

        _check_search(HPSearchBackend(backend if backend is not None else default_hp_search_backend()))
        return super().hyperparameter_search(hp_space, compute_objective, n_trials, direction, backend, hp_name,
                                             **kwargs)

    def _zo_output_dir(self) -> Path:
        """output_dir, or a hyperparameter_search trial's run-<n>/ in it (Trainer's _get_output_dir)."""
        return Path(self._get_output_dir(self._zo_trial))

    def _zo_micro_batch(self, batch_size: int | None) -> int:
        """The examples of one forward pass. auto_find_batch_size calls the loop again with a smaller
        batch after an out-of-memory error; under ZO that shrinks the micro-batch alone, so the step's
        batch (per_device x accumulation x D) and with it the run stay what they were."""
        micro = self.args.per_device_train_batch_size
        if self.args.auto_find_batch_size and batch_size is not None and batch_size < micro:
            log.info("auto_find_batch_size: micro-batches of %d examples (a step's batch stays %d examples)",
                     batch_size, self.zo_global_batch())
            micro = batch_size
        return micro

    def _zo_refuse_a_late_retry(self, zo, first_step: int, exc: RuntimeError, ended: bool = False) -> None:
        """With auto_find_batch_size, an out-of-memory error that a smaller micro-batch cannot mend
        from where the run began is not handed to Trainer's retry: one in an evaluation (a smaller
        training micro-batch does not shrink it; Trainer refuses it too), one while writing a checkpoint
        (it gathers the whole weights), and one after this session's first update (the retry would
        begin from weights the failed run had changed). One in a step
        before any update finds the model as it was (a resumed run restores its checkpoint), so it is
        retried. ended: after the last step (loading the best, the callbacks' on_train_end)."""
        from accelerate.utils.memory import should_reduce_batch_size

        a = self.args
        if not (a.auto_find_batch_size and should_reduce_batch_size(exc)):
            return
        if self._zo_doing == "evaluation":
            raise ZOTrainerError(f"the evaluation after step {zo.step_count} ran out of memory; auto_find_batch_size "
                                 "shrinks the training micro-batch only: set per_device_eval_batch_size="
                                 f"{max(1, a.per_device_eval_batch_size // 2)}") from exc
        last = self._zo_resumable
        then = f"resume from {last}" if last is not None else "train again (no checkpoint to resume from was saved)"
        if self._zo_doing == "checkpoint":
            raise ZOTrainerError(f"writing the checkpoint of step {zo.step_count} ran out of memory (it gathers the "
                                 "whole weights); auto_find_batch_size shrinks the training micro-batch only, which "
                                 f"does not shrink a checkpoint: free memory for it, then {then}") from exc
        if zo.step_count == first_step:
            return
        if ended:
            raise ZOTrainerError(f"after the last step ({zo.step_count}) training had finished, then ran out of memory "
                                 "(loading the best checkpoint, or in a callback's on_train_end); auto_find_batch_size "
                                 "retries a run from its start, and this one's weights have changed: free memory "
                                 "there (the trained weights are in the checkpoints)") from exc
        micro = zo.cfg.micro_batch_size or a.per_device_train_batch_size
        per_rank = a.per_device_train_batch_size * a.gradient_accumulation_steps  # a data rank's examples a step
        smaller = max(d for d in range(1, max(1, micro // 2) + 1) if per_rank % d == 0)
        raise ZOTrainerError(f"step {zo.step_count + 1} ran out of memory with micro-batches of {micro} examples after "
                             f"{zo.step_count - first_step} step(s) had changed the weights, so auto_find_batch_size "
                             f"cannot start again from where it began; {then} with "
                             f"per_device_train_batch_size={smaller} and gradient_accumulation_steps="
                             f"{per_rank // smaller} (the same {per_rank} examples a data rank per step, in "
                             "micro-batches that fit)") from exc

    def _zo_log_evaluate_save(self, record, ignore_keys_for_eval) -> None:
        """What the control asks for after a step or an epoch: the mean loss since the last log, an
        evaluation, a checkpoint (Trainer's _maybe_log_save_evaluate)."""
        if self.control.should_log and self.state.global_step > self._globalstep_last_logged:
            total, count, _ = self._zo_losses
            logs = {"loss": round(total / max(1, count), 6), "learning_rate": record.lr,
                    "projected_grad": record.projected_grads[0] if record.projected_grads else 0.0}
            if hasattr(self, "_total_train_tokens"):  # SFTTrainer logs the tokens trained on so far, as a float
                logs["num_tokens"] = float(self._total_train_tokens)
            self.log(logs)
            self._zo_losses[:2] = [0.0, 0]
            self._globalstep_last_logged = self.state.global_step
        self.control.should_log = False
        from transformers.trainer_utils import SaveStrategy

        if self.control.should_evaluate:
            metrics = self.evaluate(ignore_keys=ignore_keys_for_eval)  # resets should_evaluate (on_evaluate)
            self.control.should_evaluate = False
            self._report_to_hp_search(self._zo_trial, self.state.global_step, metrics)  # optuna's pruning
            # metric_for_best_model: state.best_metric / best_global_step, as Trainer keeps them, rank 0's
            # for every rank (a save_strategy="best" checkpoint is collective)
            new_best = self._determine_best_metric(metrics=metrics, trial=self._zo_trial)
            state = self.state
            new_best, state.best_metric, state.best_global_step = self.zo.mesh.broadcast_object(
                (new_best, state.best_metric, state.best_global_step))
            if self.args.save_strategy == SaveStrategy.BEST:
                self.control.should_save = new_best
        if self.control.should_save:
            self._save_checkpoint(self.model, self._zo_trial)  # on_save resets should_save
            self.control.should_save = False

    # --- checkpoints in Trainer's layout, with distzo's state ----------------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        """checkpoint-<step>/ (in output_dir, or a search trial's run-<n>/): the model or the adapter
        (`save_model`), trainer_state.json (with the best checkpoint recorded and the stateful
        callbacks' state), and distzo's snapshot of the step (`zo_state/`: trainable weights, the
        optimizer's state, the run's seed; the trajectory is in zo/), which `resume_from_checkpoint`
        continues; not with save_only_model. It is written as tmp-checkpoint-<step>/ and renamed when
        complete, so a run killed while writing it leaves no checkpoint-<step>/ for
        `resume_from_checkpoint=True` to pick up half-written (transformers' get_last_checkpoint takes
        the newest folder of that name); then save_total_limit rotates the checkpoints. Collective."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        final = self._zo_output_dir() / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        folder = final.with_name(f"tmp-{final.name}")
        writes, state = self.is_world_process_zero(), self.state
        self._zo_doing = "checkpoint"  # stays set if it raises: the out-of-memory refusal reads it
        if writes:
            shutil.rmtree(folder, ignore_errors=True)  # a kill's leftover
        if self.args.save_only_model:  # the model alone, as Trainer leaves out its optimizer: nothing resumes from it
            with self.zo.materialized():
                pass  # collective, as the snapshot would have been: save_model below reads current weights
        else:
            self.zo.snapshot(folder / ZO_STATE)  # collective: every rank materialises the weights
        # Trainer's rule: the best's checkpoint, this one or an earlier one still there (rank 0's answer, every
        # rank's state; asked on every rank whatever its figures)
        best = final.with_name(f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
        if self.zo.mesh.decided_on_main(lambda: bool(state.best_global_step) and (best == final or best.is_dir())):
            state.best_model_checkpoint = str(best)
        self.save_model(str(folder), _internal_call=True)  # collective as well; rank 0 writes
        if writes:
            _store_callback_states(self)
            state.save_to_json(str(folder / "trainer_state.json"))
            shutil.rmtree(final, ignore_errors=True)  # a checkpoint of this step from before a resume
            os.replace(folder, final)
            log.info("Checkpoint at step %d complete: %s", self.state.global_step, final)
            if self.args.push_to_hub:
                self._push_from_checkpoint(str(final))
            _rotate(final.parent, self.args, self.state, self)
        self._zo_doing = None
        if not self.args.save_only_model:
            # complete (on the ranks that do not write: once rank 0's save_model returned, which its write
            # and rename follow): what an out-of-memory refusal names to resume from
            self._zo_resumable = final
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model (or a PEFT model's adapter) as Trainer saves it, at the current weights, written by
        rank 0 alone. Collective while training runs. With distzo's own LoRA (ZOArguments(peft=
        "lora"|"lora_fa")) the folder also holds it as a PEFT adapter, so that from_pretrained(folder)
        (transformers loads an adapter that sits beside the model) and PeftModel.from_pretrained give
        the trained model; the model file keeps it under distzo's names, which load_best_model_at_end
        reads."""
        with self._at_current_weights():
            if self.is_world_process_zero():
                super().save_model(output_dir, _internal_call)
                self._zo_save_adapter(Path(output_dir if output_dir is not None else self.args.output_dir),
                                      _internal_call)

    def _zo_save_adapter(self, folder: Path, internal: bool) -> None:
        from ..peft.export import write_peft_lora
        from ..peft.lora import lora_layers
        from ..peft.prefix import prefix_modules

        layers = lora_layers(self.model)
        if layers:
            module = layers[0][1]
            r = module.lora_B.shape[1]
            write_peft_lora(self.model, r, module.lora_scale * r, getattr(self.model, "name_or_path", None) or None,
                            folder)
        elif prefix_modules(self.model) and not internal:
            log.warning("%s holds distzo's prefix (peft=prefix) under distzo's parameter names, which PEFT has no "
                        "format for and from_pretrained leaves out; load it into a model that carries the same "
                        "prefix (the checkpoint's load_best_model_at_end does), or train with peft='lora'", folder)

    # --- which process writes ----------------------------------------------------------------------

    def is_world_process_zero(self) -> bool:
        """Rank 0 of the job as torchrun or srun launched it. On a CPU job under torchrun,
        TrainingArguments' process_index is 0 on every rank (unless use_cpu=True), and each rank would
        write the checkpoints and report to wandb; distzo's mesh takes its ranks from the launcher."""
        from ..parallel.launch_env import launched_rank

        return launched_rank() == 0

    def is_local_process_zero(self) -> bool:
        """The first process on its node (torchrun's or srun's LOCAL_RANK)."""
        from ..parallel.launch_env import launched_local_rank

        return launched_local_rank() == 0

    def evaluate(self, *a, **kw):
        """Trainer's evaluation (its loop, `compute_metrics`, `on_evaluate`) at the current weights."""
        return self._zo_evaluation(super().evaluate, *a, **kw)

    def predict(self, *a, **kw):
        """Trainer's prediction (its loop, `compute_metrics`) at the current weights."""
        return self._zo_evaluation(super().predict, *a, **kw)

    def _zo_evaluation(self, run, *a, **kw):
        """`run` (Trainer's evaluate or predict) at the current weights."""
        if self.zo is None:
            _check_one_device(self.model)
        self._zo_doing = "evaluation"  # stays set if it raises: the out-of-memory refusal reads it
        with self._at_current_weights():
            out = run(*a, **kw)
        self._zo_doing = None
        return out

    @contextmanager
    def _at_current_weights(self):
        """The model's parameters hold the current weights inside (distzo's engine may keep them
        elsewhere between steps), and its forward runs on the device (offloaded blocks streamed
        through it); nothing to do before training has started."""
        if self.zo is None:
            yield
            return
        with self.zo.materialized(), self.zo.components.engine.stock_forward():
            yield

    def _issue_warnings_after_load(self, load_result) -> None:
        """Trainer's warnings after loading the best checkpoint, less the keys of tied parameters
        (lm_head.weight sharing the embedding's tensor): save_model leaves them out, loading the tensor
        they share restores them, and Trainer's check names them missing whenever the model ties them."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        missing = set(load_result.missing_keys)
        loaded = {params[name].data_ptr() for name in params if name not in missing}
        missing = [k for k in load_result.missing_keys if k not in params or params[k].data_ptr() not in loaded]
        super()._issue_warnings_after_load(type(load_result)(missing, load_result.unexpected_keys))

    def create_optimizer(self, model=None):
        return None  # a ZO step has no torch optimizer (distzo's rule updates the weights)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """distzo's snapshot in the checkpoint restores the weights and the optimizer's state."""


def _init_trainer(self, zo_args, kwargs, base: type) -> None:
    args = kwargs.get("args")
    _refuse_what_cannot_apply(args, kwargs.get("optimizers"), kwargs.get("optimizer_cls_and_kwargs"),
                              kwargs.get("compute_loss_func"))
    _refuse_own_loss(type(self), base)
    kwargs.pop("optimizers", None)
    self._zo_init(zo_args)
    base.__init__(self, **kwargs)
    _refuse_what_the_model_adds(self.model)
    if getattr(self.args, "use_cpu", False) and self.zo_args.device not in ("auto", "cpu"):
        raise ZOTrainerError(f"TrainingArguments(use_cpu=True) with ZOArguments(device={self.zo_args.device!r}): "
                             "Trainer would evaluate on the CPU and distzo train elsewhere; drop one of them")
    self._train_batch_size = self.args.per_device_train_batch_size  # auto_find_batch_size starts from the micro-batch
    _quiet_replicas(self)


def _check_one_device(model: Any) -> None:
    """Outside training, Trainer's evaluation runs the model as it is: after an offload='cpu' run on a
    GPU its blocks are still in host memory (the engine streamed them while it trained), which the
    stock forward cannot mix with the rest on the device."""
    devices = sorted({str(p.device) for p in model.parameters()})
    if len(devices) > 1:
        raise ZOTrainerError(f"the model's parameters are on several devices ({', '.join(devices)}): after "
                             "train() with offload='cpu' its blocks stay in host memory, and Trainer's evaluation "
                             "runs the model as it is; evaluate during training (eval_strategy, which streams the "
                             "blocks), or move the model where it fits first (trainer.model.to('cuda'))")


def _refuse_own_loss(cls: type, base: type) -> None:
    """A subclass's own compute_loss or training_step: the ZO steps call neither (they compute the
    labels' NLL in distzo's engine), while Trainer's evaluation calls compute_loss, so the logs would
    rank another objective than the one trained."""
    for method in ("compute_loss", "training_step"):
        if getattr(cls, method) is not getattr(base, method):
            raise ZOTrainerError(f"{cls.__name__} overrides {method}, which ZO steps never call (distzo's engine "
                                 "computes the labels' token-mean negative log-likelihood, transformers' causal-LM "
                                 f"loss, while Trainer's evaluation would call {cls.__name__}'s compute_loss); drop "
                                 "the override, or for another objective write a distzo objective "
                                 "(docs/estimators.md)")


def _refuse_what_the_model_adds(model: Any) -> None:
    """A model whose loss under Trainer adds a term distzo's ZO steps do not compute: a mixture of
    experts' router auxiliary loss (output_router_logits)."""
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0.0):
        raise ZOTrainerError("model.config.output_router_logits=True adds the router's load-balancing loss "
                             f"(router_aux_loss_coef={config.router_aux_loss_coef}) to the model's loss, and distzo's "
                             "ZO steps minimise the labels' negative log-likelihood alone, so evaluation would rank "
                             "another objective than the one trained; set model.config.output_router_logits=False")


def _quiet_replicas(trainer) -> None:
    """transformers' log level on the ranks that do not log (log_level_replica), as Trainer sets it
    from args.should_log, which on a CPU job under torchrun holds on every rank."""
    from transformers.training_args import trainer_log_levels
    from transformers.utils import logging as hf_logging

    args = trainer.args
    if trainer.is_world_process_zero() or args.log_on_each_node and trainer.is_local_process_zero():
        return
    level = trainer_log_levels[args.log_level_replica]
    hf_logging.set_verbosity(hf_logging.get_verbosity() if level == -1 else level)


def _zo_trainer_class(base: type, name: str, doc: str) -> type:
    """`base` (transformers' Trainer or TRL's SFTTrainer) with the ZO loop mixed in, constructed as
    `base` is, plus `zo_args`."""

    positional = [p.name for p in list(inspect.signature(base.__init__).parameters.values())[1:]
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def __init__(self, *args, zo_args: ZOArguments | None = None, **kwargs):
        if len(args) > len(positional):
            raise TypeError(f"{name}() takes at most {len(positional)} positional arguments ({len(args)} given)")
        for key, value in zip(positional, args):  # as `base` binds them
            if key in kwargs:
                raise TypeError(f"{name}() got multiple values for argument '{key}'")
            kwargs[key] = value
        _init_trainer(self, zo_args, kwargs, base)

    return type(name, (ZOLoop, base), {"__init__": __init__, "__doc__": doc, "__module__": "distzo.hf",
                                       "__qualname__": name})


def _make_zo_trainer():
    from transformers import Trainer

    return _zo_trainer_class(Trainer, "ZOTrainer", """`transformers.Trainer` whose training steps are distzo's ZO
    steps (see the module docstring). Everything a Trainer takes, plus `zo_args` (`ZOArguments`).""")


def _make_zo_sft_trainer():
    from trl import SFTTrainer

    return _zo_trainer_class(SFTTrainer, "ZOSFTTrainer", """TRL's `SFTTrainer` (its dataset formats, its
    completion-only labels, `peft_config`) whose training steps are distzo's ZO steps. Everything an
    SFTTrainer takes, plus `zo_args`.""")


# distzo's configuration keys that a resume refusal names, as a Trainer user sets them
_TRAINER_NAMES = {"optim.lr": "learning_rate", "optim.weight_decay": "weight_decay",
                  "engine.compute": "bf16/tf32", "batch_size": "the global batch (per_device_train_batch_size x "
                  "gradient_accumulation_steps x D)", "micro_batch_size": "per_device_train_batch_size"}


def _in_trainer_terms(message: str) -> str:
    """A distzo resume refusal as a ZOTrainer user reads it: the settings by their TrainingArguments
    names (distzo's key beside), and what to do in Trainer's terms."""
    for key, name in _TRAINER_NAMES.items():
        message = re.sub(rf"(?<![\w.]){re.escape(key)}(?=:)", f"{name} ({key})", message)
    message = re.sub(r"seed=(\d+)", r"TrainingArguments(seed=\1)", message)
    message = message.replace("run with the settings it was written with", "resume with the TrainingArguments and "
                              "ZOArguments the checkpoint was written with")
    return message.replace("use another hydra.run.dir to start afresh", "train without resume_from_checkpoint (in "
                           "another output_dir to keep this run)")


def _recorded_schedule(snapshot: Path) -> tuple[str, int] | None:
    """distzo's (optim.schedule, optim.warmup_steps) that a checkpoint's run recorded, where they are
    not the constant schedule ZOTrainer has passed since each step's rate is the scheduler's (before,
    `linear` was passed on, with the warm-up): such a checkpoint resumes with them, which enter the
    resume check alone (the rates are logged with each step). None: constant, or nothing readable."""
    try:
        optim = json.loads((snapshot / "state.json").read_text(encoding="utf-8"))["fingerprint_keys"]["optim"]
        recorded = str(optim.get("schedule", "constant")), int(optim.get("warmup_steps") or 0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return recorded if recorded != ("constant", 0) else None


def _check_search(backend) -> None:
    """hyperparameter_search's trials run one after another in this process, each a whole ZO run:
    with optuna, on one process (on several, each rank would run its own study, its own trials'
    settings)."""
    from transformers.trainer_utils import HPSearchBackend

    from ..parallel.launch_env import launched_world_size

    if backend != HPSearchBackend.OPTUNA:
        backend = str(getattr(backend, "value", backend))
        raise ZOTrainerError(f"hyperparameter_search(backend={backend!r}) is not supported by ZOTrainer (its reports "
                             "save checkpoints through Trainer's optimizer, which a ZO step has none of); use "
                             "backend='optuna', or distzo's own sweeps (python -m distzo sweep, docs/configuration.md)")
    if launched_world_size() > 1:
        raise ZOTrainerError("hyperparameter_search under torchrun or srun: each rank would run its own study and "
                             "train its own trials' settings; search on one process, then train the chosen "
                             "settings on the mesh")


def _empty_cache() -> None:
    """torch_empty_cache_steps: the accelerator's cached blocks back to the driver (any device kind,
    as Trainer does it)."""
    from accelerate.utils import clear_device_cache

    clear_device_cache()


def _store_callback_states(trainer) -> None:
    """The stateful callbacks' state (EarlyStoppingCallback's patience, the control) into
    trainer.state, for the checkpoint's trainer_state.json, as Trainer stores them."""
    from transformers.trainer_callback import ExportableState

    for callback in trainer.callback_handler.callbacks + [trainer.control]:
        if isinstance(callback, ExportableState):
            name, stored = type(callback).__name__, trainer.state.stateful_callbacks
            if isinstance(stored.get(name), list):
                stored[name].append(callback.state())
            else:
                stored[name] = callback.state()


def _start_over(run_dir: Path) -> None:
    """A fresh train() in an output_dir that holds an earlier run's distzo files (a second train() in a
    notebook, a script run again): they start over, as Trainer writes its checkpoints over an earlier
    run's. The earlier run's zo/ is kept as zo.previous/ (replacing an older one), so a train() that
    then fails its checks has lost nothing. Rank 0 alone, before distzo's run claims the folder (the
    other ranks never read it)."""
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "run.json").exists():
        previous = run_dir.with_name(f"{run_dir.name}.previous")
        if previous.is_symlink() or previous.is_file():
            previous.unlink()
        elif previous.exists():
            shutil.rmtree(previous)
        try:
            os.replace(run_dir, previous)  # zo/ itself may be a symlink (to scratch space): the link moves
        except OSError as exc:
            log.warning("%s could not be kept as %s (%s); removing it", run_dir, previous, exc)
            shutil.rmtree(run_dir)
        else:
            log.info("%s held an earlier run's logs, now in %s; this train() starts them over", run_dir, previous)


def _rotate(output_dir: Path, args, state, trainer) -> None:
    """Trainer's save_total_limit: the oldest checkpoints go (the newest and the best stay), oldest by
    modification time as Trainer orders them (by step number where the times are under a second
    apart), so an earlier run's checkpoints of higher steps in the same output_dir go first."""
    try:
        from transformers.trainer_utils import rotate_checkpoints
    except ImportError:  # transformers before 5: a Trainer method
        trainer._rotate_checkpoints(use_mtime=True, output_dir=str(output_dir))
        return
    rotate_checkpoints(output_dir=str(output_dir), save_total_limit=args.save_total_limit,
                       best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)
