"""`python -m distzo sweep`: run every combination of comma-separated override values as its own
training job, then tabulate and plot what each run's metrics.jsonl says.

    python -m distzo sweep mesh=1x4,2x2,4x1 model=tiny steps=100

Each combination n (the cartesian product, in Hydra's order) runs in `<hydra.sweep.dir>/<n>` as a
torchrun job of P*D processes: locally one after another (so their timings do not compete), or with
`sweep.launcher=slurm` all submitted at once through `slurm/train.sbatch` and waited for. A failing
job is a row of the table, not the end of the sweep; the command exits 1 if any failed.

Table columns, all computed from the run's metrics.jsonl (rank 0's view):
  tokens_per_s   tokens of all logged steps / their summed step time
  step_time_s    median step time
  peak_mem_bytes the largest peak_mem_bytes logged (CUDA allocator peak, or peak RSS on CPU)
  val_accuracy / val_loss   the last validation evaluation

The parts: `expansion` (the command line's combinations), `execution` (the jobs, run locally or on
SLURM), `report` (each run's numbers, the table, its files and the plot).
"""

from __future__ import annotations

from pathlib import Path

from .execution import Job, Sweep, SweepError
from .expansion import expand, split_overrides
from .report import Row, markdown_table, summarize_metrics, write_outputs

__all__ = ["Job", "Row", "Sweep", "SweepError", "expand", "markdown_table", "run_sweep", "split_overrides",
           "summarize_metrics", "write_outputs"]


def run_sweep(overrides: list[str]) -> bool:
    """The sweep `python -m distzo sweep` runs: expand the command line, check every combination
    before launching anything, run the jobs, print the table; whether every run succeeded."""
    from omegaconf import OmegaConf

    from ...config.compose import explain, typed
    from ..checks import compose_and_check

    run_overrides, own = split_overrides(overrides)
    try:
        combos = expand(run_overrides)
    except SweepError:
        raise
    except Exception as exc:  # Hydra's override grammar
        raise SweepError(explain(exc)) from None
    cfgs = [compose_and_check(combo + own, check_world=False) for combo, _ in combos]
    try:
        root = Path(str(OmegaConf.select(cfgs[0], "hydra.sweep.dir")))
    except Exception as exc:
        raise SweepError(f"hydra.sweep.dir: {explain(exc)}") from None
    jobs = [Job(n, combo, swept, str(cfg.mesh), root / str(n))
            for n, ((combo, swept), cfg) in enumerate(zip(combos, cfgs))]
    rows = Sweep(jobs, root, typed(cfgs[0]).sweep).run()
    print(markdown_table(rows), end="", flush=True)
    failed = [r for r in rows if r.status != "ok"]
    print(f"[sweep] {len(rows) - len(failed)}/{len(rows)} runs ok; table and plot: {root}/sweep.md, sweep.csv, "
          f"sweep.json, sweep.png", flush=True)
    return not failed
