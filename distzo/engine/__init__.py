"""Engines run a step's forward evaluations and its update; they differ in where weights live."""

from __future__ import annotations

import torch

from ..dist.node import Node
from .base import StagedEngine
from .division import WorkDivision, division_applies, share_master
from .offload import OffloadEngine
from .resident import ResidentEngine


def build_engine(cfg, model, adapter, params, directions, node: Node | None = None,
                 divide: bool = False) -> StagedEngine:
    """The engine a run config asks for (`offload`, `comm`, `engine`), with the model placed
    accordingly. node: this rank's node (shared host memory, slices), when launched with peers.
    divide: resident on CPU, share the master over the node and divide noise and update work."""
    off, opts = cfg.offload, cfg.engine
    if off.mode == "cpu":
        dtype = getattr(torch, off.transfer_dtype) if off.transfer_dtype else None
        engine = OffloadEngine(model, adapter, params, directions, slots=off.slots, transfer_dtype=dtype,
                               row_tokens=opts.row_tokens, node=node, sliced=cfg.comm.sliced)
    else:
        model.to(directions.device)
        engine = ResidentEngine(model, adapter, params, directions, row_tokens=opts.row_tokens)
        if divide:
            share_master(params, node)
            engine.division = WorkDivision(node)
    fuse = str(opts.fuse_update).lower()
    engine.fuse_update = fuse != "false"
    return engine


__all__ = ["OffloadEngine", "ResidentEngine", "StagedEngine", "build_engine", "division_applies"]
