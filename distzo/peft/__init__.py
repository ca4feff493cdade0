"""Parameter-efficient trainable sets (`peft=none|lora|lora_fa|prefix`).

Each method adds its parameters to stock transformers modules (as ordinary nn.Parameters, plus a
forward hook that uses them) and freezes the rest of the model. The engine then perturbs and updates
exactly the parameters that require grad, whatever the estimator, so every estimator trains every
parameterisation, and snapshots hold only the trainable tensors.
"""

from __future__ import annotations

from torch import nn

from ..config.schema import PeftConfig
from ..errors import DistzoError
from .lora import attach_lora, lora_layers
from .prefix import attach_prefix


def apply_peft(model: nn.Module, cfg: PeftConfig) -> None:
    """Freeze the model and attach the trainable parameters `cfg` (a PeftConfig) asks for. A model
    object that carries them already (an earlier run on it: a second ZOTrainer.train(), or its
    retry with a smaller micro-batch) keeps them and trains on from their values, as a full model
    trains on from its weights; attaching again would add a second hook and reset B."""
    method = str(cfg.method)
    carried = attached_peft(model)
    if method == "none":
        if carried is not None:
            raise DistzoError(f"this model carries distzo's {carried} adapter from an earlier run on it, and peft=none "
                              "would train the frozen model under it; keep that run's peft settings, or load a fresh "
                              "model")
        return
    model.requires_grad_(False)
    if carried is not None:
        _keep(model, cfg, carried)
    elif method in ("lora", "lora_fa"):
        attach_lora(model, list(cfg.targets), cfg.r, cfg.alpha, cfg.init_seed, train_a=method == "lora")
    elif method == "prefix":
        attach_prefix(model, cfg.prefix_tokens, cfg.init_seed)  # checked against the stock forward there
    else:
        raise ValueError(f"unknown peft method {cfg.method!r}")


def attached_peft(model: nn.Module) -> str | None:
    """What distzo's adapters on `model` are, as settings ("lora r=8 alpha=16 targets=[q_proj, v_proj]",
    "prefix prefix_tokens=5"), or None."""
    layers = lora_layers(model)
    if layers:
        module = layers[0][1]
        r = module.lora_B.shape[1]
        targets = sorted({name.rsplit(".", 1)[-1] for name, _ in layers})
        return f"lora r={r} alpha={module.lora_scale * r:g} targets=[{', '.join(targets)}]"
    prefixes = [m for m in model.modules() if hasattr(m, "prefix_keys")]
    if prefixes:
        return f"prefix prefix_tokens={prefixes[0].prefix_keys.shape[-2]}"
    return None


def _keep(model: nn.Module, cfg: PeftConfig, carried: str) -> None:
    """The adapter already on `model` as the trainable set, if it is the one `cfg` describes."""
    method = str(cfg.method)
    if method in ("lora", "lora_fa"):
        wanted = f"lora r={cfg.r} alpha={cfg.alpha:g} targets=[{', '.join(sorted(set(cfg.targets)))}]"
    else:
        wanted = f"prefix prefix_tokens={cfg.prefix_tokens}"
    if carried != wanted:
        raise DistzoError(f"this model carries distzo's {carried} adapter from an earlier run on it, and this run asks "
                          f"for peft={method} with {wanted.split(' ', 1)[1]}; keep that run's peft settings, or load a "
                          "fresh model")
    for module in model.modules():
        if hasattr(module, "lora_B"):
            module.lora_A.requires_grad_(method == "lora")  # lora_fa: A frozen
            module.lora_B.requires_grad_(True)
        if hasattr(module, "prefix_keys"):
            module.prefix_keys.requires_grad_(True)
            module.prefix_values.requires_grad_(True)


__all__ = ["apply_peft", "attach_lora", "attach_prefix", "attached_peft", "lora_layers"]
