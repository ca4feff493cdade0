"""Engines run a step's forward evaluations and its update; they differ in where weights live."""

from __future__ import annotations

import torch

from .base import StagedEngine
from .offload import OffloadEngine
from .resident import ResidentEngine


def build_engine(cfg, model, adapter, params, directions) -> StagedEngine:
    """The engine an `offload` config asks for, with the model placed accordingly."""
    if cfg.mode == "cpu":
        dtype = getattr(torch, cfg.transfer_dtype) if cfg.transfer_dtype else None
        return OffloadEngine(model, adapter, params, directions, slots=cfg.slots, transfer_dtype=dtype)
    model.to(directions.device)
    return ResidentEngine(model, adapter, params, directions)


__all__ = ["OffloadEngine", "ResidentEngine", "StagedEngine", "build_engine"]
