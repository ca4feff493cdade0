"""The training driver: the step of docs/architecture.md#one-step, top to bottom.

    batch -> plan -> my probes on my shard -> exchange (sum, count) -> projected gradients ->
    identical update on every rank -> log -> (snapshot, evaluation)

`start_run` builds everything once (resuming where an interrupted run left off, resume=auto);
`_train` is the loop. On a PxD mesh each rank runs the probes dealt to its perturbation index on
the shard of the global batch given to its data index; only scalars are exchanged, and every rank
applies the same update. How the engine runs its part is fixed when `build_engine` picks its mode
(docs/architecture.md#engines) and is not the driver's concern.
"""

from __future__ import annotations

import logging
import math
import secrets
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import DistzoError
from ..parallel.consistency import check_replicas
from ..parallel.mesh import Mesh
from ..state.resume import (
    Checkpointer,
    ResumePoint,
    catch_up,
    check_identity,
    find_resume_point,
    truncate_logs,
)
from ..state.snapshots import atomic_write_json, save_final
from ..telemetry.jsonl import JsonlWriter
from ..telemetry.metrics import (
    MetricsWriter,
    Progress,
    format_duration,
    peak_memory_bytes,
    peak_rss_bytes,
)
from ..telemetry.sinks import open_sinks
from ..zo.directions import DIRECTIONS_VERSION
from ..zo.schedule import learning_rate
from .components import Components, build_components
from .evaluation import Evaluator, headline
from .signals import Stopped, StopRequests

log = logging.getLogger("distzo")


class TrainingError(DistzoError):
    """Training cannot continue; the message says why and what to change."""


@dataclass
class Run(Components):
    """A training run: the components plus its directory, logs and resume point."""

    run_dir: Path = Path(".")
    start_step: int = 0  # updates already done (0, or where a resumed run continues)
    nonfinite_in_a_row: int = 0  # consecutive skipped steps before start_step
    metrics: MetricsWriter | None = None
    trajectory: JsonlWriter | None = None
    checkpoints: Checkpointer | None = None
    evaluator: Evaluator | None = None

    def close(self) -> None:
        self.metrics.close()
        self.trajectory.close()
        super().close()


@dataclass
class StepOutcome:
    batch: Any  # the global batch
    losses: torch.Tensor  # mean loss of every probe over the global batch
    result: Any  # the estimator's StepResult, or None when the step was skipped
    lr: float


def zo_step(c: Components, step: int) -> StepOutcome:
    """One ZO-SGD step on the mesh; every rank returns the same outcome."""
    cfg, mesh, engine, estimator = c.cfg, c.mesh, c.engine, c.estimator
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
    with engine.timers("comm"):
        sums = mesh.exchange(local)                                          # global, on every rank
    losses = sums[:, 0] / sums[:, 1]
    lr = learning_rate(step, cfg.optim.lr, cfg.steps, cfg.optim.schedule, cfg.optim.warmup_steps)
    if not torch.isfinite(losses).all():                                     # skip, never update
        return StepOutcome(batch, losses, None, lr)
    result = estimator.combine(losses)                                       # projected gradients
    engine.apply(step, result.coefficients, lr, cfg.optim.weight_decay)      # same on every rank
    return StepOutcome(batch, losses, result, lr)


_DEFAULT_THREADS = torch.get_num_threads()


def prepare_run_dir(run_dir: Path, resume: str) -> None:
    """Never mix two runs in one directory: a used directory is refused unless resuming."""
    if (run_dir / "metrics.jsonl").exists() and resume == "never":
        raise TrainingError(f"{run_dir} already holds a run (metrics.jsonl); choose another hydra.run.dir "
                            "or add resume=auto to continue it")


