"""The training driver: DESIGN §2's step, top to bottom.

    batch -> plan -> my evaluations on my shard -> exchange (loss sum, count) -> projected
    gradients -> identical update on every rank -> log

Everything the loop needs is built once by `build_run`; `train` is the loop itself. On a PxD mesh
each rank runs the evaluations dealt to its perturbation index on the shard of the global batch
given to its data index; only scalars are exchanged, and every rank applies the same update.
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

from .checkpoint import atomic_write_json, save_final
from .data.tasks import ClassificationTask, TrainSampler
from .dist import Mesh, check_replicas
from .engine import ResidentEngine
from .errors import DistzoError
from .metrics import MetricsWriter, Progress, format_duration, peak_rss_bytes
from .models import adapter_for, load_model
from .objectives import accuracy_counts, cross_entropy_sums
from .zo.directions import DIRECTIONS_VERSION, Directions
from .zo.estimators import Estimator, build_estimator
from .zo.params import TrainableParams
from .zo.schedule import learning_rate

log = logging.getLogger("distzo")


class TrainingError(DistzoError):
    """Training cannot continue; the message says why and what to change."""


@dataclass
class Run:
    cfg: Any
    run_dir: Path
    mesh: Mesh
    seed: int
    model: torch.nn.Module
    tokenizer: Any
    task: ClassificationTask
    params: TrainableParams
    engine: ResidentEngine
    estimator: Estimator
    sampler: TrainSampler
    metrics: MetricsWriter


def device_kind(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("device=cuda but no CUDA device is visible; use device=cpu or device=auto")
    return name


_DEFAULT_THREADS = torch.get_num_threads()


def build_run(cfg, run_dir: Path, mesh: Mesh) -> Run:
    # Set (or restore) per run: a sweep runs several jobs in one process.
    torch.set_num_threads(cfg.threads or _DEFAULT_THREADS)
    # Rank 0 fixes the run seed (the configured one, or one it draws); every direction derives from it.
    seed = mesh.broadcast_object(cfg.seed if cfg.seed is not None else secrets.randbits(63))
    model, tokenizer = load_model(cfg.model)
    model.to(mesh.device)
    task = ClassificationTask(cfg.task, tokenizer)
    params = TrainableParams.from_model(model)
    directions = Directions(seed, cfg.estimator.distribution, mesh.device)
    engine = ResidentEngine(model, adapter_for(model), params, directions)
    estimator = build_estimator(cfg.estimator)
    metrics = MetricsWriter(run_dir / "metrics.jsonl" if mesh.is_main else None, static={"mesh": str(mesh.shape)})
    n_evals = len(estimator.plan())
    log.info("Task %s: %d train / %d validation / %d test examples; label words %s",
             task.name, task.size("train"), task.size("validation"), task.size("test"), task.label_words)
    log.info("Training %.1fM parameters with %s (q=%d, eps=%g, %s directions), seed %d, mesh %s "
             "(%d evaluations per step over %d perturbation ranks, batch %d over %d data ranks), run dir %s",
             params.numel() / 1e6, cfg.estimator.name, cfg.estimator.q, cfg.estimator.eps,
             cfg.estimator.distribution, seed, mesh.shape, n_evals, mesh.shape.pert, cfg.batch_size,
             mesh.shape.data, run_dir)
    if mesh.shape.pert > n_evals:
        log.warning("mesh P=%d exceeds the %d evaluations a step needs: %d perturbation ranks idle; raise "
                    "estimator.q to use them", mesh.shape.pert, n_evals, mesh.shape.pert - n_evals)
    return Run(cfg, run_dir, mesh, seed, model, tokenizer, task, params, engine, estimator,
               TrainSampler(task.size("train"), cfg.batch_size, seed), metrics)


def evaluate(run: Run, split: str, step: int) -> dict[str, float]:
    """Accuracy and mean cross-entropy of the master weights on a whole split, its batches dealt
    over all ranks."""
    start = time.time()
    mesh = run.mesh
    batches = list(run.task.batches(split, run.cfg.eval_batch_size))
    mine = batches[mesh.rank::mesh.world_size]
    progress = Progress(f"eval {split}", len(batches), enabled=mesh.is_main)
    correct = seen = 0
    loss_sum = 0.0
    for i, batch in enumerate(mine):
        logits = run.engine.clean_label_logits(batch, run.task.label_ids).cpu()
        c, n = accuracy_counts(logits, batch.labels)
        correct, seen = correct + c, seen + n
        loss_sum += float(cross_entropy_sums(logits[None], batch.labels)[0, 0])
        progress.update(min(len(batches), (i + 1) * mesh.world_size))
    correct, seen, loss_sum = mesh.all_sum([correct, seen, loss_sum])
    result = {"accuracy": correct / seen, "loss": loss_sum / seen, "examples": int(seen)}
    run.metrics.write("eval", step=step, split=split, **result, eval_time_s=round(time.time() - start, 3))
    log.info("step %d: %s accuracy %.4f, loss %.4f (%d examples, %s)", step, split, result["accuracy"],
             result["loss"], seen, format_duration(time.time() - start))
    return result


def check_fresh_run_dir(run_dir: Path) -> None:
    """Never mix two runs' outputs in one directory."""
    if (run_dir / "metrics.jsonl").exists():
        raise TrainingError(f"{run_dir} already holds a run (metrics.jsonl); choose another hydra.run.dir")


