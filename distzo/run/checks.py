"""Everything checked of a composed configuration before anything loads: its values
(`distzo.config.validation`), the model and the task data it names (`distzo.models.checks`,
`distzo.data.checks`), what the chosen estimator and engine can run with, and the mesh against the
launched processes. One ConfigError, naming the problem and the fix, for the first that fails."""

from __future__ import annotations

from typing import Any

from ..config.compose import typed
from ..config.validation import check_values
from ..data.checks import check_task_config
from ..errors import ConfigError
from ..models.checks import check_model_config
from ..parallel.launch_env import launched_world_size
from ..parallel.shape import MeshError, MeshShape
from ..zo.estimators import estimator_type
from ..zo.optimizers import check_optim


def validate(cfg: Any, check_world: bool = True) -> None:
    """Check a composed config before any model or data is loaded. Raises ConfigError.
    check_world=False skips the mesh-vs-processes check (for commands that start no mesh)."""
    check_values(cfg)
    cfg = typed(cfg)  # each layer's checks receive its dataclass section
    check_optim(cfg)
    check_model_config(cfg.model)
    check_task_config(cfg.task, str(cfg.objective))
    e, peft = cfg.estimator, str(cfg.peft.method)
    estimator = estimator_type(e.name)
    if cfg.objective in ("f1", "exact_match") and not estimator.decodes:
        raise ConfigError(f"objective={cfg.objective} decodes answers under each of MeZO's perturbations; "
                          f"estimator={e.name} is not supported with it: use estimator=mezo")
    estimator.check_config(e, peft)
    off = cfg.offload
    if off.mode != "none" and peft == "none" and not estimator.streams_blocks:
        raise ConfigError(f"offload={off.mode} streams full-parameter blocks for estimator=mezo; estimator={e.name} "
                          "is not supported with offloading yet: use offload=none (or train adapters, peft=lora, "
                          "whose frozen base streams with any estimator)")
    if off.mode != "none" and peft != "none" and off.transfer_dtype is not None:
        raise ConfigError(f"offload.transfer_dtype narrows full-parameter blocks for the trip, and with peft={peft} "
                          "the frozen base streams as stored; drop offload.transfer_dtype (model.quantize=int8 or int4 "
                          "shrinks what streams)")
    try:
        shape = MeshShape.parse(cfg.mesh)
        if check_world:
            shape.check_world(launched_world_size())
    except MeshError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.batch_size < shape.data:
        raise ConfigError(f"batch_size={cfg.batch_size} is smaller than the data-parallel degree D={shape.data} "
                          f"of mesh={cfg.mesh}; every data rank needs at least one example")
