"""Evaluation of the current weights on a whole split, its batches dealt over every rank; and the
`python -m distzo eval` command, which scores a model without training.

The engine materialises the weights first (pending updates applied, peers in step); each rank then
scores its own batches at the master weights with no collectives (ranks may hold different numbers
of batches), and one all-reduce adds the counts.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict
from safetensors.torch import load_file

from ..config.compose import saved_form, typed, upgrade_overrides
from ..config.schema import Config
from ..data.answers import exact_match, f1_score
from ..data.objectives import accuracy_counts, objective_sums
from ..engine import Engine
from ..errors import ConfigError, DistzoError
from ..parallel.launch_env import launched_world_size
from ..parallel.mesh import Mesh
from ..state.saved import FINAL_ADAPTER, FINAL_MODEL, final_weights, load_run_config, recorded_sources
from ..state.snapshots import atomic_write_json
from ..telemetry.metrics import MetricsWriter, Progress, format_duration
from .checks import validate
from .hub_pins import HubPins, fetch_hub_pins
from .rundir import RunDirectory
from .session import Session

log = logging.getLogger("distzo")


class Evaluator:
    def __init__(self, task, engine: Engine, mesh: Mesh, batch_size: int, metrics: MetricsWriter | None = None):
        self.task, self.engine, self.mesh, self.batch_size, self.metrics = task, engine, mesh, batch_size, metrics

    def run(self, split: str, step: int, **extra: Any) -> dict[str, Any]:
        """The current weights' metrics on `split` (every rank calls it together): accuracy and the
        candidates' cross-entropy for classification and multiple choice; for generation the
        completion's token loss and the exact match and F1 of greedy answers (`accuracy` is then the
        exact match). extra: fields of its metrics line besides them."""
        start = time.time()
        mesh = self.mesh
        batches = list(self.task.batches(split, self.batch_size))
        mine = batches[mesh.rank::mesh.world_size]
        generation = not self.task.scores_candidates  # answers (decoded) or tokens (language modelling)
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
        if not seen:  # an empty split (a task without one): nothing to score
            result = {"accuracy": None, "loss": math.nan, "examples": 0}
            log.info("step %d: %s split is empty; nothing to evaluate", step, split)
            return result
        result = {"accuracy": correct / seen if not generation or decodes else None, "loss": loss_sum / loss_count,
                  "examples": int(seen)}
        if generation:
            result["perplexity"] = math.exp(min(result["loss"], 700.0))  # of the completion tokens
        if decodes:
            result.update(exact_match=correct / seen, f1=f1_total / seen)
        elapsed = time.time() - start
        if self.metrics is not None:
            self.metrics.write("eval", step=step, split=split, **result, eval_time_s=round(elapsed, 3), **extra)
        scores_text = headline(result)
        whose = f", the weights of step {extra['weights_step']}" if "weights_step" in extra else ""
        log.info("step %d: %s %s, loss %.4f (%d examples, %s%s)", step, split, scores_text, result["loss"], seen,
                 format_duration(elapsed), whose)
        return result


def headline(result: dict[str, Any]) -> str:
    """An evaluation's main figures as text: accuracy (classification, multiple choice), exact match
    and F1 (generation), or perplexity (language modelling on whole texts)."""
    if not result.get("examples"):
        return "no examples"
    if "f1" in result:
        return f"exact match {result['exact_match']:.4f}, F1 {result['f1']:.4f}"
    if result.get("accuracy") is None:
        return f"perplexity {result['perplexity']:.4f}"
    return f"accuracy {result['accuracy']:.4f}"


# --- evaluating a model without training (python -m distzo eval) -----------------------------------

# The parts of a run's configuration that say what was trained; the rest (mesh, batch sizes, the
# split) is the evaluation's own.
RUN_SECTIONS = ("model", "peft", "task", "estimator")


def evaluation_config(run: str | Path, cfg: DictConfig, overrides: Sequence[str] = ()) -> DictConfig:
    """The configuration that evaluates run `run`: `cfg` with the run's model, trainable set, task
    and estimator settings (its saved configuration) and its final weights, except what `overrides`
    (the command line that composed `cfg`) sets explicitly, which wins."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    run_cfg = load_run_config(run, key="eval.run")
    weights = final_weights(run)
    overrides = upgrade_overrides(list(overrides))  # what the command line set, in today's spelling
    parsed = OverridesParser.create().parse_overrides(overrides)
    keys = [o.key_or_group for o in parsed]
    # The run's trained weights are what eval.run evaluates (eval.json names the run): another model
    # in their place would be scored under the run's name (the run's own preset named again is not).
    other = [o.key_or_group for o in parsed if o.key_or_group != "model" or o.value() != run_cfg.model.name]
    swapped = [k for k in ("model", "model.path", "model.source") if k in other]
    if weights.name == FINAL_MODEL and swapped:
        raise ConfigError(f"eval.run={run} evaluates the run's trained weights ({weights}), and {swapped[0]}= on the "
                          "command line would score another model in their place; drop it, or drop eval.run to "
                          "evaluate that model with these settings")
    base_keys = (["model", "init_seed"], ["model", "arch_config"])  # what else draws another random base
    rebased = [k for k in other if k == "model" or k.split(".")[:2] in base_keys]
    if weights.name != FINAL_MODEL and rebased:
        raise ConfigError(f"eval.run={run} puts the run's adapter ({weights}) on the base model it was trained on "
                          f"(model={run_cfg.model.name}), and {rebased[0]}= on the command line would put it on "
                          "another; drop it (model.path= names where the same base model lives now)")
    cfg = copy.deepcopy(cfg)
    for section in RUN_SECTIONS:
        if section in keys:  # a preset chosen on the command line (task=sst2): the command line's
            continue
        mine = copy.deepcopy(run_cfg[section])
        for key in keys:
            if key.startswith(section + "."):
                OmegaConf.update(mine, key[len(section) + 1:], OmegaConf.select(cfg, key), merge=False)
        with open_dict(cfg):
            cfg[section] = mine
    if weights.name == FINAL_MODEL:
        cfg.model.source, cfg.model.path = "local", str(weights.parent.resolve())
    return cfg


