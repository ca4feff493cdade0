"""distzo: zeroth-order fine-tuning of language models with forward passes only, from one CPU to a cluster.

    import distzo

    cfg = distzo.compose("model=tiny", "task=synthetic-cue", steps=50, **{"optim.lr": 1e-3})
    summary = distzo.train(cfg, run_dir="runs/a")          # or: with distzo.Trainer(cfg) as t: t.fit()
    print(summary.test_accuracy)
    distzo.evaluate(run="runs/a", split="test")           # the trained model on its task's test split

The same functions run under torchrun or srun (every rank calls them; the mesh comes from the
environment). docs/api.md describes the API; the command line (`python -m distzo`) is a thin layer
over it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Sequence

from .environment import apply_defaults

apply_defaults()  # before torch loads: OpenMP's spin count, known import-time noise quieted (distzo.environment)

__version__ = "0.1.0"

__all__ = [
    "Callback", "ConfigError", "DistzoError", "PromptTask", "StepRecord", "Stopped", "Summary", "Trainer",
    "__version__", "bench", "compose", "evaluate", "replay", "train",
]

_LAZY = {  # name -> module: imported on first use, so `import distzo` stays light
    "Trainer": "distzo.run.training", "train": "distzo.run.training", "StepRecord": "distzo.run.training",
    "Summary": "distzo.run.training", "Callback": "distzo.run.callbacks", "Stopped": "distzo.run.signals",
    "replay": "distzo.run.replay", "bench": "distzo.run.bench", "PromptTask": "distzo.data.tasks",
    "DistzoError": "distzo.errors", "ConfigError": "distzo.errors",
}

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from .config.schema import Config
    from .data.tasks import PromptTask
    from .errors import ConfigError, DistzoError
    from .run.bench import bench
    from .run.callbacks import Callback
    from .run.replay import replay
    from .run.signals import Stopped
    from .run.training import StepRecord, Summary, Trainer, train


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'distzo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def compose(*overrides: str, config_dirs: Sequence[str | os.PathLike] = (), validate: bool = True,
            **values: Any) -> Any:
    """A run configuration: the packaged presets with command-line style `overrides`
    ("model=tiny", "optim.lr=1e-5"), then `values` set by key (`steps=50`, a preset `task="rte"`, a
    nested key by unpacking `**{"optim.lr": 1e-5}`). config_dirs: your own config directories,
    which add presets of new names (also $DISTZO_CONFIG_PATH). validate: check it as a run would
    (values, the model and data it names; not yet the mesh against the processes, which the run
    checks). Raises ConfigError with one line naming the mistake and the fix."""
    from omegaconf import OmegaConf

    from .config.compose import GROUPS, compose_config
    from .errors import ConfigError

    def as_override(key: str, value: Any) -> bool:
        """A preset chosen by its group, or a key of the estimator's or optimizer's section (which
        decides their settings' schema, and may be an earlier spelling): passed as an override."""
        section = key.split(".")[0] in ("estimator", "optim") and isinstance(value, (str, int, float))
        return (key in GROUPS and isinstance(value, str)) or section

    chosen = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items() if as_override(k, v)]
    cfg = compose_config([*overrides, *chosen], config_dirs=config_dirs)
    for key, value in values.items():
        if as_override(key, value):
            continue
        try:
            OmegaConf.update(cfg, key, value, merge=False)
        except Exception as exc:  # OmegaConf's: an unknown key, a value of the wrong type
            raise ConfigError(f"{key}={value!r}: {' '.join(str(exc).split())[:200]}") from None
    if validate:
        from .config.compose import typed
        from .run.checks import validate as check

        check(typed(cfg), check_world=False)
    return cfg


def evaluate(cfg: Config | DictConfig | None = None, run_dir: str | os.PathLike | None = None, *,
             run: str | os.PathLike | None = None, split: str | None = None,
             overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Score a model on a split of its task without training: `cfg` (default: composed from
    `overrides`), or with `run`, that run's trained model with its own model, trainable set and task
    settings (`overrides` still win). split: train, validation or test (default: eval.split, test).
    Writes eval.json in `run_dir` (default outputs/<date>/<time>) and returns the metrics."""
    from .run.evaluation import evaluate as run_evaluation

    if cfg is None:
        cfg = compose(*overrides, validate=False)
    if run is not None or split is not None:
        from .config.compose import saved_form
        from .config.schema import Config

        cfg = saved_form(cfg) if isinstance(cfg, Config) else cfg.copy()
        if run is not None:
            cfg.eval.run = str(run)
        if split is not None:
            cfg.eval.split = split
    return run_evaluation(cfg, run_dir, overrides=overrides)
