"""`python -m distzo train`: fine-tune a model with zeroth-order SGD."""

from __future__ import annotations

import sys

from ...registry import register
from . import HydraCommand


@register("command", "train")
class Train(HydraCommand):
    """fine-tune a model with zeroth-order SGD (forward passes only)"""

    @classmethod
    def task(cls, cfg, claimed) -> float | None:
        """Train; returns the final validation metric (what a Hydra sweeper optimises)."""
        from ...errors import ConfigError
        from ...parallel.launch_env import launched_rank
        from ...run.signals import EXIT_STOPPED, Stopped
        from ...run.training import train
        from ..hydra_app import run_dir

        try:
            summary = train(cfg, run_dir(claimed), validate_config=claimed is None)
        except Stopped as stop:
            if launched_rank() == 0:
                from hydra.core.hydra_config import HydraConfig

                where = f"snapshot {stop.snapshot}" if stop.snapshot else "a snapshot"
                print(f"distzo: stopped on {stop.signame} after step {stop.step}, {where}; continue with "
                      f"resume=auto hydra.run.dir={HydraConfig.get().runtime.output_dir}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_STOPPED) from None
        metric = str(cfg.sweep.metric)
        if metric not in summary:
            numbers = [k for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
            raise ConfigError(f"sweep.metric={metric} is not a field of the run's summary; use one of: "
                              f"{', '.join(numbers)}")
        return summary[metric]
