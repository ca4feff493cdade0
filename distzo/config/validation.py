"""Checks of a composed configuration that its types cannot express and that need nothing but the
configuration (distzo.run.checks adds what needs the models, data and mesh layers).

Every number of the configuration is checked: floats must be finite (NaN and infinity pass every
comparison they are not meant to), and each key has its range; the switches and modes are spelled
right; rules between keys hold. Raises `ConfigError`.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf

from ..errors import ConfigError

# key -> its bound: "> 0", ">= 0" or ">= 1". Every numeric key of the schema is listed (a test checks
# that); `seed` has a range of its own.
RANGES: dict[str, str] = {
    "model.init_seed": ">= 0",
    "task.val_size": "> 0", "task.test_size": "> 0", "task.train_size": "> 0", "task.split_seed": ">= 0",
    "task.max_length": "> 0", "task.num_examples": "> 0", "task.demos": ">= 0",
    "task.max_new_tokens": "> 0",
    "estimator.eps": "> 0", "estimator.q": ">= 1", "estimator.agzo.rank": ">= 1", "estimator.agzo.power_iters": ">= 0",
    "peft.r": "> 0", "peft.alpha": "> 0", "peft.prefix_tokens": "> 0", "peft.init_seed": ">= 0",
    "offload.slots": ">= 1",
    "checkpoint.every": ">= 0", "checkpoint.keep": "> 0",
    "engine.row_tokens": "> 0",
    "bench.warmup": "> 0", "bench.steps": "> 0",  # the training peak is taken over the warm-up steps
    "sweep.nodes": "> 0", "sweep.progress_every_s": "> 0",
    "launch.nproc": "> 0", "launch.max_restarts": ">= 0", "launch.stop_timeout_s": "> 0",
    "optim.lr": ">= 0", "optim.weight_decay": ">= 0", "optim.warmup_steps": ">= 0",
    "optim.momentum.mu": ">= 0", "optim.adam.beta1": ">= 0", "optim.adam.beta2": ">= 0", "optim.adam.eps": "> 0",
    "steps": ">= 0", "batch_size": "> 0", "micro_batch_size": "> 0", "eval_every": ">= 0", "eval_batch_size": "> 0",
    "log_every": "> 0",
    "threads": "> 0", "replica_check_every": ">= 0", "dist_timeout_s": "> 0", "max_nonfinite_steps": "> 0",
}
SWITCHES = ("engine.fuse_update", "engine.divide_work", "engine.native", "bench.single_rank")
SWITCH_VALUES = ("auto", "true", "false")


def _numbers(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every number in a config tree (bools excluded)."""
    if isinstance(node, DictConfig):
        for key in node:
            if key == "hydra":
                continue
            try:
                value = node[key]
            except Exception:  # a value that needs Hydra's runtime to resolve (${now:...})
                continue
            yield from _numbers(value, f"{prefix}{key}.")
    elif isinstance(node, ListConfig):
        for i, value in enumerate(node):
            yield from _numbers(value, f"{prefix}{i}.")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield prefix[:-1], node


def check_numbers(cfg: Any) -> None:
    """Every float finite; every key of RANGES within its range."""
    for key, value in _numbers(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not a finite number; give a finite value")
    for key, bound in RANGES.items():
        value = OmegaConf.select(cfg, key)
        if value is None:
            continue
        ok = value > 0 if bound == "> 0" else value >= (0 if bound == ">= 0" else 1)
        if not ok:
            raise ConfigError(f"{key}={value} is out of range; it must be {bound}")
    if cfg.seed is not None and not 0 <= cfg.seed < 2**63:
        raise ConfigError(f"seed={cfg.seed} is out of range; use 0 <= seed < 2**63, or seed=null to draw one")


def check_values(cfg: Any) -> None:
    """The checks of a composed config that need nothing but the config: every number in range,
    the switches and modes spelled right, and the rules between keys. Raises ConfigError."""
    check_numbers(cfg)
    for key in SWITCHES:
        value = str(OmegaConf.select(cfg, key)).lower()
        if value not in SWITCH_VALUES:
            raise ConfigError(f"{key}={value!r} is not supported; use one of: {', '.join(SWITCH_VALUES)}")
    pe = cfg.peft
    if cfg.model.quantize != "none" and pe.method == "none":
        raise ConfigError(f"model.quantize={cfg.model.quantize} quantizes a frozen base, and peft=none trains every "
                          "weight of it; add peft=lora (or lora_fa, prefix), or use model.quantize=none")
    if pe.method in ("lora", "lora_fa") and not pe.targets:
        raise ConfigError(f"peft={pe.method} needs at least one target layer name in peft.targets "
                          "(e.g. [q_proj,v_proj])")
    if cfg.offload.transfer_dtype is not None and cfg.offload.mode == "none":
        raise ConfigError("offload.transfer_dtype only applies to offloaded blocks; add offload=cpu")
