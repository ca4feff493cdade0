"""`python -m distzo bench`: a ZO step's cost against its forward passes (docs/performance.md)."""

from __future__ import annotations

from ...registry import register
from . import HydraCommand


@register("command", "bench")
class Bench(HydraCommand):
    """time a ZO step against its forward passes and MeZO's reference loop (bench.json)"""

    @classmethod
    def task(cls, cfg, claimed) -> None:
        from ...run.bench import bench
        from ..hydra_app import run_dir

        bench(cfg, run_dir(claimed), validate_config=claimed is None)
