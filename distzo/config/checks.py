"""Checks of a configuration that its types cannot express and that need nothing but the
configuration (distzo.run.checks adds what needs the models, data and mesh layers).

Every number of the configuration is checked: floats must be finite (NaN and infinity pass every
comparison they are not meant to), and each field with a range in its metadata (`schema.setting`;
an estimator's or optimizer's own settings declare theirs beside their class) must be within it;
the switches are spelled right; rules between keys hold. Raises `ConfigError`.
"""

from __future__ import annotations

import math
import operator
from dataclasses import fields, is_dataclass
from typing import Any, Iterator

from ..errors import ConfigError
from .schema import SWITCH_VALUES, Config, switch

SWITCHES = ("engine.fuse_update", "engine.divide_work", "engine.native", "engine.copy_stream", "engine.decode_cache",
            "bench.single_rank")
_COMPARISONS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


def _number(text: str) -> float:
    base, _, exponent = text.partition("**")
    return float(base) ** float(exponent) if exponent else float(base)


def within(value: float, bound: str) -> bool:
    """Whether `value` satisfies a range of field metadata: comparisons joined by "and" ("> 0",
    ">= 0 and < 1", ">= 0 and < 2**63")."""
    for part in bound.split(" and "):
        op, limit = part.split()
        if not _COMPARISONS[op](value, _number(limit)):
            return False
    return True


def check_range(bound: str) -> None:
    """A range's text is one `within` reads (a component's settings are checked when registered)."""
    try:
        within(0, bound)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"range {bound!r} is not comparisons joined by 'and' (e.g. '>= 0 and < 1')") from exc


def settings_fields(node: Any, prefix: str = "") -> Iterator[tuple[str, Any, dict]]:
    """(dotted key, value, field metadata) of every leaf of a configuration's dataclasses; the numbers
    inside dicts and lists are leaves with no metadata."""
    if is_dataclass(node):
        for f in fields(node):
            value = getattr(node, f.name)
            if is_dataclass(value) or isinstance(value, (dict, list, tuple)):
                yield from settings_fields(value, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", value, dict(f.metadata)
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from settings_fields(value, f"{prefix}{key}.") if isinstance(value, (dict, list, tuple)) else [
                (f"{prefix}{key}", value, {})]
    else:
        for i, value in enumerate(node):
            yield from settings_fields(value, f"{prefix}{i}.") if isinstance(value, (dict, list, tuple)) else [
                (f"{prefix}{i}", value, {})]


def check_numbers(cfg: Config) -> None:
    """Every float finite; every number within its field's range."""
    for key, value, metadata in settings_fields(cfg):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not a finite number; give a finite value")
        bound = metadata.get("range")
        if bound and not within(value, bound):
            if key == "seed":
                raise ConfigError(f"seed={value} is out of range; use 0 <= seed < 2**63, or seed=null to draw one")
            raise ConfigError(f"{key}={value} is out of range; it must be {bound}")


def check_values(cfg: Config) -> None:
    """The checks of a configuration that need nothing but the configuration: every number in range,
    the switches spelled right, and the rules between keys. Raises ConfigError."""
    check_numbers(cfg)
    for key in SWITCHES:
        section, name = key.split(".")
        value = switch(getattr(getattr(cfg, section), name))
        if value not in SWITCH_VALUES:
            raise ConfigError(f"{key}={value!r} is not supported; use one of: {', '.join(SWITCH_VALUES)}")
    pe = cfg.peft
    if cfg.model.quantize != "none" and pe.method == "none":
        raise ConfigError(f"model.quantize={cfg.model.quantize} quantizes a frozen base, and peft=none trains every "
                          "weight of it; add peft=lora (or lora_fa, prefix), or use model.quantize=none")
    if str(cfg.engine.quantized_matmul) == "decoded" and cfg.model.quantize == "none":
        raise ConfigError(f"engine.quantized_matmul={cfg.engine.quantized_matmul} sets how a quantized base "
                          "multiplies, and model.quantize=none quantizes nothing; add model.quantize=int8 (or int4), "
                          "or drop engine.quantized_matmul")
    if pe.method in ("lora", "lora_fa") and not pe.targets:
        raise ConfigError(f"peft={pe.method} needs at least one target layer name in peft.targets "
                          "(e.g. [q_proj,v_proj])")
    if cfg.optim.warmup_steps > cfg.steps:
        raise ConfigError(f"optim.warmup_steps={cfg.optim.warmup_steps} is longer than the run (steps={cfg.steps}), "
                          f"whose learning rate would never reach optim.lr; set optim.warmup_steps <= {cfg.steps}")
    if cfg.offload.transfer_dtype is not None and cfg.offload.mode == "none":
        raise ConfigError("offload.transfer_dtype only applies to offloaded blocks; add offload=cpu")
    if cfg.keep_best is not None and not cfg.eval_every:
        raise ConfigError(f"keep_best={cfg.keep_best} picks among the validation evaluations during training, and "
                          f"eval_every=0 runs none; set eval_every (MeZO validates every steps/5, here "
                          f"eval_every={max(1, cfg.steps // 5)}), or drop keep_best")
