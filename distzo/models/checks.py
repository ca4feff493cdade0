"""What a model configuration names exists and is usable, before anything loads: a tokenizer folder,
an installed wheel, a local causal-LM folder with whole weights, a random architecture that builds (a
hub id is checked once fetched), and once a model is built, that it can hold the task's sequences.
Raises ConfigError with the path and the fix."""

from __future__ import annotations

import json
from typing import Callable

import torch

from ..config.schema import ModelConfig
from ..errors import ConfigError
from ..hub import is_hub_id
from .assets import check_installed
from .loading import _readable_dir, check_local_model, random_model


def check_model_config(m: ModelConfig) -> None:
    """The `model` group: its files exist and are readable, its architecture builds. A hub id is
    checked when it is fetched (distzo.run.hub_pins), not here: checks make no request."""
    if m.tokenizer not in (None, "smollm2") and not is_hub_id(m.tokenizer):
        _readable_dir(str(m.tokenizer), "model.tokenizer", "a tokenizer (tokenizer.json or its vocabulary files), "
                      "'smollm2', or a hub id (org/name)")
    if m.path and m.source != "local":
        raise ConfigError(f"model.path={m.path!r} is only read by model=hf (a local folder or a hub id); the {m.name} "
                          f"preset ignores it. Use model=hf model.path={m.path}")
    if m.revision is not None and not (m.source == "local" and is_hub_id(m.path)):
        raise ConfigError(f"model.revision={m.revision!r} picks a commit of a hub repository, and model.path names "
                          f"{'a local folder' if m.path else 'none'}; use model=hf model.path=org/name, or drop "
                          "model.revision")
    if str(m.source).endswith("-wheel"):
        check_installed(str(m.source))
    if m.source == "local":
        if not m.path:
            raise ConfigError("model=hf needs a model: add model.path=org/name (a hub id) or "
                              "model.path=/path/to/a/transformers/model (a local folder)")
        if not is_hub_id(m.path):
            check_local_model(str(m.path))
    if str(m.init_device) != "cpu" and m.source != "random":
        raise ConfigError(f"model.init_device={m.init_device} sets where a random model's weights are drawn; the "
                          f"{m.name} preset loads a checkpoint. Drop model.init_device")
    if m.source == "random":
        _check_architecture(str(m.arch), dict(m.arch_config), str(m.dtype))


def _check_architecture(arch: str, settings: dict, dtype: str) -> None:
    """A random architecture builds: on the meta device (no memory), so that shape errors surface
    before the run, not mid-run. Once per process for the same settings (a command checks its
    configuration up to three times, at ~40 ms a build); a failure is not remembered."""
    key = (arch, json.dumps(settings, sort_keys=True, default=repr), dtype)
    if key not in _built:
        random_model(arch, 1024, settings, 0, getattr(torch, dtype), device="meta")
        _built.add(key)


_built: set[tuple[str, str, str]] = set()  # the architectures _check_architecture has built


def check_positions(model: torch.nn.Module, longest: Callable[[], int], task: str) -> None:
    """A model with learned position embeddings (OPT, GPT-2, ...) has none beyond its configured
    maximum: refuse a task whose sequences are longer (rotary models extrapolate; they pass).
    longest(): the task's longest sequence, asked for only here (it encodes every example)."""
    learned = any(isinstance(m, torch.nn.Embedding) and name.endswith(("embed_positions", "wpe", "position_embeddings"))
                  for name, m in model.named_modules())
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not (learned and limit):
        return
    longest = longest()
    if longest > limit:
        raise ConfigError(f"task {task} has sequences of {longest} tokens, and the model's learned position embeddings "
                          f"stop at {limit}; lower task.max_length / task.max_tokens, or for a random model raise "
                          f"model.arch_config.max_position_embeddings")
