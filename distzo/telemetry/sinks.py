"""Metrics sinks: where `MetricsWriter` forwards every metrics.jsonl record besides the file.

`logger=wandb` adds a Weights & Biases run (rank 0 only; the writer of other ranks has no sinks).
Offline by default: the run is a folder under <run dir>/wandb that `wandb sync` uploads later, so
training never needs a network or an account. distzo passes no credentials to wandb and logs
nothing from the environment.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol

from omegaconf import OmegaConf

from ..config.compose import saved_form
from ..config.schema import Config
from ..errors import DistzoError

log = logging.getLogger("distzo")


class SinkError(DistzoError):
    """A metrics sink cannot start; the message says how to fix or disable it."""


class MetricsSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _scalars(record: dict[str, Any], prefix: str) -> dict[str, float]:
    """Numeric fields only (lists such as projected_grads and strings such as the mesh are in the
    config or metrics.jsonl already)."""
    skip = {"type", "step", "split", "time"}
    return {f"{prefix}/{k}": v for k, v in record.items()
            if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool)}


class WandbSink:
    """One wandb run per training run: train lines under train/, eval lines under <split>/ at
    their step, the summary line in the run summary."""

    def __init__(self, cfg: Config, run_dir: Path, mesh_info: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise SinkError("logger=wandb needs the wandb package: pip install wandb (or use logger=none)") from None
        lc = cfg.logger
        mode = os.environ.get("WANDB_MODE") or lc.mode  # the environment wins, as wandb users expect
        config = OmegaConf.to_container(saved_form(cfg), enum_to_str=True)
        config["launch"] = mesh_info  # world size, P, D, nodes, run seed
        run_dir.mkdir(parents=True, exist_ok=True)
        # console="off": stdout stays the training log's, not a copy captured by wandb;
        # x_disable_stats: no system-metrics sampler competing with training for CPU.
        try:
            self.run = wandb.init(project=lc.project, entity=lc.entity, group=lc.group, tags=list(lc.tags),
                                  name=lc.run_name or run_dir.name, dir=str(run_dir), mode=mode, config=config,
                                  settings=wandb.Settings(console="off", x_disable_stats=True, silent=True,
                                                          save_code=False))
        except Exception as exc:  # wandb raises several types (no login, no network, bad entity)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SinkError(f"logger=wandb could not start an {mode} run ({first}); use logger.mode=offline "
                            "(the default) or logger=none") from None
        log.info("wandb: %s run %s in %s", mode, self.run.id, getattr(self.run, "dir", run_dir))

    def write(self, record: dict[str, Any]) -> None:
        kind = record.get("type")
        if kind == "summary":
            self.run.summary.update({k: v for k, v in record.items() if k not in ("type", "time")
                                     and isinstance(v, (int, float, str)) and not isinstance(v, bool)})
            return
        prefix = record.get("split", "eval") if kind == "eval" else str(kind)
        data = _scalars(record, prefix)
        if data:
            self.run.log(data, step=int(record.get("step", 0)))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def open_sinks(cfg: Config, run_dir: Path, mesh_info: dict[str, Any]) -> list[MetricsSink]:
    """The sinks `logger` selects (rank 0 calls this; other ranks log nothing)."""
    if cfg.logger.name == "wandb":
        return [WandbSink(cfg, run_dir, mesh_info)]
    return []
