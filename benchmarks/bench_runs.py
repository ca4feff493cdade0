"""One `python -m distzo bench` invocation in a fresh process (a process's peak memory belongs to one
run), for the benchmark scripts of this folder: its bench.json, with the command that made it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_bench(overrides: list[str], run_dir: Path, nproc: int = 1) -> dict:
    """bench with `overrides` in `run_dir`; `nproc` > 1 under torchrun, one OpenMP thread a rank.
    Exits with bench's own error output when it fails."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if nproc == 1:
        cmd = [sys.executable, "-m", "distzo", "bench"]
    else:
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "distzo", "bench"]
    cmd += [*overrides, f"hydra.run.dir={run_dir}"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"bench failed ({' '.join(cmd)}):\n{r.stderr[-3000:]}")
    out = json.loads((Path(run_dir) / "bench.json").read_text())
    out["command"] = " ".join(cmd[1:])
    return out