def start_run(cfg, run_dir: Path, mesh: Mesh) -> Run:
    """Everything the loop needs; with resume=auto, the weights and logs of the step an interrupted
    run reached (its newest snapshot, then the steps logged after it, re-applied)."""
    torch.set_num_threads(cfg.threads or _DEFAULT_THREADS)  # set (or restored) per run: a sweep runs several
    point: ResumePoint | None = find_resume_point(cfg, run_dir, mesh)
    if point is not None:
        seed = check_identity(cfg, point.snapshot or str(run_dir), point.identity)
    else:  # rank 0 fixes the run seed (the configured one, or one it draws); every direction derives from it
        seed = mesh.broadcast_object(cfg.seed if cfg.seed is not None else secrets.randbits(63))
    c = build_components(cfg, mesh, seed, weights=point.weights() if point is not None else None)
    start, nonfinite = 0, 0
    if point is not None:
        if point.snapshot is not None:
            log.info("Resuming from %s (step %d of %d)", point.snapshot, point.snapshot_step, cfg.steps)
        if point.records:
            log.info("Re-applying the %d step(s) logged after %s (trajectory.jsonl), no forward passes",
                     len(point.records), "it" if point.snapshot else "the initial weights")
        nonfinite = catch_up(c.engine, point.records, point.nonfinite_in_a_row, mesh.is_main)
        start = point.step
        if mesh.is_main:
            truncate_logs(run_dir, start)
    sinks = open_sinks(cfg, run_dir, {"world_size": mesh.world_size, "pert": mesh.shape.pert, "data": mesh.shape.data,
                                      "nodes": mesh.world_size // mesh.node.size, "seed": seed}) if mesh.is_main else []
    metrics = MetricsWriter(run_dir / "metrics.jsonl" if mesh.is_main else None, static={"mesh": str(mesh.shape)},
                            sinks=sinks)
    trajectory = JsonlWriter(run_dir / "trajectory.jsonl" if mesh.is_main else None)
    checkpoints = Checkpointer(cfg, run_dir, mesh, seed, trajectory)
    if point is None:
        checkpoints.start()
    evaluator = Evaluator(c.task, c.engine, mesh, cfg.eval_batch_size, metrics)
    run = Run(**vars(c), run_dir=run_dir, start_step=start, nonfinite_in_a_row=nonfinite, metrics=metrics,
              trajectory=trajectory, checkpoints=checkpoints, evaluator=evaluator)
    describe_run(run)
    return run


def describe_run(run: Run) -> None:
    cfg, mesh, task, params, estimator = run.cfg, run.mesh, run.task, run.params, run.estimator
    n_evals = len(estimator.dealt_plan())
    log.info("%s", task.describe())
    log.info("Model %s: %s", cfg.model.name, run.engine.adapter.describe())
    log.info("Training %.2fM parameters (peft=%s) with %s (q=%d, eps=%g, %s directions), seed %d, mesh %s "
             "(%d probes per step over %d perturbation ranks, batch %d over %d data ranks), engine: %s, "
             "run dir %s", params.numel() / 1e6, cfg.peft.method, cfg.estimator.name, cfg.estimator.q,
             cfg.estimator.eps, cfg.estimator.distribution, run.seed, mesh.shape, n_evals, mesh.shape.pert,
             cfg.batch_size, mesh.shape.data, run.engine.describe(), run.run_dir)
    if mesh.shape.pert > n_evals:
        log.warning("mesh P=%d exceeds the %d probes a step needs: %d perturbation ranks idle; raise "
                    "estimator.q to use them", mesh.shape.pert, n_evals, mesh.shape.pert - n_evals)


def train(cfg, run_dir: Path) -> dict[str, Any]:
    mesh = Mesh.create(cfg.mesh, str(cfg.device), cfg.dist_timeout_s)
    try:
        run_dir = Path(mesh.broadcast_object(str(run_dir)))  # rank 0's directory (see __main__)
        if mesh.is_main:
            prepare_run_dir(run_dir, cfg.resume)
        with StopRequests() as stop:
            run = start_run(cfg, run_dir, mesh)
            try:
                return _train(run, stop)
            finally:
                run.close()
    finally:
        mesh.close()


def _train(run: Run, stop: StopRequests) -> dict[str, Any]:
    cfg, mesh = run.cfg, run.mesh
    first = run.evaluator.run("validation", 0) if run.start_step == 0 else None
    progress = Progress("train step", cfg.steps, every_s=15.0, enabled=mesh.is_main)
    wall_start, step_times, loss_ema, nonfinite = time.time(), [], None, run.nonfinite_in_a_row
    for step in range(run.start_step, cfg.steps):
        moved_before = run.engine.transfer_stats()
        started = time.perf_counter()
        out = zo_step(run, step)                     # batch, plan, forwards, exchange, update
        if out.result is None:                       # non-finite losses: skipped, weights unchanged
            nonfinite = skip_nonfinite_step(run, step, out.losses, nonfinite)
        else:
            nonfinite = 0
            step_time = time.perf_counter() - started
            step_times.append(step_time)
            loss_ema = log_step(run, step, out, step_time, moved_before, loss_ema, progress)
        done = step + 1
        if stop.agreed(mesh):                        # SIGTERM / SIGUSR1 / SIGINT on any rank
            with stop.holding():
                path = run.checkpoints.save(run.engine, done, nonfinite)
            raise Stopped(done, stop.name, str(path) if path else None)
        if cfg.replica_check_every and done % cfg.replica_check_every == 0 and done < cfg.steps:
            with run.engine.materialized() as weights:  # compare current masters
                check_replicas(mesh, [p.tensor for p in weights.params], done)
        if run.checkpoints.due(done):
            with stop.holding():
                run.checkpoints.save(run.engine, done, nonfinite)
        if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
            run.evaluator.run("validation", done)

    with run.engine.materialized() as weights:      # owed updates reach the master before it is checked
        replica_checksums = check_replicas(mesh, [p.tensor for p in weights.params], cfg.steps)
    if cfg.checkpoint.every and not run.checkpoints.due(cfg.steps) and cfg.steps > run.start_step:
        run.checkpoints.save(run.engine, cfg.steps, nonfinite)  # the end of the run, if not on the cadence
    last = run.evaluator.run("validation", cfg.steps)
    test = run.evaluator.run("test", cfg.steps)
    summary = {
        "steps": cfg.steps, "resumed_from_step": run.start_step, "seed": run.seed, "mesh": str(mesh.shape),
        "directions_version": DIRECTIONS_VERSION,
        "validation_accuracy_before": first["accuracy"] if first else None,
        "validation_accuracy_after": last["accuracy"], "test_accuracy": test["accuracy"],
        "train_time_s": round(sum(step_times), 1),
        "step_time_s": round(statistics.median(step_times), 3) if step_times else math.nan,
        "wall_time_s": round(time.time() - wall_start, 1),
        "peak_rss_bytes": peak_rss_bytes(), "peak_mem_bytes": peak_memory_bytes(mesh.device),
        "trainable_parameters": run.params.numel(), "offload": str(cfg.offload.mode),
        **host_master_summary(run), "engine": run.engine.mode, "engine_description": run.engine.describe(),
        "replica_checksums": replica_checksums,  # every rank's, in rank order: identical (checked)
    }
    for key in ("f1", "perplexity"):  # generation: accuracy is the exact match (None for whole texts)
        if key in last:
            summary.update({f"validation_{key}_before": first[key] if first else None,
                            f"validation_{key}_after": last[key], f"test_{key}": test[key]})
    if cfg.save_final:
        with run.engine.materialized() as weights:
            if mesh.is_main:
                path = save_final(weights.model, run.tokenizer, run.run_dir / "final", weights.params, cfg)
                summary["final_weights"] = str(path)
                log.info("Saved trained weights to %s", path)
    if mesh.is_main:
        atomic_write_json(run.run_dir / "summary.json", summary)
    run.metrics.write("summary", **summary)
    log.info("Validation %s -> %s after %d steps (%s training, median %.2f s/step); test %s",
             headline(first) if first else f"(resumed at step {run.start_step})", headline(last), cfg.steps,
             format_duration(summary["train_time_s"]), summary["step_time_s"] if step_times else float("nan"),
             headline(test))
    return summary


def log_step(run: Run, step: int, out: StepOutcome, step_time: float, moved_before: dict[str, float],
             loss_ema: float | None, progress: Progress) -> float:
    """The step's trajectory record (what resume and replay re-apply), metrics line and progress."""
    cfg, result, lr, batch = run.cfg, out.result, out.lr, out.batch
    run.trajectory.append({"step": step + 1, "update": step, "coefficients": [list(c) for c in result.coefficients],
                           "lr": lr, "weight_decay": cfg.optim.weight_decay, "grads": list(result.grads)})
    transfers = step_transfers(run, moved_before) if cfg.offload.mode != "none" else {}
    run.metrics.write("train", step=step + 1, loss=result.loss, projected_grad=result.grads[0],
                      projected_grads=list(result.grads), lr=lr, tokens=batch.tokens,
                      step_time_s=round(step_time, 4), tokens_per_s=round(batch.tokens / step_time, 1),
                      **transfers, peak_mem_bytes=peak_memory_bytes(run.mesh.device))
    loss_ema = result.loss if loss_ema is None else 0.9 * loss_ema + 0.1 * result.loss
    progress.update(step + 1, f"loss {loss_ema:.4f} lr {lr:.2e} {step_time:.2f}s/step",
                    force=(step + 1) % cfg.log_every == 0)
    return loss_ema


def host_master_summary(run: Run) -> dict[str, Any]:
    """The offloaded master's host memory: one copy's size, and what the node holds resident of it
    (summed over the node's ranks: one copy when node-shared, one per rank when not)."""
    if run.cfg.offload.mode == "none":
        return {}
    mem = run.engine.host_master_bytes()
    (node_resident,) = run.mesh.node.all_sum([mem["resident"]])
    return {"host_master_copy_bytes": mem["copy"], "host_master_node_bytes": int(node_resident),
            "node_ranks": run.mesh.node.size, "comm_sliced": run.engine.mode == "offload-sliced"}


def step_transfers(run: Run, before: dict[str, float]) -> dict[str, Any]:
    """This step's offloading traffic: this rank's bytes per link and transfer time, and the bytes
    its whole node moved over the host link (one collective over the node's ranks)."""
    now = run.engine.transfer_stats()
    mine = {k: now[k] - before[k] for k in now}
    h2d_node, d2h_node = run.mesh.node.all_sum([mine["h2d_bytes"], mine["d2h_bytes"]])
    return {"h2d_bytes_per_rank": int(mine["h2d_bytes"]), "d2h_bytes_per_rank": int(mine["d2h_bytes"]),
            "peer_bytes_per_rank": int(mine["peer_bytes"]), "h2d_bytes_node": int(h2d_node),
            "d2h_bytes_node": int(d2h_node), "transfer_s": round(mine["transfer_s"], 4)}


def skip_nonfinite_step(run: Run, step: int, losses: torch.Tensor, in_a_row: int) -> int:
    """A step whose losses are not finite changes nothing; too many in a row stop the run with a
    valid snapshot of the (unchanged) weights."""
    in_a_row += 1
    cfg = run.cfg
    run.metrics.write("train", step=step + 1, skipped=True, losses=[float(x) for x in losses])
    run.trajectory.append({"step": step + 1, "update": step, "skipped": True})
    log.warning("step %d: non-finite loss %s; step skipped (%d in a row, limit %d)", step + 1,
                [float(x) for x in losses], in_a_row, cfg.max_nonfinite_steps)
    if in_a_row >= cfg.max_nonfinite_steps:
        if cfg.checkpoint.every:
            run.checkpoints.save(run.engine, step + 1, in_a_row)
        raise TrainingError(f"{in_a_row} steps in a row had non-finite losses (last at step {step + 1}); the weights "
                            f"were left unchanged{' and snapshotted' if cfg.checkpoint.every else ''}. Lower optim.lr "
                            f"(now {cfg.optim.lr:g}) or estimator.eps (now {cfg.estimator.eps:g}), then resume=auto")
    return in_a_row
