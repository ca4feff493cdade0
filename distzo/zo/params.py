"""The set of parameters a ZO run perturbs and updates, in one canonical order.

Tied tensors (for example an LM head sharing the token embedding) appear once, under their first
name, so they are perturbed and updated once, with one z (MeZO's `named_parameters()` behaviour;
ZO2 perturbs them twice). Each parameter's direction stream is keyed by its canonical name, not by
its position, so adding or freezing other parameters never changes the z a parameter receives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import nn

from ..errors import DistzoError
from .directions import param_key


@dataclass
class TrainableParam:
    name: str
    tensor: torch.Tensor
    key: int
    decay: bool
    aliases: tuple[str, ...] = field(default_factory=tuple)

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    def numel(self) -> int:
        return self.tensor.numel()


def _no_decay(name: str, owner: nn.Module) -> bool:
    """MeZO exempts biases and layer norms from weight decay (by name: "bias", "layer_norm",
    "layernorm"). Llama-style models name their final norm plain `norm`, so decide by the owning
    module's class instead: any normalisation layer, plus every bias."""
    return name.endswith("bias") or "norm" in type(owner).__name__.lower()


class TrainableParams:
    """Ordered, de-duplicated trainable parameters of a model (those with requires_grad)."""

    def __init__(self, entries: list[TrainableParam]):
        self.entries = entries
        self._by_name = {}
        for p in entries:
            self._by_name[p.name] = p
            for alias in p.aliases:
                self._by_name[alias] = p

    @classmethod
    def from_model(cls, model: nn.Module) -> TrainableParams:
        owners = {}
        for mod_name, module in model.named_modules():
            for p_name, _ in module.named_parameters(recurse=False):
                owners[f"{mod_name}.{p_name}" if mod_name else p_name] = module
        first: dict[int, TrainableParam] = {}
        entries: list[TrainableParam] = []
        for name, tensor in model.named_parameters(remove_duplicate=False):
            if not tensor.requires_grad:
                continue
            seen = first.get(id(tensor))
            if seen is not None:
                seen.aliases = seen.aliases + (name,)
                continue
            entry = TrainableParam(name, tensor, param_key(name), not _no_decay(name, owners[name]))
            first[id(tensor)] = entry
            entries.append(entry)
        return cls(entries)

    def get(self, name: str) -> TrainableParam | None:
        return self._by_name.get(name)

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def numel(self) -> int:
        return sum(p.numel() for p in self.entries)

    def load(self, tensors: Mapping[str, torch.Tensor], origin: str = "the snapshot") -> None:
        """Copy `tensors` (by canonical name, exactly this set's names) into the trainable tensors."""
        names = {p.name for p in self.entries}
        if set(tensors) != names:
            raise DistzoError(f"{origin} holds other parameters than this model trains (missing "
                              f"{sorted(names - set(tensors))[:3]}, extra {sorted(set(tensors) - names)[:3]}); "
                              "use the model, peft and estimator settings it was written with")
        with torch.no_grad():
            for p in self.entries:
                p.tensor.copy_(tensors[p.name])
