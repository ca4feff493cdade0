"""`python -m distzo sweep`: every combination of comma-separated values as its own job."""

from __future__ import annotations

from ...registry import register
from . import Command

USAGE = """usage: python -m distzo sweep key=a,b[,c ...] [key=value ...]

Runs every combination of the comma-separated values (cartesian product) as its own training job of
P*D processes, in <hydra.sweep.dir>/<n>: locally one after another (sweep.launcher=local, torchrun
--standalone), or all at once on SLURM through slurm/train.sbatch (sweep.launcher=slurm, sweep.nodes,
sweep.sbatch_args). Then prints and writes sweep.md, sweep.csv, sweep.json and sweep.png there:
tokens/s, median step time, peak memory, final validation accuracy and exit status per run, read from
each run's metrics.jsonl. Exits 1 if any run failed. Example:

  python -m distzo sweep mesh=1x2,2x1,1x1 model=tiny task=synthetic-cue steps=50 hydra.sweep.dir=sweeps/a"""


@register("command", "sweep")
class Sweep(Command):
    """run every combination of comma-separated values as its own torchrun/SLURM job; table and plot"""

    @classmethod
    def run(cls, args: list[str]) -> None:
        from ...errors import ConfigError
        from ...parallel.launch_env import launched_world_size
        from ...run.sweep import run_sweep
        from ..args import overrides_only

        overrides = overrides_only(args, "sweep", USAGE, " (every comma-separated value is swept)")
        if overrides is None:
            return
        if launched_world_size() > 1:
            raise ConfigError("sweep cannot run under torchrun: it launches one torchrun job per configuration "
                              "itself; run python -m distzo sweep ...")
        if not run_sweep(overrides):
            raise SystemExit(1)
