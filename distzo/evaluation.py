"""Evaluation of the current weights on a whole split, its batches dealt over every rank.

The engine materialises the weights first (owed updates applied, peers in step); each rank then
scores its own batches at the master weights with no collectives (ranks may hold different numbers
of batches), and one all-reduce adds the counts.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .dist.mesh import Mesh
from .engine import Engine
from .metrics import MetricsWriter, Progress, format_duration
from .objectives import accuracy_counts, objective_sums

log = logging.getLogger("distzo")


class Evaluator:
    def __init__(self, task, engine: Engine, mesh: Mesh, batch_size: int, metrics: MetricsWriter | None = None):
        self.task, self.engine, self.mesh, self.batch_size, self.metrics = task, engine, mesh, batch_size, metrics

    def run(self, split: str, step: int) -> dict[str, Any]:
        """Accuracy and mean loss of the current weights on `split` (every rank calls it together)."""
        start = time.time()
        mesh = self.mesh
        batches = list(self.task.batches(split, self.batch_size))
        mine = batches[mesh.rank::mesh.world_size]
        progress = Progress(f"eval {split}", len(batches), enabled=mesh.is_main)
        correct = seen = 0
        loss_sum = loss_count = 0.0
        with self.engine.materialized() as weights:
            for i, batch in enumerate(mine):
                scores = weights.score(batch)
                c, n = accuracy_counts(scores, batch)
                s, k = objective_sums(scores, batch, "loss").tolist()
                correct, seen, loss_sum, loss_count = correct + c, seen + n, loss_sum + s, loss_count + k
                progress.update(min(len(batches), (i + 1) * mesh.world_size))
        correct, seen, loss_sum, loss_count = mesh.all_sum([correct, seen, loss_sum, loss_count])
        result = {"accuracy": correct / seen, "loss": loss_sum / loss_count, "examples": int(seen)}
        elapsed = time.time() - start
        if self.metrics is not None:
            self.metrics.write("eval", step=step, split=split, **result, eval_time_s=round(elapsed, 3))
        log.info("step %d: %s accuracy %.4f, loss %.4f (%d examples, %s)", step, split, result["accuracy"],
                 result["loss"], seen, format_duration(elapsed))
        return result