def evaluate(cfg: Config | DictConfig, run_dir: str | Path | RunDirectory | None = None, *,
             overrides: Sequence[str] = (), validate_config: bool = True) -> dict[str, Any]:
    """Score a model on `eval.split` of its task, without training, every rank taking a share of the
    batches; writes eval.json and a metrics line in the run directory (rank 0). With `eval.run`,
    the model is that run's trained one with its own settings (`evaluation_config`). Under torchrun
    the default mesh 1x1 becomes 1xN (evaluation deals its batches over every rank, whatever the
    shape)."""
    from .components import build_components

    try:
        if cfg.eval.run:
            cfg = evaluation_config(cfg.eval.run, saved_form(cfg) if isinstance(cfg, Config) else cfg, overrides)
        cfg = typed(cfg)  # the one conversion: every layer below receives the typed sections
        world = launched_world_size()
        if world > 1 and str(cfg.mesh) == "1x1":
            cfg = replace(cfg, mesh=f"1x{world}")
        if validate_config:
            validate(cfg)
    except DistzoError:
        if isinstance(run_dir, RunDirectory):
            run_dir.remove_if_unused()  # the command line created it for this evaluation
        raise
    session = Session(cfg, run_dir, resumable=False)  # an evaluation continues no run
    try:
        mesh, run_dir = session.mesh, session.run_dir
        weights = final_weights(cfg.eval.run) if cfg.eval.run else None
        adapter = load_file(str(weights)) if weights is not None and weights.name == FINAL_ADAPTER else None
        # A run's evaluation reads the hub commits that run read, not the branches' newer ones.
        recorded = HubPins.from_record(recorded_sources(cfg.eval.run)) if cfg.eval.run else None
        c = build_components(cfg, mesh, session.seed(), weights=adapter, sources=fetch_hub_pins(cfg, mesh, recorded))
        try:
            log.info("%s", c.task.describe())
            metrics = MetricsWriter(run_dir / "metrics.jsonl" if mesh.is_main else None,
                                    static={"mesh": str(mesh.shape)})
            split = str(cfg.eval.split)
            result = Evaluator(c.task, c.engine, mesh, cfg.eval_batch_size, metrics).run(split, 0)
            result = {"split": split, "model": cfg.model.name, "task": cfg.task.name, "demos": cfg.task.demos,
                      "run": cfg.eval.run, **result}
            metrics.close()
            if mesh.is_main:
                atomic_write_json(run_dir / "eval.json", result)  # strict JSON, whole or not at all
                print(f"{cfg.task.name} {split}: {headline(result)}, loss {result['loss']:.4f} "
                      f"({result['examples']} examples)", flush=True)
            return result
        finally:
            c.close()
    except BaseException:
        if session.mesh.is_main:
            session.directory.remove_if_unused()
        raise
    finally:
        session.close()
