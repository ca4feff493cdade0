"""The configuration schema and the packaged config.yaml agree, and validation covers every number."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from distzo.config.compose import compose_config
from distzo.config.schema import Choice, Config
from distzo.config.validation import RANGES, check_numbers
from distzo.errors import ConfigError

CONF = Path(__file__).resolve().parents[2] / "distzo" / "config" / "presets" / "config.yaml"


def _leaves(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_config_yaml_and_the_dataclasses_agree_on_every_default():
    written = {k: v for k, v in _leaves(yaml.safe_load(CONF.read_text())) if k != "defaults" and not k.startswith("hydra")}
    schema = OmegaConf.to_container(OmegaConf.structured(Config), resolve=False)
    for key, value in written.items():
        default = OmegaConf.select(OmegaConf.create(schema), key)
        default = default.value if isinstance(default, Choice) else default
        assert default == value, f"{key}: conf/config.yaml says {value!r}, distzo/config/schema.py {default!r}"


def _numeric_keys(cls, prefix=""):
    """Dotted keys of every int or float field of a schema dataclass, nested ones included."""
    for f in dataclasses.fields(cls):
        nested = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(nested):
            yield from _numeric_keys(type(nested), f"{prefix}{f.name}.")
        elif str(f.type) in ("int", "float", "Optional[int]", "Optional[float]"):
            yield f"{prefix}{f.name}"


def test_every_number_of_the_schema_has_a_range():
    from distzo.config import schema as config

    numeric = set()
    for name, cls in [("model", config.ModelConfig), ("task", config.TaskConfig), ("estimator", config.EstimatorConfig),
                      ("peft", config.PeftConfig), ("offload", config.OffloadConfig), ("logger", config.LoggerConfig)]:
        numeric |= set(_numeric_keys(cls, f"{name}."))
    numeric |= set(_numeric_keys(Config))
    assert {"steps", "optim.lr", "estimator.agzo.rank", "checkpoint.keep", "task.val_size"} <= numeric  # it looks deep
    assert numeric - {"seed"} <= set(RANGES), sorted(numeric - {"seed"} - set(RANGES))


@pytest.mark.parametrize("key", ["estimator.eps", "optim.lr", "optim.weight_decay", "peft.alpha", "dist_timeout_s",
                                 "sweep.progress_every_s"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_numbers_are_refused(key, value):
    cfg = compose_config([f"{key}={value}"])
    with pytest.raises(ConfigError, match=f"^{key}=.* is not a finite number"):
        check_numbers(cfg)