def train(cfg, run_dir: Path) -> dict[str, Any]:
    mesh = Mesh.create(cfg.mesh, device_kind(cfg.device), cfg.dist_timeout_s)
    try:
        run_dir = Path(mesh.broadcast_object(str(run_dir)))  # rank 0's directory (see __main__)
        if mesh.is_main:
            check_fresh_run_dir(run_dir)
        run = build_run(cfg, run_dir, mesh)
        try:
            return _train(run)
        finally:
            run.metrics.close()
            run.engine.directions.close()
    finally:
        mesh.close()


def _train(run: Run) -> dict[str, Any]:
    cfg, mesh, run_dir = run.cfg, run.mesh, run.run_dir
    label_ids, eps = run.task.label_ids, run.estimator.eps
    first = last = evaluate(run, "validation", 0)
    progress = Progress("train step", cfg.steps, every_s=15.0, enabled=mesh.is_main)
    wall_start, step_times, loss_ema = time.time(), [], None
    for step in range(cfg.steps):
        started = time.perf_counter()
        batch = run.task.batch("train", run.sampler.indices(step))              # the global batch
        shard = batch.shard(mesh.data_rank, mesh.shape.data)                     # my data shard
        plan = run.estimator.plan()                                               # every forward
        mine = mesh.my_evaluations(len(plan))                                     # dealt over P
        local = torch.zeros(len(plan), 2, dtype=torch.float64)
        if mine:
            logits = run.engine.label_logits(shard, label_ids, [plan[i] for i in mine], step, eps)
            local[mine] = cross_entropy_sums(logits.cpu(), shard.labels)          # (loss sum, count)
        sums = mesh.exchange(local)                                               # global, on every rank
        losses = sums[:, 0] / sums[:, 1]
        if not torch.isfinite(losses).all():
            raise TrainingError(f"non-finite loss at step {step + 1}: {losses.tolist()}; lower optim.lr "
                                f"(now {cfg.optim.lr:g}) or estimator.eps (now {eps:g})")
        result = run.estimator.combine(losses)                                    # projected gradients
        lr = learning_rate(step, cfg.optim.lr, cfg.steps, cfg.optim.schedule, cfg.optim.warmup_steps)
        run.engine.update(step, result.coefficients, lr, cfg.optim.weight_decay)  # same on every rank
        step_time = time.perf_counter() - started
        step_times.append(step_time)

        run.metrics.write("train", step=step + 1, loss=result.loss, projected_grad=result.grads[0],
                          projected_grads=list(result.grads), lr=lr, tokens=batch.tokens,
                          step_time_s=round(step_time, 4), tokens_per_s=round(batch.tokens / step_time, 1))
        loss_ema = result.loss if loss_ema is None else 0.9 * loss_ema + 0.1 * result.loss
        progress.update(step + 1, f"loss {loss_ema:.4f} lr {lr:.2e} {step_time:.2f}s/step",
                        force=(step + 1) % cfg.log_every == 0)
        if cfg.replica_check_every and (step + 1) % cfg.replica_check_every == 0 and step + 1 < cfg.steps:
            check_replicas(mesh, run.params, step + 1)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            last = evaluate(run, "validation", step + 1)

    replica_checksums = check_replicas(mesh, run.params, cfg.steps)
    if cfg.steps:
        last = evaluate(run, "validation", cfg.steps)
    test = evaluate(run, "test", cfg.steps)
    summary = {
        "steps": cfg.steps, "seed": run.seed, "mesh": str(mesh.shape), "directions_version": DIRECTIONS_VERSION,
        "validation_accuracy_before": first["accuracy"], "validation_accuracy_after": last["accuracy"],
        "test_accuracy": test["accuracy"], "train_time_s": round(sum(step_times), 1),
        "step_time_s": round(statistics.median(step_times), 3) if step_times else math.nan,
        "wall_time_s": round(time.time() - wall_start, 1),
        "peak_rss_bytes": peak_rss_bytes(), "trainable_parameters": run.params.numel(),
        "replica_checksums": replica_checksums,  # every rank's, in rank order: identical (checked)
    }
    if mesh.is_main:
        if cfg.save_final:
            path = save_final(run.model, run.tokenizer, run_dir / "final")
            summary["final_weights"] = str(path)
            log.info("Saved trained weights to %s", path)
        atomic_write_json(run_dir / "summary.json", summary)
    run.metrics.write("summary", **summary)
    log.info("Validation accuracy %.4f -> %.4f after %d steps (%s training, median %.2f s/step); "
             "test accuracy %.4f", first["accuracy"], last["accuracy"], cfg.steps,
             format_duration(summary["train_time_s"]), summary["step_time_s"], test["accuracy"])
    return summary
