"""Training: the step of docs/architecture.md#one-step, and the loop around it, top to bottom.

    batch -> plan -> my probes on my shard -> exchange (sum, count) -> projected gradients ->
    identical update on every rank -> log -> (snapshot, evaluation)

`zo_step` is one step. `Trainer` is a run: built once from a configuration (resuming where an
interrupted run left off, resume=auto), then driven step by step (`step`, `evaluate`, `snapshot`,
`save`) or to the end (`fit`, the loop the command line runs). On a PxD mesh each rank runs the
probes dealt to its perturbation index on the shard of the global batch given to its data index;
only scalars are exchanged, and every rank applies the same update. How the engine runs its part is
fixed when `build_engine` picks its mode (docs/architecture.md#engines) and is not the driver's concern.
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from omegaconf import DictConfig
from safetensors.torch import load_file

from ..config.compose import typed
from ..config.schema import Config
from ..data.tasks import PromptTask
from ..errors import ConfigError, DistzoError
from ..parallel.consistency import check_replicas
from ..state.checkpointer import Checkpointer
from ..state.resume import (
    ResumeError,
    ResumePoint,
    catch_up,
    check_identity,
    find_resume_point,
    replay_point,
    resume_point_at,
    run_identity,
    truncate_logs,
)
from ..state.snapshots import atomic_write_json, finite_json, save_final
from ..telemetry.jsonl import JsonlWriter, read_jsonl
from ..telemetry.metrics import (
    MetricsWriter,
    Progress,
    format_duration,
    peak_memory_bytes,
    peak_rss_bytes,
)
from ..telemetry.sinks import open_sinks
from ..zo.directions import DIRECTIONS_VERSION
from ..zo.optimizers import SGD
from ..zo.schedule import learning_rate
from .callbacks import Callback, CallbackList
from .checks import SUMMARY_FIGURES, validate
from .components import Components, build_components
from .evaluation import Evaluator, headline
from .hub_pins import HubPins, fetch_hub_pins
from .rundir import RunDirectory
from .selection import BestValidation, BestWeightsGone
from .session import Session
from .signals import Stopped, StopRequests

log = logging.getLogger("distzo")


class TrainingError(DistzoError):
    """Training cannot continue; the message says why and what to change."""


@dataclass
class StepOutcome:
    batch: Any  # the global batch
    losses: torch.Tensor  # mean loss of every probe over the global batch
    result: Any  # the estimator's StepResult, or None when the step was skipped
    lr: float
    coefficients: tuple = ()  # what the update applied (the optimizer's view of the estimate)


def zo_step(c: Components, step: int, lr_at: Callable[[int], float] | None = None) -> StepOutcome:
    """One ZO step on the mesh; every rank returns the same outcome. lr_at: the learning rate of a
    step (default: the configuration's schedule, `optim.schedule`)."""
    cfg, mesh, engine, estimator = c.cfg, c.mesh, c.engine, c.estimator
    engine.begin_step(step)                                                  # Sparse MeZO: thresholds
    batch = c.task.train_batch(c.sampler.indices(step))                     # the global batch
    shard = batch.shard(mesh.data_rank, mesh.shape.data)                     # my data shard
    plan = estimator.dealt_plan()                                            # every forward dealt over P
    local = torch.zeros(len(plan) + estimator.shared_clean, 2, dtype=torch.float64)
    if estimator.shared_clean:                                               # AGZO: bases from a clean forward
        with c.capture.capture(step, engine.pack(batch).real), engine.materialized() as weights:
            scores = weights.score(batch)                                    # every rank, the global batch
        if mesh.rank == 0:                                                   # counted once in the exchange
            local[0] = c.task.objective_sums(scores, batch, cfg.objective)
    for i, scores in engine.run_probes(shard, plan, step).items():             # my probes, on my shard
        local[i + estimator.shared_clean] = c.task.objective_sums(scores, shard, cfg.objective)
    with c.timers("comm"):
        sums = mesh.exchange(local)                                          # global, on every rank
    losses = sums[:, 0] / sums[:, 1]
    lr = (lr_at(step) if lr_at is not None
          else learning_rate(step, cfg.optim.lr, cfg.steps, cfg.optim.schedule, cfg.optim.warmup_steps))
    if not torch.isfinite(losses).all():                                     # skip, never update
        return StepOutcome(batch, losses, None, lr)
    result = estimator.combine(losses)                                       # projected gradients
    c.optimizer.advance(result.grads)                                        # MEAZO: its running mean of g^2
    coefficients = c.optimizer.coefficients(result)                         # FZOO, MEAZO: normalised
    engine.apply(step, coefficients, lr, cfg.optim.weight_decay)             # same on every rank (the
    return StepOutcome(batch, losses, result, lr, coefficients)              # optimizer's rule and state)


@dataclass(frozen=True)
class StepRecord:
    """What a step did (the same on every rank). step: steps done after it; skipped: its losses were
    not finite and the weights did not change."""

    step: int
    loss: float
    projected_grads: tuple[float, ...]
    lr: float
    tokens: int
    step_time_s: float
    skipped: bool = False


class Summary(dict):
    """A finished run's result: the `summary` line of metrics.jsonl (docs/configuration.md#what-a-run-writes),
    readable as a dict or by attribute (`summary.test_accuracy`)."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


class Trainer:
    """A training run of a configuration (`distzo.compose`), built once; every rank of a mesh builds
    its own with the same configuration (under torchrun or srun the mesh comes from the environment).

    run_dir: where the run writes (default outputs/<date>/<time>; rank 0's is every rank's).
    model / tokenizer / task: your own transformers model and tokenizer, and a task built on them
    (`distzo.PromptTask`), instead of those the configuration names. callbacks: `distzo.Callback`s.
    validate_config: check the configuration first (the command line has checked it already). lr_at: each
    step's learning rate, in place of `optim.schedule` (a transformers scheduler's, say).
    resume_from: a snapshot folder (`<run>/checkpoints/step-N`) to continue from at its step, its
    weights and optimizer state, whatever resume= says (the logs after it are cut off).

    `fit()` runs the loop to `cfg.steps` (evaluations, snapshots, replica checks on their cadences,
    a graceful stop on SIGTERM / SIGUSR1 / SIGINT; a callback may end it early by setting
    `trainer.should_stop`, on every rank alike; with keep_best the result is the best validation
    evaluation's weights, distzo/run/selection.py) and returns the Summary; or drive it yourself
    with `step()`, `evaluate()`, `snapshot()` and `save()`. Close it (or use `with`) to release the
    mesh, threads and buffers."""

    def __init__(self, cfg: Config | DictConfig, run_dir: str | Path | RunDirectory | None = None, *,
                 model: torch.nn.Module | None = None, tokenizer: Any = None, task: PromptTask | None = None,
                 callbacks: Sequence[Callback] = (), validate_config: bool = True,
                 lr_at: Callable[[int], float] | None = None, resume_from: str | Path | None = None):
        cfg = typed(cfg)  # the one conversion: every layer below receives the typed sections
        if validate_config:
            validate(cfg)
        self.cfg, self.lr_at, self.resume_from = cfg, lr_at, resume_from
        self.callbacks = CallbackList(callbacks)
        self.session = Session(cfg, run_dir, continuing=resume_from is not None)
        self.mesh, self.run_dir = self.session.mesh, self.session.run_dir
        self.components: Components | None = None
        self.metrics: MetricsWriter | None = None  # set by _start, which may fail before (a sink that cannot start)
        self.trajectory: JsonlWriter | None = None
        try:
            self._start(model, tokenizer, task)
        except BaseException:
            self._abandon()
            raise

    def _start(self, model, tokenizer, task) -> None:
        """Everything the loop needs; with resume=auto, the weights and logs of the step an
        interrupted run reached (its newest snapshot, then the steps logged after it, re-applied)."""
        cfg, mesh, run_dir = self.cfg, self.mesh, self.run_dir
        if cfg.keep_best is not None and model is not None:
            raise ConfigError(f"keep_best={cfg.keep_best} rebuilds the model from the configuration's model.* at the "
                              "end of the run, and this trainer was handed a model object; drop keep_best (and pick "
                              "among the run's snapshots), or name the model in the configuration")
        if self.resume_from is not None:
            point = mesh.decided_on_main(lambda: resume_point_at(cfg, Path(self.resume_from)))
        else:
            point = find_resume_point(cfg, run_dir, mesh)
        self.seed = self.session.seed(check_identity(cfg, point.snapshot or str(run_dir), point.identity)
                                      if point is not None else None)
        self.best = BestValidation(None if cfg.keep_best is None else str(cfg.keep_best), run_dir)
        self._restored = False  # keep_best: the engine holds the best evaluation's weights, not the last step's
        best_resume = None
        if self.best.enabled and point is not None:
            point, best_resume = self._plan_best_resume(point, run_dir)
        # The hub commits the run read before it was interrupted, not a branch's newer one.
        sources = fetch_hub_pins(cfg, mesh, HubPins.from_record(point.identity.get("sources")) if point else None,
                                model=model is None, data=task is None)
        self.components = c = build_components(cfg, mesh, self.seed, point.weights() if point is not None else None,
                                               model=model, tokenizer=tokenizer, task=task,
                                               optimizer_state=point.optimizer_state() if point is not None else None,
                                               sources=sources)
        if self.best.enabled:  # the data decides it: checked before any of the run's files is written
            self.best.check_task(c.task)
        self.start_step, self._nonfinite = (point.step, point.nonfinite_in_a_row) if point is not None else (0, 0)
        if point is not None and mesh.is_main:
            truncate_logs(run_dir, self.start_step)  # what came after the step reached is written again
        sinks = open_sinks(cfg, run_dir, {"world_size": mesh.world_size, "pert": mesh.shape.pert,
                                          "data": mesh.shape.data, "nodes": mesh.world_size // mesh.node.size,
                                          "seed": self.seed}) if mesh.is_main else []
        self.metrics = MetricsWriter(run_dir / "metrics.jsonl" if mesh.is_main else None,
                                     static={"mesh": str(mesh.shape)}, sinks=sinks)
        self.trajectory = JsonlWriter(run_dir / "trajectory.jsonl" if mesh.is_main else None)
        self.checkpoints = Checkpointer(cfg.checkpoint, run_identity(cfg, self.seed, mesh, c.sources.record()),
                                        run_dir, mesh, self.trajectory)
        if point is None:
            self.checkpoints.start()
        else:
            self._catch_up(point, best_resume[3] if best_resume is not None else None)
        self.evaluator = Evaluator(c.task, c.engine, mesh, cfg.eval_batch_size, self.metrics)
        self.step_count = self.start_step  # updates done
        self.should_stop = False  # set by a callback, on every rank alike, to end `fit` after this step
        self._progress = Progress("train step", cfg.steps, every_s=15.0, enabled=mesh.is_main)
        self._step_times: list[float] = []
        self._step_h2d: list[float] = []  # this rank's host-to-device bytes per step (offloading)
        self._loss_ema: float | None = None
        self._describe()
        if self.best.enabled:
            if cfg.eval_every >= cfg.steps and mesh.is_main:
                log.warning("keep_best=%s with eval_every=%d and steps=%d: the evaluation after the last step is "
                            "the only candidate, so the result is the last step's weights; set eval_every below "
                            "steps (MeZO validates every steps/5)", cfg.keep_best, cfg.eval_every, cfg.steps)
            if best_resume is not None:
                self._continue_best(*best_resume[:3])
        elif point is not None and self._evaluation_due(self.start_step) \
                and not self._logged_validation(self.start_step):
            # a stop that came after the step and before its evaluation: the evaluation, as the
            # uninterrupted run logged it (keep_best's resume does the same in _continue_best)
            self.evaluate("validation")

    def _catch_up(self, point: ResumePoint, rebuild_best: int | None) -> None:
        """Resume: the logged steps after the point's snapshot (or the initial weights) re-applied,
        without data or forward passes; with `rebuild_best`, best/ written from the weights of that
        step as they pass. Collective."""
        c, records = self.components, point.records
        if point.snapshot is not None:
            log.info("Resuming from %s (step %d of %d)", point.snapshot, point.snapshot_step, self.cfg.steps)
        if records:
            log.info("Re-applying the %d step(s) logged after %s (trajectory.jsonl), no forward passes",
                     len(records), "it" if point.snapshot else "the initial weights")
        nonfinite = point.nonfinite_in_a_row
        if rebuild_best is not None:
            before = [r for r in records if r["step"] <= rebuild_best]
            nonfinite = catch_up(c.engine, before, nonfinite, self.mesh.is_main, c.optimizer)
            self.checkpoints.save(c.engine, rebuild_best, nonfinite, self.best.path, weights_only=True)
            if self.mesh.is_main:
                log.info("keep_best=%s: the best so far, %s, rebuilt by re-applying the logged steps",
                         self.best.metric, self.best.describe())
            records = records[len(before):]
        self._nonfinite = catch_up(c.engine, records, nonfinite, self.mesh.is_main, c.optimizer)

    def _plan_best_resume(self, point: ResumePoint,
                          run_dir: Path) -> tuple[ResumePoint, tuple[set[int], bool, str | None, int | None]]:
        """keep_best on resume, before anything is built or the logs are cut: the best so far
        (metrics.jsonl, read by rank 0 as it reads the resume point) and its weights (`plan_resume`).
        Where they are gone, the resume re-applies the logged steps from a start at or before the
        best's step (`replay_point`; the point returned) and writes best/ as it passes that step (the
        last field). Every rank raises the same ResumeError where that cannot be, or where rank 0 failed
        to read."""
        def plan():
            try:
                return point, (*self.best.plan_resume(point.step), None), self.best.best
            except BestWeightsGone as gone:
                try:
                    if self.resume_from is not None:
                        start, why = None, ("resume_from names the snapshot to continue from, and the rebuild "
                                            "would start from an earlier one (resume=auto in the run's directory "
                                            "rebuilds them)")
                    else:
                        start, why = replay_point(self.cfg, run_dir, point, gone.step, self.mesh.device)
                except DistzoError as exc:
                    start, why = None, str(exc)
                except Exception as exc:
                    start, why = None, f"reading the run's snapshots failed: {exc!r}"
                if start is None:
                    raise ResumeError(f"{gone}; nor can re-applying the logged steps rebuild them: {why}. Start the "
                                      "run afresh in a new directory, or drop keep_best (the last step's weights are "
                                      "then the result)") from None
                return start, (gone.evaluated, False, None, gone.step), self.best.best
            except DistzoError:
                raise
            except Exception as exc:
                raise ResumeError(f"keep_best={self.best.metric}: reading the best so far failed: {exc!r}") from exc

        point, outcome, self.best.best = self.mesh.decided_on_main(plan)
        return point, outcome

    def _evaluation_due(self, step: int) -> bool:
        """Whether `fit` evaluates validation after `step` (the last step's is `_finish`'s)."""
        every = self.cfg.eval_every
        return bool(every) and 0 < step < self.cfg.steps and step % every == 0

    def _continue_best(self, evaluated: set[int], save: bool, adopt: str | None) -> None:
        """keep_best on resume, the weights of the step reached current and the logs cut to it: best/
        from the run's snapshot of the best step where `_plan_best_resume` found one; the evaluation of
        the step reached, if the interruption came before it (as the uninterrupted run evaluated it);
        and the best's snapshot where it is to be written again."""
        step = self.start_step
        if adopt is not None and self.mesh.is_main:
            self.best.adopt(adopt)
            log.info("keep_best=%s: the best so far, %s, from %s", self.best.metric, self.best.describe(), adopt)
        if self._evaluation_due(step) and step not in evaluated:
            save = self.best.offer(step, self.evaluate("validation")) or save
        if save:
            self._save_best()

    # --- what a run is made of ----------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The stock transformers model being trained (read its weights inside `materialized()`)."""
        return self.components.model

    @property
    def tokenizer(self) -> Any:
        return self.components.tokenizer

    @property
    def task(self) -> PromptTask:
        return self.components.task

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the rank that writes the run directory."""
        return self.mesh.is_main

    def materialized(self):
        """A context in which the weights are current (pending updates applied, peers in step): read
        `trainer.model` or the trainable tensors inside. Collective."""
        return self.components.engine.materialized()

    # --- driving it ----------------------------------------------------------------------------------

    def step(self) -> StepRecord:
        """One ZO step on the mesh, logged to metrics.jsonl and trajectory.jsonl. A step whose losses
        are not finite changes nothing (`skipped`); `max_nonfinite_steps` in a row raise TrainingError."""
        self._check_not_restored("step()")
        c, step = self.components, self.step_count
        moved_before = c.engine.transfer_stats()
        started = time.perf_counter()
        out = zo_step(c, step, self.lr_at)            # batch, plan, forwards, exchange, update
        step_time = time.perf_counter() - started
        self.step_count = step + 1
        if out.result is None:                        # non-finite losses: skipped, weights unchanged
            self._nonfinite = self._skip_nonfinite(step, out.losses)
            record = StepRecord(step + 1, math.nan, (), out.lr, out.batch.tokens, step_time, skipped=True)
        else:
            self._nonfinite = 0
            self._step_times.append(step_time)
            self._log_step(step, out, step_time, moved_before)
            record = StepRecord(step + 1, out.result.loss, tuple(out.result.grads), out.lr, out.batch.tokens,
                                step_time)
        self.callbacks.on_step_end(self, record)
        return record

    def evaluate(self, split: str = "validation") -> dict[str, Any]:
        """The current weights' metrics on `split` (every rank together), also written to metrics.jsonl."""
        # After keep_best's restore, the line says whose weights these are (logged at the step reached,
        # as a sink such as wandb takes no step below its last).
        extra = {"weights_step": self.best.best.step} if self._restored else {}
        result = self.evaluator.run(split, self.step_count, **extra)
        self.callbacks.on_evaluate(self, split, result)
        return result

    def snapshot(self, folder: str | Path | None = None) -> Path | None:
        """A snapshot of the weights after the steps done (what resume=auto continues from); its path
        on rank 0. folder: write it there (what `resume_from` continues from) instead of among the
        run's snapshots. Collective."""
        self._check_not_restored("snapshot()")
        path = self.checkpoints.save(self.components.engine, self.step_count, self._nonfinite, folder)
        self.callbacks.on_snapshot(self, self.step_count, path)
        return path

    def save(self, folder: str | Path | None = None) -> Path | None:
        """The trained model as a Hugging Face folder (or with peft the adapter, also in the PEFT
        format) in `folder` (default <run_dir>/final); that folder on rank 0 (what `from_pretrained`
        and `PeftModel.from_pretrained` take), None on the others. Collective."""
        path = self._save(folder)
        return path.parent if path is not None else None

    def _save(self, folder: str | Path | None = None) -> Path | None:
        """`save`, returning the weights file's path on rank 0 (the summary's final_weights)."""
        folder = Path(folder) if folder is not None else self.run_dir / "final"
        with self.materialized() as weights:
            if not self.mesh.is_main:
                return None
            path = save_final(weights.model, self.tokenizer, folder, weights.params, self.cfg)
        log.info("Saved trained weights to %s", path)
        return path

    def fit(self) -> Summary:
        """Train to `cfg.steps`: the loop the command line runs (see the class docstring). Raises
        `Stopped` after the snapshot of the step reached when a stop signal arrived."""
        self._check_not_restored("fit()")
        cfg, mesh = self.cfg, self.mesh
        with StopRequests() as stop:
            first = self.evaluate("validation") if self.step_count == 0 else None
            self.callbacks.on_train_begin(self)
            wall_start = time.time()
            while self.step_count < cfg.steps and not self.should_stop:
                self.step()
                done = self.step_count
                if stop.agreed(mesh):                        # SIGTERM / SIGUSR1 / SIGINT on any rank
                    with stop.holding():
                        path = self.snapshot()
                    stop.hand_over()                         # submitit's requeue, where it sent the signal
                    raise Stopped(done, stop.name, str(path) if path else None)
                if cfg.replica_check_every and done % cfg.replica_check_every == 0 and done < cfg.steps:
                    with self.materialized() as weights:  # compare current masters
                        check_replicas(mesh, [p.tensor for p in weights.params], done)
                    del weights  # it holds the model: keep_best's rebuild must be able to free it
                if self.checkpoints.due(done):
                    with stop.holding():
                        self.snapshot()
                if self._evaluation_due(done):
                    if self.best.offer(done, self.evaluate("validation")):  # keep_best's new best
                        with stop.holding():
                            self._save_best()
            stop.finishing = True  # a stop from here on lets the run finish (StopRequests)
            summary = self._finish(first, wall_start)
        self.callbacks.on_train_end(self, summary)
        return summary

    def _finish(self, first: dict[str, Any] | None, wall_start: float) -> Summary:
        """The end of a run: replica check, last snapshot, final evaluations, the saved model, the summary."""
        cfg, mesh, steps = self.cfg, self.mesh, self.step_count
        with self.materialized() as weights:      # pending updates reach the master before it is checked
            replica_checksums = check_replicas(mesh, [p.tensor for p in weights.params], steps)
        del weights  # it holds the model: keep_best's rebuild must be able to free it
        if cfg.checkpoint.every and not self.checkpoints.due(steps) and steps > self.start_step:
            self.snapshot()  # the end of the run, if not on the cadence
        last = result = self.evaluate("validation")
        best = self.best.best
        if self.best.offer(steps, last):
            self._save_best()  # keep_best: the last evaluation is the best; best/ says so too
        elif best is not None and best.step != steps:
            self._restore_best(last)  # keep_best: an earlier evaluation was the best
            result = best.result
            with self.materialized() as weights:  # the summary's checksums are the result's
                replica_checksums = check_replicas(mesh, [p.tensor for p in weights.params], best.step)
            del weights
        elif self.best.enabled and best is None and mesh.is_main:
            log.warning("keep_best=%s: no validation evaluation reported a finite %s (an empty split?); the "
                        "result is the last step's weights", self.best.metric, self.best.metric)
        c = self.components
        test = self.evaluate("test")
        step_times = self._step_times
        # A resumed session evaluated nothing before training: the run's own evaluation before its
        # first step is in metrics.jsonl (logs are cut after the resume point, never before step 1).
        before = first if first is not None else self._logged_validation(0)
        summary = Summary({
            "steps": steps, "resumed_from_step": self.start_step, "seed": self.seed, "mesh": str(mesh.shape),
            "directions_version": DIRECTIONS_VERSION,
            "validation_accuracy_before": before["accuracy"] if before else None,
            "validation_accuracy_after": result["accuracy"], "test_accuracy": test["accuracy"],
            "keep_best": self.best.metric, "best_step": self.best.best.step if self.best.best else None,
            "train_time_s": round(sum(step_times), 1),
            "step_time_s": round(statistics.median(step_times), 3) if step_times else math.nan,
            "wall_time_s": round(time.time() - wall_start, 1),
            "peak_rss_bytes": peak_rss_bytes(), "peak_mem_bytes": peak_memory_bytes(mesh.device),
            "trainable_parameters": c.params.numel(), **c.sources.revisions(), "offload": str(cfg.offload.mode),
            **self._host_master_summary(), **self._optimizer_summary(), **c.quantized.summary(),
            **c.engine.summary(),
            **({"h2d_bytes_per_step": int(statistics.median(self._step_h2d))} if self._step_h2d else {}),
            "replica_checksums": replica_checksums,  # every rank's, in rank order: identical (checked)
        })
        for key in SUMMARY_FIGURES[1:]:  # generation: accuracy is the exact match (None for whole texts)
            if key in result:
                summary.update({f"validation_{key}_before": before.get(key) if before else None,
                                f"validation_{key}_after": result[key], f"test_{key}": test[key]})
        if cfg.save_final:
            path = self._save()
            if path is not None:
                summary["final_weights"] = str(path)
        if mesh.is_main:
            atomic_write_json(self.run_dir / "summary.json", dict(summary))
        self.metrics.write("summary", **finite_json(summary))  # as summary.json: a figure that is no number is null
        pace = (f"{format_duration(summary['train_time_s'])} training, median {summary['step_time_s']:.2f} s/step"
                if step_times else "no step left to train")
        chosen = (f" (keep_best={self.best.metric}: step {self.best.best.step}'s weights, the best "
                  f"{self.best.metric} {self.best.best.result[self.best.metric]:.4f})" if self._restored else "")
        log.info("Validation %s -> %s after %d steps%s (%s); test %s",
                 headline(first) if first else f"(resumed at step {self.start_step})", headline(result), steps, chosen,
                 pace, headline(test))
        return summary

    def _logged_validation(self, step: int) -> dict[str, Any] | None:
        """The validation evaluation of `step` that metrics.jsonl holds (None without one), read on rank
        0 for every rank. Collective."""
        def read() -> dict[str, Any] | None:
            return next((r for r in read_jsonl(self.run_dir / "metrics.jsonl") if r.get("type") == "eval"
                         and r.get("split") == "validation" and r.get("step") == step), None)

        return self.mesh.decided_on_main(read)

    def _save_best(self) -> None:
        """keep_best: the weights of the step reached, the new best, into checkpoints/best. Collective."""
        self.metrics.sync()  # the evaluation's line first: resume reads the best from metrics.jsonl
        self.checkpoints.save(self.components.engine, self.step_count, self._nonfinite, self.best.path,
                              weights_only=True)
        if self.mesh.is_main:
            log.info("keep_best=%s: new best, %s", self.best.metric, self.best.describe())

    def _restore_best(self, last: dict[str, Any]) -> None:
        """keep_best: the engine rebuilt from the best evaluation's snapshot, as resume builds one. Its
        weights are verified first; then the last step's model is closed and its storage released, so
        the two are never held together. Collective."""
        best, mesh = self.best.best, self.mesh
        held = mesh.decided_on_main(self.best.held)
        if held != best.step:
            what = f"step {held}" if isinstance(held, int) else held
            raise TrainingError(f"keep_best={self.best.metric}: the best evaluation, step {best.step}, has no weights "
                                f"left in {self.best.path} (it holds {what}); resume=auto keep_best=null in the same "
                                "hydra.run.dir writes the last step's result instead")
        if mesh.is_main:
            metric = self.best.metric
            log.info("keep_best=%s: the result is the weights of step %d (%s %.4f, %s; step %d: %s %.4f, %s); "
                     "rebuilding the model from %s", metric, best.step, metric, best.result[metric],
                     headline(best.result), self.step_count, metric, last[metric], headline(last), self.best.path)
        c, self.components, self.evaluator = self.components, None, None
        task, sources = c.task, c.sources
        c.close()
        c.model.to("meta")  # its storage goes now, whoever still refers to the module (a callback, say)
        del c
        gc.collect()
        if mesh.device.type == "cuda":
            torch.cuda.empty_cache()
        mesh.barrier()  # every rank's copy released (a node-shared master's too) before any is rebuilt
        weights = load_file(self.best.path / "weights.safetensors")  # verified above
        self.components = build_components(self.cfg, mesh, self.seed, weights, task=task, sources=sources)
        self.evaluator = Evaluator(task, self.components.engine, mesh, self.cfg.eval_batch_size, self.metrics)
        self._restored = True

    def _check_not_restored(self, what: str) -> None:
        if self._restored:
            raise TrainingError(f"{what} after fit(): with keep_best the trainer holds the weights of step "
                                f"{self.best.best.step}, the best evaluation's, not those of the step reached "
                                f"({self.step_count}); evaluate or save them, or build a new Trainer with resume=auto "
                                "to continue")

    def close(self) -> None:
        """Release the engine's threads and buffers, the logs and the mesh (every rank together)."""
        for writer in (self.metrics, self.trajectory):
            if writer is not None:
                writer.close()
        if self.components is not None:
            self.components.close()
            self.components = None
        self.session.close()

    def _abandon(self) -> None:
        """After a failure before training started: close, and take away the run directory if this
        run created it and nothing but start-up files is in it."""
        try:
            self.close()
        finally:
            if self.mesh.is_main:
                self.session.directory.remove_if_unused()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- logging -------------------------------------------------------------------------------------

    def _describe(self) -> None:
        cfg, mesh, c = self.cfg, self.mesh, self.components
        n_probes = len(c.estimator.dealt_plan())
        log.info("%s", c.task.describe())
        log.info("Model %s: %s", cfg.model.name, c.engine.adapter.describe())
        optimizer = "" if type(c.optimizer) is SGD else f" and optimizer {c.optimizer.describe()}"
        log.info("Training %s with %s (q=%d, eps=%g, %s directions)%s, seed %d, mesh %s (%d probes per step over %d "
                 "perturbation ranks, batch %d over %d data ranks), engine: %s, run dir %s", self._trainable(),
                 cfg.estimator.name, cfg.estimator.q, cfg.estimator.eps, cfg.estimator.distribution, optimizer,
                 self.seed, mesh.shape, n_probes, mesh.shape.pert, cfg.batch_size, mesh.shape.data,
                 c.engine.describe(), self.run_dir.resolve())
        if mesh.shape.pert > n_probes:
            log.warning("mesh P=%d exceeds the %d probes a step needs: %d perturbation ranks idle; raise "
                        "estimator.q to use them", mesh.shape.pert, n_probes, mesh.shape.pert - n_probes)

    def _trainable(self) -> str:
        """What trains: the count, and which set (distzo's peft, or what a model handed over marks
        trainable: a PEFT model's adapter, say)."""
        c, method = self.components, self.cfg.peft.method
        trainable, total = c.params.numel(), sum(p.numel() for p in c.model.parameters())
        count = f"{trainable / 1e6:.2f}M" if trainable >= 1e5 else f"{trainable:,}"
        if method != "none":
            return f"{count} parameters (peft={method})"
        if trainable < total:
            return f"{count} of {total / 1e6:.2f}M parameters (those the model marks trainable; peft=none)"
        return f"{count} parameters (peft=none)"

    def _log_step(self, step: int, out: StepOutcome, step_time: float, moved_before: dict[str, float]) -> None:
        """The step's metrics line, then its trajectory record (what resume and replay re-apply), and
        progress. In that order: a kill between the two leaves a metrics line that resume drops with
        the step (logs are cut to the last trajectory step, and the step runs again), where the other
        order would leave a re-applied step without its metrics line."""
        cfg, result, lr, batch = self.cfg, out.result, out.lr, out.batch
        transfers = self._step_transfers(moved_before)  # collective (offloading): before either line
        self.metrics.write("train", step=step + 1, loss=result.loss, projected_grad=result.grads[0],
                           projected_grads=list(result.grads), lr=lr, tokens=batch.tokens,
                           step_time_s=round(step_time, 4), tokens_per_s=round(batch.tokens / step_time, 1),
                           **transfers, peak_mem_bytes=peak_memory_bytes(self.mesh.device))
        identity = self.checkpoints.identity  # Gaussian directions: who drew them (resume and replay compare)
        drawn = {"drawn_by": identity["gaussian_generator"]} if identity["distribution"] == "gaussian" else {}
        self.trajectory.append({"step": step + 1, "update": step,
                                "coefficients": [list(c) for c in out.coefficients], "lr": lr,
                                "weight_decay": cfg.optim.weight_decay, "grads": list(result.grads), **drawn})
        ema = self._loss_ema
        self._loss_ema = result.loss if ema is None else 0.9 * ema + 0.1 * result.loss
        self._progress.update(step + 1, f"loss {self._loss_ema:.4f} lr {lr:.2e} {step_time:.2f}s/step",
                              force=(step + 1) % cfg.log_every == 0, pace_s=step_time)

    def _optimizer_summary(self) -> dict[str, Any]:
        """The optimizer and its state's memory: one copy's bytes, and what the node holds of it
        (summed over the node's ranks: one copy where they share it, one per rank where not)."""
        copy, node = self.components.optimizer_memory()
        return {"optimizer": self.components.optimizer.name, "optimizer_state_bytes": copy,
                "optimizer_state_node_bytes": node}

    def _host_master_summary(self) -> dict[str, Any]:
        """An offloaded master's host memory: one copy's size, and what the node holds resident of
        it (summed over the node's ranks: one copy when node-shared, one per rank when not); nothing
        for an engine without one."""
        mem, node = self.components.engine.host_master_bytes(), self.mesh.node
        if not mem:
            return {}
        (node_resident,) = node.all_sum([mem["resident"]])
        return {"host_master_copy_bytes": mem["copy"], "host_master_node_bytes": int(node_resident),
                "node_ranks": node.size, "comm_sliced": bool(mem["node_shared"])}

    def _step_transfers(self, before: dict[str, float]) -> dict[str, Any]:
        """This step's offloading traffic: this rank's bytes per link and transfer time, and the bytes
        its whole node moved over the host link (one collective over the node's ranks); nothing for
        an engine that moves no weights."""
        now = self.components.engine.transfer_stats()
        if not now:
            return {}
        mine = {k: now[k] - before[k] for k in now}
        self._step_h2d.append(mine["h2d_bytes"])
        h2d_node, d2h_node = self.mesh.node.all_sum([mine["h2d_bytes"], mine["d2h_bytes"]])
        return {"h2d_bytes_per_rank": int(mine["h2d_bytes"]), "d2h_bytes_per_rank": int(mine["d2h_bytes"]),
                "peer_bytes_per_rank": int(mine["peer_bytes"]), "h2d_bytes_node": int(h2d_node),
                "d2h_bytes_node": int(d2h_node), "transfer_s": round(mine["transfer_s"], 4)}

    def _skip_nonfinite(self, step: int, losses: torch.Tensor) -> int:
        """A step whose losses are not finite changes nothing; too many in a row stop the run with a
        valid snapshot of the (unchanged) weights."""
        in_a_row, cfg = self._nonfinite + 1, self.cfg
        self.metrics.write("train", step=step + 1, skipped=True, losses=[float(x) for x in losses])
        self.trajectory.append({"step": step + 1, "update": step, "skipped": True})
        log.warning("step %d: non-finite loss %s; step skipped (%d in a row, limit %d)", step + 1,
                    [float(x) for x in losses], in_a_row, cfg.max_nonfinite_steps)
        if in_a_row >= cfg.max_nonfinite_steps:
            if cfg.checkpoint.every:
                self.checkpoints.save(self.components.engine, step + 1, in_a_row)
            raise TrainingError(f"{in_a_row} steps in a row had non-finite losses (last at step {step + 1}); the "
                                f"weights were left unchanged{' and snapshotted' if cfg.checkpoint.every else ''}. "
                                f"Start a new run (another run directory) with a lower optim.lr (now {cfg.optim.lr:g}) "
                                f"or estimator.eps (now {cfg.estimator.eps:g}): resume=auto continues only the same "
                                "settings, which meet the same losses")
        return in_a_row


def train(cfg: Config | DictConfig, run_dir: str | Path | RunDirectory | None = None, *,
          callbacks: Sequence[Callback] = (), validate_config: bool = True, **kwargs: Any) -> Summary:
    """Train a configuration to the end: `Trainer(cfg, run_dir, ...).fit()`, closed afterwards."""
    with Trainer(cfg, run_dir, callbacks=callbacks, validate_config=validate_config, **kwargs) as trainer:
        return trainer.fit()
