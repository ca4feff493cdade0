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
from .lora import attach_lora, check_lora_targets, lora_layers, targeted_layers
from .prefix import attach_prefix, prefix_modules


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
    # checked before anything changes: a refused run leaves the model as it was
    foreign = peft_library_layers(model)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise DistzoError(f"this model carries the peft library's adapters ({shown}), which are its trainable set; "
                          f"peft={method} would add distzo's {method} beside them and leave them untrained: drop "
                          "the peft setting (ZOArguments(peft=None), ZOTrainer's default, trains a PEFT model's own "
                          "adapter), or give the model without them")
    if carried is not None:
        _check_kept(model, cfg, carried)
    elif method in ("lora", "lora_fa"):
        check_lora_targets(model, list(cfg.targets))
    model.requires_grad_(False)
    if carried is not None:
        _train_kept(model, method)
    elif method in ("lora", "lora_fa"):
        attach_lora(model, list(cfg.targets), cfg.r, cfg.alpha, cfg.init_seed, train_a=method == "lora")
    elif method == "prefix":
        attach_prefix(model, cfg.prefix_tokens, cfg.init_seed)  # checked against the stock forward there
    else:
        raise ValueError(f"unknown peft method {cfg.method!r}")


def peft_library_layers(model: nn.Module) -> list[str]:
    """Names of the modules the peft library put into `model`: tuner layers (LoRA, IA3, ... keep the
    layer they adapt as `base_layer`) and its wrappers (modules_to_save, trainable tokens)."""
    from ..models.adapters import adapted_layer

    return [name for name, module in model.named_modules()
            if type(module).__module__.split(".", 1)[0] == "peft"
            and (adapted_layer(module) is not None or hasattr(module, "original_module"))]


def attached_peft(model: nn.Module) -> str | None:
    """What distzo's adapter on `model` is, as its settings ("lora r=8 alpha=16 targets=[q_proj, v_proj]",
    "lora_fa ...", "prefix prefix_tokens=5"), or None."""
    layers = lora_layers(model)
    if layers:
        module = layers[0][1]
        method = "lora" if module.lora_A.requires_grad else "lora_fa"
        targets = sorted({name.rsplit(".", 1)[-1] for name, _ in layers})
        return _lora_settings(method, module.lora_B.shape[1], module.lora_scale * module.lora_B.shape[1], targets)
    prefixes = prefix_modules(model)
    if prefixes:
        return f"prefix prefix_tokens={prefixes[0].prefix_keys.shape[-2]}"
    return None


def _lora_settings(method: str, r: int, alpha: float, targets) -> str:
    return f"{method} r={r} alpha={alpha:g} targets=[{', '.join(sorted(set(targets)))}]"


def _check_kept(model: nn.Module, cfg: PeftConfig, carried: str) -> None:
    """The adapter already on `model` is the one `cfg` describes (its targets: the layers they
    select, as attach_lora selects them)."""
    method = str(cfg.method)
    if method in ("lora", "lora_fa"):
        selected = {name.rsplit(".", 1)[-1] for name, _ in targeted_layers(model, list(cfg.targets))}
        wanted = _lora_settings(method, cfg.r, cfg.alpha, selected)
    else:
        wanted = f"prefix prefix_tokens={cfg.prefix_tokens}"
    if carried != wanted:
        raise DistzoError(f"this model carries distzo's {carried} adapter from an earlier run on it, and this run asks "
                          f"for {wanted}; keep that run's peft settings, or load a fresh model")


def _train_kept(model: nn.Module, method: str) -> None:
    """The adapter already on `model` as the trainable set (the rest frozen by the caller)."""
    for _, module in lora_layers(model):
        module.lora_A.requires_grad_(method == "lora")  # lora_fa: A frozen
        module.lora_B.requires_grad_(True)
    for module in prefix_modules(model):
        module.prefix_keys.requires_grad_(True)
        module.prefix_values.requires_grad_(True)


__all__ = ["apply_peft", "attach_lora", "attach_prefix", "attached_peft", "lora_layers"]
