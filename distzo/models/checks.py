"""What a model configuration names exists and is usable, before anything loads: a tokenizer folder,
an installed wheel, a local causal-LM folder with whole weights, a random architecture that builds.
Raises ConfigError with the path and the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from .assets import check_installed
from .loading import check_weight_files, random_model

ENCODER_ONLY = ("bert", "roberta", "deberta", "deberta-v2", "distilbert", "electra", "albert", "xlm-roberta",
                "t5", "mt5", "bart", "mbart", "pegasus", "marian", "whisper", "vit")


def _readable_dir(path: str, key: str, what: str) -> Path:
    folder = Path(os.path.expanduser(path))
    if not folder.is_dir():
        raise ConfigError(f"{key}={path!r} does not exist or is not a folder; pass the folder of {what}")
    if not os.access(folder, os.R_OK | os.X_OK):
        raise ConfigError(f"{key}={path!r} is not readable by this user; fix its permissions or copy it elsewhere")
    return folder


def check_local_model(path: str) -> None:
    """A transformers causal-LM folder: config.json readable and valid, a causal-LM architecture,
    weights present."""
    folder = _readable_dir(path, "model.path", "a local transformers causal LM (config.json plus weights)")
    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError(f"model.path={path!r} has no config.json; it must be a transformers model folder "
                          "(as written by save_pretrained)")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"model.path={path!r}: cannot read config.json ({exc}); it must be the JSON that "
                          "save_pretrained writes") from None
    if model_type in ENCODER_ONLY:
        raise ConfigError(f"model.path={path!r} holds a {model_type!r} model, which is not a decoder-only causal LM; "
                          "distzo fine-tunes AutoModelForCausalLM models")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"model.path={path!r} holds a {model_type!r} model, which this transformers release has "
                          "no causal-LM class for (AutoModelForCausalLM); upgrade transformers, or convert the "
                          "model to a supported architecture")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ConfigError(f"model.path={path!r} has no weights (*.safetensors or *.bin); save the model with "
                          "save_pretrained into that folder")
    check_weight_files(folder)


def check_model_config(m: Any) -> None:
    """The `model` group: its files exist and are readable, its architecture builds."""
    if m.tokenizer not in (None, "smollm2"):
        _readable_dir(str(m.tokenizer), "model.tokenizer", "a tokenizer (tokenizer.json or its vocabulary files), "
                      "or 'smollm2'")
    if m.path and m.source != "local":
        raise ConfigError(f"model.path={m.path!r} is only read by model=hf (a local folder); the {m.name} preset "
                          f"ignores it. Use model=hf model.path={m.path}")
    if str(m.source).endswith("-wheel"):
        check_installed(str(m.source))
    if m.source == "local":
        if not m.path:
            raise ConfigError("model=hf needs a folder: add model.path=/path/to/a/transformers/model")
        check_local_model(str(m.path))
    if m.source == "random":
        # Built on the meta device (no memory, instant): shape errors surface here, not mid-run.
        random_model(str(m.arch), 1024, dict(m.arch_config), 0, getattr(torch, str(m.dtype)), device="meta")
