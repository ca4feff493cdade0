"""Which adapter drives a model: the family's dedicated one, the general path, or the whole-model
fallback (docs/models.md)."""

from __future__ import annotations

import logging

from torch import nn

from .adapters import ADAPTERS, DecoderAdapter, UnsupportedModelError
from .generic import GenericDecoderAdapter
from .whole import WholeModelAdapter

log = logging.getLogger(__name__)


def adapter_for(model: nn.Module, path: str = "auto") -> DecoderAdapter:
    """The adapter that drives `model`: the family's dedicated one (path auto or dedicated), else the
    general path (`distzo.models.generic`, path auto or general), else (auto) the whole-model
    fallback (`distzo.models.whole`)."""
    model_type = getattr(model.config, "model_type", "?")
    cls = ADAPTERS.get(model_type)
    if cls is not None and path in ("auto", "dedicated"):
        try:
            adapter = cls(model)
        except UnsupportedModelError as dedicated:
            if path == "dedicated":
                raise
            return _whole_model(model, dedicated)  # the general path reads the same layers as the dedicated one
        log.info("%s runs on the dedicated %s adapter", type(model).__name__, cls.family)
        return adapter
    if path == "whole":
        return WholeModelAdapter(model)
    if path == "dedicated":
        raise UnsupportedModelError(f"model type {model_type!r} has no dedicated adapter (those: "
                                    f"{', '.join(sorted(ADAPTERS))}); use model.adapter=auto or general")
    try:
        return GenericDecoderAdapter(model)
    except UnsupportedModelError as general:
        if path == "general":
            raise
        return _whole_model(model, general)


def _whole_model(model: nn.Module, why: UnsupportedModelError) -> DecoderAdapter:
    """The whole-model fallback, for a model `why` says the layer-driving paths cannot run."""
    try:
        adapter = WholeModelAdapter(model)
    except UnsupportedModelError as whole:
        raise UnsupportedModelError(f"{why}; the whole-model fallback cannot run it either: "
                                    f"{str(whole).split(': ', 1)[-1]}") from None
    log.warning("%s; falling back to the whole model (stock forward, every parameter perturbed at once, no "
                "offloading)", why)
    return adapter
