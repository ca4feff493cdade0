"""Engines run a step's forward evaluations and its update; they differ in where weights live."""

from __future__ import annotations

import torch

from .base import StagedEngine
from .offload import OffloadEngine
from .resident import ResidentEngine


def build_engine(cfg, model, adapter, params, directions) -> StagedEngine:
    """The engine a run config asks for (`offload`, `engine`), with the model placed accordingly."""
    off, opts = cfg.offload, cfg.engine
    if off.mode == "cpu":
        dtype = getattr(torch, off.transfer_dtype) if off.transfer_dtype else None
        engine = OffloadEngine(model, adapter, params, directions, slots=off.slots, transfer_dtype=dtype,
                               row_tokens=opts.row_tokens)
    else:
        model.to(directions.device)
        engine = ResidentEngine(model, adapter, params, directions, row_tokens=opts.row_tokens)
    fuse = str(opts.fuse_update).lower()
    engine.fuse_update = directions.distribution == "rademacher" if fuse == "auto" else fuse == "true"
    return engine


__all__ = ["OffloadEngine", "ResidentEngine", "StagedEngine", "build_engine"]
