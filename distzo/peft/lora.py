"""LoRA and LoRA-FA as forward hooks on stock linear layers: y = W x + b + (alpha / r) B (A x).

A linear layer is an nn.Linear, or transformers' Conv1D (GPT-2's projections), which stores its
weight transposed ([in, out]); the low-rank term does not depend on how W is stored.
The stock layer keeps its weight and class; it gains two parameters, `lora_A` [r, in] (Kaiming-
uniform, as in MeZO's and PEFT's LoRA) and `lora_B` [out, r] (zeros, so training starts at the
pretrained model), and a forward hook adding the low-rank term. Because they are parameters of the
Linear, the engine's functional calls swap in their perturbed working copies like any other weight.

P-RGE's batched evaluation needs one B per evaluation inside a single forward: while
`stacked_b(...)` is active, the hook reads the module's stacked copies [E, out, r] (or a function
that draws them on the fly) and applies them with one batched matmul to the E equal slices of the
batch (rows [e R, (e + 1) R) belong to evaluation e).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping

import torch
from torch import nn
from torch.nn import functional as F

from ..zo.directions import param_key

# module -> stacked B copies [E, out, r], or a zero-argument function producing them (on the fly)
_STACKS: dict[nn.Module, torch.Tensor | Callable[[], torch.Tensor]] = {}


def linear_features(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a layer LoRA can adapt, or None: nn.Linear, or transformers' Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return None


def is_conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def _lora_hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    x = args[0]
    stacked = _STACKS.get(module)
    low = F.linear(x, module.lora_A)  # [..., r]
    if stacked is None:
        return output + module.lora_scale * F.linear(low, module.lora_B)
    copies = stacked() if callable(stacked) else stacked  # [E, out, r]
    E = copies.shape[0]
    flat = low.reshape(E, -1, low.shape[-1])  # evaluation e owns the e-th equal slice of the rows
    delta = torch.bmm(flat, copies.transpose(1, 2)).reshape(*output.shape)
    return output + module.lora_scale * delta


def targeted_layers(model: nn.Module, targets: list[str]) -> list[tuple[str, nn.Module]]:
    """(name, module) of every linear layer (nn.Linear or Conv1D) whose attribute name is in `targets`,
    in module order: the layers LoRA adapts."""
    return [(name, module) for name, module in model.named_modules()
            if linear_features(module) is not None and name.rsplit(".", 1)[-1] in targets]


def check_lora_targets(model: nn.Module, targets: list[str]) -> None:
    """No targeted layer carries another library's LoRA (loralib's, MeZO's: lora_B on the layer), whose
    forward would still apply its own pair after distzo's replaced it."""
    for name, module in targeted_layers(model, targets):
        if hasattr(module, "lora_B"):
            from ..errors import DistzoError

            raise DistzoError(f"peft.targets: {name} already carries another library's LoRA ({type(module).__name__} "
                              "with lora_B), and distzo's would replace its pair while its forward still applies it; "
                              "train the model's own adapter with peft=none, or load the model without it")


def attach_lora(model: nn.Module, targets: list[str], r: int, alpha: float, init_seed: int, train_a: bool) -> int:
    """Attach LoRA to every linear layer (nn.Linear or Conv1D) whose attribute name is in `targets`;
    returns how many."""
    check_lora_targets(model, targets)
    count = 0
    for name, module in targeted_layers(model, targets):
        in_features, out_features = linear_features(module)
        w = module.weight
        gen = torch.Generator().manual_seed((init_seed * 1_000_003 + param_key(name)) % (2**63))
        a = torch.empty(r, in_features, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
        module.register_parameter("lora_A", nn.Parameter(a.to(w.dtype).to(w.device), requires_grad=train_a))
        module.register_parameter("lora_B", nn.Parameter(torch.zeros(out_features, r, dtype=w.dtype,
                                                                     device=w.device)))
        module.lora_scale = alpha / r
        module.register_forward_hook(_lora_hook)
        count += 1
    if count == 0:
        from ..errors import DistzoError

        raise DistzoError(f"peft.targets={targets} matched no linear layer of this model; name the projections "
                          "to adapt (e.g. [q_proj,v_proj] for Llama, Qwen and OPT, [c_attn] for GPT-2; "
                          "docs/models.md lists each family's)")
    return count


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every linear layer carrying distzo's LoRA (`attach_lora`'s: a lora_scale beside
    lora_A and lora_B; another library's LoRA linear layer, loralib's or MeZO's, has lora_B too), in
    module order."""
    return [(n, m) for n, m in model.named_modules()
            if linear_features(m) is not None and hasattr(m, "lora_B") and hasattr(m, "lora_scale")]


@contextmanager
def stacked_b(stacks: Mapping[nn.Module, torch.Tensor | Callable[[], torch.Tensor]]) -> Iterator[None]:
    """Within the block, these LoRA layers apply per-evaluation B copies (P-RGE's batched forward)."""
    _STACKS.update(stacks)
    try:
        yield
    finally:
        for m in stacks:
            _STACKS.pop(m, None)
