"""Parameter-efficient trainable sets (`peft=none|lora|lora_fa|prefix`).

Each method adds its parameters to stock transformers modules (as ordinary nn.Parameters, plus a
forward hook that uses them) and freezes the rest of the model. The engine then perturbs and updates
exactly the parameters that require grad, whatever the estimator, so every estimator trains every
parameterisation, and snapshots hold only the trainable tensors.
"""

from __future__ import annotations

from torch import nn

from ..config.schema import PeftConfig
from .lora import attach_lora, lora_layers
from .prefix import attach_prefix


def apply_peft(model: nn.Module, cfg: PeftConfig) -> None:
    """Freeze the model and attach the trainable parameters `cfg` (a PeftConfig) asks for."""
    if cfg.method == "none":
        return
    model.requires_grad_(False)
    if cfg.method in ("lora", "lora_fa"):
        attach_lora(model, list(cfg.targets), cfg.r, cfg.alpha, cfg.init_seed, train_a=cfg.method == "lora")
    elif cfg.method == "prefix":
        attach_prefix(model, cfg.prefix_tokens, cfg.init_seed)  # checked against the stock forward there
    else:
        raise ValueError(f"unknown peft method {cfg.method!r}")


__all__ = ["apply_peft", "attach_lora", "attach_prefix", "lora_layers"]
