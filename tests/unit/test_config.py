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
    written = {k: v for k, v in _leaves(yaml.safe_load(CONF.read_text()))
               if k != "defaults" and not k.startswith("hydra")}
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


def test_the_layers_below_the_run_receive_the_schema_dataclasses(monkeypatch):
    """The configuration is converted once where a run is built (distzo.config.compose.typed): the
    model loader, the task, the estimator, the optimizer, PEFT and the engine receive the schema's
    dataclass sections, their choices as Enums, not Hydra's DictConfig."""
    from omegaconf import DictConfig

    from distzo.config import schema
    from distzo.config.compose import typed
    from distzo.parallel.mesh import Mesh
    from distzo.run import components
    from tests.conftest import make_config

    seen = {}

    def spy(name, label, pick):
        real = getattr(components, name)

        def call(*args, **kwargs):
            seen[label] = pick(args, kwargs)
            return real(*args, **kwargs)
        monkeypatch.setattr(components, name, call)

    spy("load_model", "model", lambda a, k: a[0])
    spy("PromptTask", "task", lambda a, k: a[0])
    spy("build_estimator", "estimator", lambda a, k: a[0])
    spy("build_optimizer", "optim", lambda a, k: a[0])
    spy("apply_peft", "peft", lambda a, k: a[1])
    spy("build_engine", "engine", lambda a, k: (k["engine"], k["offload"]))
    cfg = make_config("model=tiny", "task=synthetic-cue", "optim.name=adam", "peft=lora")
    assert isinstance(cfg, DictConfig)
    c = components.build_components(cfg, Mesh.single(), 0)
    c.close()
    assert isinstance(seen["model"], schema.ModelConfig) and isinstance(seen["task"], schema.TaskConfig)
    assert isinstance(seen["estimator"], schema.EstimatorConfig) and isinstance(seen["optim"], schema.OptimConfig)
    assert isinstance(seen["peft"], schema.PeftConfig)
    assert isinstance(seen["engine"][0], schema.EngineConfig) and isinstance(seen["engine"][1], schema.OffloadConfig)
    assert isinstance(seen["estimator"].name, schema.EstimatorName) and isinstance(seen["optim"].adam,
                                                                                 schema.AdamSettings)
    assert typed(typed(cfg)) == typed(cfg)
