"""Snapshots of a running job: every rank enters the engine's `materialized` context together, rank
0 writes the snapshot (docs/checkpoints.md); and the run's identity file, written when it starts."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..config.schema import CheckpointConfig
from ..engine import Engine
from ..parallel.mesh import Mesh
from ..telemetry.jsonl import JsonlWriter
from .resume import RUN_FILE
from .snapshots import atomic_write_json, write_snapshot, write_snapshot_to

log = logging.getLogger("distzo")


class Checkpointer:
    """Writes a run's snapshots (rank 0) on the `checkpoint` settings' cadence, and its identity file.
    identity: what every snapshot records of the run (`distzo.state.resume.run_identity`)."""

    def __init__(self, checkpoint: CheckpointConfig, identity: dict[str, Any], run_dir: Path, mesh: Mesh,
                 trajectory: JsonlWriter):
        self.every, self.keep = int(checkpoint.every), int(checkpoint.keep)
        self.identity, self.run_dir, self.mesh, self.trajectory = identity, run_dir, mesh, trajectory

    def start(self) -> None:
        """Record the run's identity (a fresh run), so it can be resumed before its first snapshot."""
        if self.mesh.is_main:
            atomic_write_json(self.run_dir / RUN_FILE, self.identity)

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def save(self, engine: Engine, step: int, nonfinite_in_a_row: int, folder: Path | None = None,
             weights_only: bool = False) -> Path | None:
        """A snapshot of the weights (and the optimizer's state) after `step` (every rank calls it:
        the engine materialises them together); returns its path on rank 0. folder: where (default
        <run_dir>/checkpoints/step-N, pruned to the newest `keep`). weights_only: without the
        optimizer's state (keep_best's snapshot, which nothing continues from)."""
        with engine.materialized() as weights:
            if not self.mesh.is_main:
                return None
            self.trajectory.sync()
            state = dict(self.identity, nonfinite_in_a_row=nonfinite_in_a_row, pending_update=None,
                         **({"weights_only": True} if weights_only else {}))
            tensors = {p.name: p.tensor for p in weights.params}
            if folder is None:
                path = write_snapshot(self.run_dir, step, tensors, state, self.keep,
                                      optimizer_state=engine.optimizer_state())
            else:
                path = write_snapshot_to(Path(folder), step, tensors, state,
                                         optimizer_state=None if weights_only else engine.optimizer_state())
        log.info("Snapshot at step %d: %s", step, path)
        return path
