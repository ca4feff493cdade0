"""Everything checked of a configuration before anything loads: its values
(`distzo.config.checks`), the model and the task data it names (`distzo.models.checks`,
`distzo.data.checks`), what the chosen estimator, optimizer and engine can run with (each registered
component's own `check`), and the mesh against the launched processes. One ConfigError, naming the
problem and the fix, for the first that fails."""

from __future__ import annotations

from omegaconf import DictConfig

from ..config.checks import check_values
from ..config.compose import component_of, compose_config, concrete_override_sets, typed
from ..config.schema import Config
from ..data.checks import check_task_config
from ..errors import ConfigError
from ..models.checks import check_model_config
from ..parallel.launch_env import launched_world_size
from ..parallel.shape import MeshError, MeshShape
from ..registry import registry


def check_estimator(cfg: Config) -> None:
    """The estimator the configuration names, with its own rules, and what the engine can run it with."""
    estimator = component_of(cfg.estimator, "estimator")
    e, peft = cfg.estimator, str(cfg.peft.method)
    if cfg.objective in ("f1", "exact_match") and not estimator.decodes:
        raise ConfigError(f"objective={cfg.objective} decodes answers under each of MeZO's perturbations; "
                          f"estimator={e.name} is not supported with it: use one of "
                          f"{registry('estimator').having('decodes')}")
    estimator.check(cfg)
    off = cfg.offload
    if off.mode != "none" and peft == "none" and not estimator.streams_blocks:
        raise ConfigError(f"offload={off.mode} streams full-parameter blocks for "
                          f"estimator={registry('estimator').having('streams_blocks')}; "
                          f"estimator={e.name} is not supported with offloading yet: use offload=none (or train "
                          "adapters, peft=lora, whose frozen base streams with any estimator)")
    if off.mode != "none" and peft != "none" and off.transfer_dtype is not None:
        raise ConfigError(f"offload.transfer_dtype narrows full-parameter blocks for the trip, and with peft={peft} "
                          "the frozen base streams as stored; drop offload.transfer_dtype (model.quantize=int8 or int4 "
                          "shrinks what streams)")


# The evaluation figures a run's summary holds (distzo.run.training): each as validation_<figure>_before,
# validation_<figure>_after and test_<figure> (loss, f1 and perplexity where the evaluation reports them).
SUMMARY_FIGURES = ("accuracy", "loss", "f1", "perplexity")


def check_sweep_metric(cfg: Config) -> None:
    """sweep.metric, where it names an evaluation figure, is one the summary can hold: a typo is
    refused before the run rather than after it (other summary fields are checked at its end)."""
    metric = cfg.sweep.metric
    figures = [f"{split}_{figure}{when}" for figure in SUMMARY_FIGURES
               for split, when in (("validation", "_after"), ("validation", "_before"), ("test", ""))]
    if metric.startswith(("validation_", "test_")) and metric not in figures:
        raise ConfigError(f"sweep.metric={metric} is not an evaluation figure of the run's summary; use one of: "
                          f"{', '.join(figures)}")


def validate(cfg: Config | DictConfig, check_world: bool = True) -> None:
    """Check a configuration before any model or data is loaded. Raises ConfigError.
    check_world=False skips the mesh-vs-processes check (for commands that start no mesh). A
    composed DictConfig is checked as the typed configuration it converts to."""
    cfg = typed(cfg)
    check_values(cfg)
    component_of(cfg.optim, "optimizer").check(cfg)
    check_model_config(cfg.model)
    check_task_config(cfg.task, str(cfg.objective))
    check_estimator(cfg)
    check_sweep_metric(cfg)
    try:
        shape = MeshShape.parse(cfg.mesh)
        if check_world:
            shape.check_world(launched_world_size())
    except MeshError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.batch_size < shape.data:
        raise ConfigError(f"batch_size={cfg.batch_size} is smaller than the data-parallel degree D={shape.data} "
                          f"of mesh={cfg.mesh}; every data rank needs at least one example")


def compose_and_check(overrides: list[str], multirun: bool = False, with_hydra: bool = True,
                      check_world: bool = True) -> DictConfig:
    """Compose the presets with command-line overrides and check the result (raises ConfigError);
    with multirun, every value of every sweep is checked. Returns the (first) composed config, with
    its `hydra` section when with_hydra (for the run directory and the sweep directory)."""
    first = None
    for concrete in concrete_override_sets(overrides) if multirun else [overrides]:
        cfg = compose_config(concrete, with_hydra=with_hydra)
        validate(typed(cfg), check_world=check_world)
        first = first if first is not None else cfg
    return first
