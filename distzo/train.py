"""The training driver: DESIGN §2's step, top to bottom.

    batch -> plan -> evaluate (perturbed forwards) -> losses -> projected gradients -> update -> log

Everything the loop needs is built once by `build_run`; `train` is the loop itself.
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
    seed: int
    model: torch.nn.Module
    tokenizer: Any
    task: ClassificationTask
    params: TrainableParams
    engine: ResidentEngine
    estimator: Estimator
    sampler: TrainSampler
    metrics: MetricsWriter


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("device=cuda but no CUDA device is visible; use device=cpu or device=auto")
    return torch.device(name)


def build_run(cfg, run_dir: Path) -> Run:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    seed = cfg.seed if cfg.seed is not None else secrets.randbits(63)
    model, tokenizer = load_model(cfg.model)
    model.to(device)
    task = ClassificationTask(cfg.task, tokenizer)
    params = TrainableParams.from_model(model)
    directions = Directions(seed, cfg.estimator.distribution, device)
    engine = ResidentEngine(model, adapter_for(model), params, directions)
    metrics = MetricsWriter(run_dir / "metrics.jsonl")
    log.info("Task %s: %d train / %d validation / %d test examples; label words %s",
             task.name, task.size("train"), task.size("validation"), task.size("test"), task.label_words)
    log.info("Training %.1fM parameters with %s (q=%d, eps=%g, %s directions), seed %d, run dir %s",
             params.numel() / 1e6, cfg.estimator.name, cfg.estimator.q, cfg.estimator.eps,
             cfg.estimator.distribution, seed, run_dir)
    return Run(cfg, run_dir, seed, model, tokenizer, task, params, engine, build_estimator(cfg.estimator),
               TrainSampler(task.size("train"), cfg.batch_size, seed), metrics)


def evaluate(run: Run, split: str, step: int) -> dict[str, float]:
    """Accuracy and mean cross-entropy of the master weights on a whole split."""
    start = time.time()
    total = run.task.size(split)
    progress = Progress(f"eval {split}", total)
    correct = seen = 0
    loss_sum = 0.0
    for batch in run.task.batches(split, run.cfg.eval_batch_size):
        logits = run.engine.clean_label_logits(batch, run.task.label_ids).cpu()
        c, n = accuracy_counts(logits, batch.labels)
        correct, seen = correct + c, seen + n
        loss_sum += float(cross_entropy_sums(logits[None], batch.labels)[0, 0])
        progress.update(seen)
    result = {"accuracy": correct / seen, "loss": loss_sum / seen, "examples": seen}
    run.metrics.write("eval", step=step, split=split, **result, eval_time_s=round(time.time() - start, 3))
    log.info("step %d: %s accuracy %.4f, loss %.4f (%d examples, %s)", step, split, result["accuracy"],
             result["loss"], seen, format_duration(time.time() - start))
    return result


def train(cfg, run_dir: Path) -> dict[str, Any]:
    run_dir = Path(run_dir)
    run = build_run(cfg, run_dir)
    label_ids, eps = run.task.label_ids, run.estimator.eps
    first = evaluate(run, "validation", 0)
    last = first
    progress = Progress("train step", cfg.steps, every_s=15.0)
    wall_start = time.time()
    step_times: list[float] = []
    loss_ema = None
    for step in range(cfg.steps):
        started = time.perf_counter()
        batch = run.task.batch("train", run.sampler.indices(step))            # the global batch
        plan = run.estimator.plan()                                             # which forwards
        logits = run.engine.label_logits(batch, label_ids, plan, step, eps)     # perturbed forwards
        sums = cross_entropy_sums(logits.cpu(), batch.labels)                   # (loss sum, count)
        losses = sums[:, 0] / sums[:, 1]
        if not torch.isfinite(losses).all():
            raise TrainingError(f"non-finite loss at step {step + 1}: {losses.tolist()}; lower optim.lr "
                                f"(now {cfg.optim.lr:g}) or estimator.eps (now {eps:g})")
        result = run.estimator.combine(losses)                                  # projected gradients
        lr = learning_rate(step, cfg.optim.lr, cfg.steps, cfg.optim.schedule, cfg.optim.warmup_steps)
        run.engine.update(step, result.coefficients, lr, cfg.optim.weight_decay)  # theta -= lr sum c_k z_k
        step_time = time.perf_counter() - started
        step_times.append(step_time)

        run.metrics.write("train", step=step + 1, loss=result.loss, projected_grad=result.grads[0],
                          projected_grads=list(result.grads), lr=lr, tokens=batch.tokens,
                          step_time_s=round(step_time, 4), tokens_per_s=round(batch.tokens / step_time, 1))
        loss_ema = result.loss if loss_ema is None else 0.9 * loss_ema + 0.1 * result.loss
        progress.update(step + 1, f"loss {loss_ema:.4f} lr {lr:.2e} {step_time:.2f}s/step",
                        force=(step + 1) % cfg.log_every == 0)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            last = evaluate(run, "validation", step + 1)

    if cfg.steps:
        last = evaluate(run, "validation", cfg.steps)
    test = evaluate(run, "test", cfg.steps)
    summary = {
        "steps": cfg.steps, "seed": run.seed, "directions_version": DIRECTIONS_VERSION,
        "validation_accuracy_before": first["accuracy"], "validation_accuracy_after": last["accuracy"],
        "test_accuracy": test["accuracy"], "train_time_s": round(sum(step_times), 1),
        "step_time_s": round(statistics.median(step_times), 3) if step_times else math.nan,
        "wall_time_s": round(time.time() - wall_start, 1),
        "peak_rss_bytes": peak_rss_bytes(), "trainable_parameters": run.params.numel(),
    }
    if cfg.save_final:
        path = save_final(run.model, run.tokenizer, run_dir / "final")
        summary["final_weights"] = str(path)
        log.info("Saved trained weights to %s", path)
    atomic_write_json(run_dir / "summary.json", summary)
    run.metrics.write("summary", **summary)
    run.metrics.close()
    run.engine.directions.close()
    log.info("Validation accuracy %.4f -> %.4f after %d steps (%s training, median %.2f s/step); "
             "test accuracy %.4f", first["accuracy"], last["accuracy"], cfg.steps,
             format_duration(summary["train_time_s"]), summary["step_time_s"], test["accuracy"])
    return summary
