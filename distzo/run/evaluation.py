"""Evaluation of the current weights on a whole split, its batches dealt over every rank; and the
`python -m distzo eval` command, which scores a model without training.

The engine materialises the weights first (owed updates applied, peers in step); each rank then
scores its own batches at the master weights with no collectives (ranks may hold different numbers
of batches), and one all-reduce adds the counts.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..data.answers import exact_match, f1_score
from ..data.objectives import accuracy_counts, objective_sums
from ..engine import Engine
from ..errors import DistzoError
from ..parallel.mesh import Mesh
from ..telemetry.metrics import MetricsWriter, Progress, format_duration

log = logging.getLogger("distzo")


class EvalError(DistzoError):
    """`eval` cannot evaluate what it was pointed at."""


class Evaluator:
    def __init__(self, task, engine: Engine, mesh: Mesh, batch_size: int, metrics: MetricsWriter | None = None):
        self.task, self.engine, self.mesh, self.batch_size, self.metrics = task, engine, mesh, batch_size, metrics

    def run(self, split: str, step: int) -> dict[str, Any]:
        """The current weights' metrics on `split` (every rank calls it together): accuracy and the
        candidates' cross-entropy for classification and multiple choice; for generation the
        completion's token loss and the exact match and F1 of greedy answers (`accuracy` is then the
        exact match)."""
        start = time.time()
        mesh = self.mesh
        batches = list(self.task.batches(split, self.batch_size))
        mine = batches[mesh.rank::mesh.world_size]
        generation = self.task.kind == "generation"
        decodes = generation and self.task.decodes
        progress = Progress(f"eval {split}", len(batches), enabled=mesh.is_main)
        correct = seen = 0
        loss_sum = loss_count = f1_total = 0.0
        with self.engine.materialized() as weights:
            for i, batch in enumerate(mine):
                scores = weights.score(batch)
                s, k = objective_sums(scores, batch, "loss").tolist()
                loss_sum, loss_count = loss_sum + s, loss_count + k
                if decodes:
                    answers = weights.generate(self.task, batch.extra["prompts"])
                    em = sum(exact_match(a, ok) for a, ok in zip(answers, batch.extra["answers"]))
                    f1 = sum(f1_score(a, ok) for a, ok in zip(answers, batch.extra["answers"]))
                    correct, seen, f1_total = correct + em, seen + batch.size, f1_total + f1
                elif generation:  # language modelling: the token loss alone
                    seen += batch.size
                else:
                    c, n = accuracy_counts(scores, batch)
                    correct, seen = correct + c, seen + n
                progress.update(min(len(batches), (i + 1) * mesh.world_size))
        correct, seen, loss_sum, loss_count, f1_total = mesh.all_sum([correct, seen, loss_sum, loss_count, f1_total])
        result = {"accuracy": correct / seen if not generation or decodes else None, "loss": loss_sum / loss_count,
                  "examples": int(seen)}
        if generation:
            result["perplexity"] = math.exp(min(result["loss"], 700.0))  # of the completion tokens
        if decodes:
            result.update(exact_match=correct / seen, f1=f1_total / seen)
        elapsed = time.time() - start
        if self.metrics is not None:
            self.metrics.write("eval", step=step, split=split, **result, eval_time_s=round(elapsed, 3))
        scores_text = headline(result)
        log.info("step %d: %s %s, loss %.4f (%d examples, %s)", step, split, scores_text, result["loss"], seen,
                 format_duration(elapsed))
        return result


def headline(result: dict[str, Any]) -> str:
    """An evaluation's main figures as text: accuracy (classification, multiple choice), exact match
    and F1 (generation), or perplexity (language modelling on whole texts)."""
    if "f1" in result:
        return f"exact match {result['exact_match']:.4f}, F1 {result['f1']:.4f}"
    if result.get("accuracy") is None:
        return f"perplexity {result['perplexity']:.4f}"
    return f"accuracy {result['accuracy']:.4f}"


# --- python -m distzo eval -------------------------------------------------------------------------

FINAL_MODEL, FINAL_ADAPTER = "model.safetensors", "adapter.safetensors"


def run_overrides(run: Path) -> list[str]:
    """How `eval.run=RUN` is evaluated: the overrides the run was trained with (its model, trainable
    set, task; not its directory, mesh or resume policy), then what its `final/` holds: a whole model
    is loaded as a local model folder, an adapter on top of the run's model (`final_adapter`)."""
    from omegaconf import OmegaConf

    saved = run / ".hydra" / "overrides.yaml"
    final = run / "final"
    if not saved.is_file():
        raise EvalError(f"eval.run={run} is not a distzo run directory (no .hydra/overrides.yaml); give the "
                        "hydra.run.dir of a training run")
    if not (final / FINAL_MODEL).is_file() and not (final / FINAL_ADAPTER).is_file():
        raise EvalError(f"eval.run={run} has no trained weights ({final}/{FINAL_MODEL} or {FINAL_ADAPTER}); the run "
                        "must have finished with save_final=true")
    skip = ("hydra", "mesh", "resume", "eval", "steps", "checkpoint", "logger", "seed")
    kept = [o for o in OmegaConf.load(saved) if str(o).split("=", 1)[0].lstrip("+~").split(".")[0].split("/")[0] not in skip]
    if (final / FINAL_MODEL).is_file():
        kept += ["model.source=local", f"model.path={final.resolve()}"]
    return kept


def final_adapter(run: str | None) -> dict[str, torch.Tensor] | None:
    """The trained adapter tensors of `eval.run` (by canonical name), or None (a whole model, or no run)."""
    if not run:
        return None
    path = Path(run) / "final" / FINAL_ADAPTER
    return load_file(str(path)) if path.is_file() else None


def evaluate(cfg, run_dir: Path) -> dict[str, Any]:
    """Score `cfg`'s model on `eval.split` of its task, every rank taking a share of the batches;
    writes `eval.json` and a metrics line in the run directory (rank 0)."""
    from .components import build_components

    mesh = Mesh.create(cfg.mesh, str(cfg.device), cfg.dist_timeout_s)
    try:
        run_dir = Path(mesh.broadcast_object(str(run_dir)))
        torch.set_num_threads(cfg.threads or torch.get_num_threads())
        c = build_components(cfg, mesh, cfg.seed or 0, weights=final_adapter(cfg.eval.run))
        try:
            metrics = MetricsWriter(run_dir / "metrics.jsonl" if mesh.is_main else None, static={"mesh": str(mesh.shape)})
            log.info("%s", c.task.describe())
            split = str(cfg.eval.split)
            result = Evaluator(c.task, c.engine, mesh, cfg.eval_batch_size, metrics).run(split, 0)
            result = {"split": split, "model": cfg.model.name, "task": cfg.task.name, "demos": cfg.task.demos,
                      "run": cfg.eval.run, **result}
            metrics.close()
            if mesh.is_main:
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
                print(f"{cfg.task.name} {split}: {headline(result)}, loss {result['loss']:.4f} "
                      f"({result['examples']} examples)", flush=True)
            return result
        finally:
            c.close()
    finally:
        mesh.close()
