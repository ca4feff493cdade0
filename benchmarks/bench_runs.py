"""One `python -m distzo bench` invocation in a fresh process (a process's peak memory belongs to one
run), for the benchmark scripts of this folder: its bench.json, with the command that made it; and
the command line of the scripts that bench one run per variant."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def run_bench(overrides: list[str], run_dir: Path, nproc: int = 1, timeout: float | None = None,
              check: bool = True) -> dict:
    """bench with `overrides` in `run_dir`; `nproc` > 1 under torchrun, one OpenMP thread a rank.
    check: exit with bench's own error output when it fails; otherwise return {"error": ...} (also
    when it runs past `timeout` seconds)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if nproc == 1:
        cmd = [sys.executable, "-m", "distzo", "bench"]
    else:
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "distzo", "bench"]
    cmd += [*overrides, f"hydra.run.dir={run_dir}"]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        if check:
            sys.exit(f"bench ran past {timeout} s ({' '.join(cmd)})")
        return {"error": f"ran past {timeout:.0f} s", "command": " ".join(cmd[1:])}
    if r.returncode != 0:
        if check:
            sys.exit(f"bench failed ({' '.join(cmd)}):\n{r.stderr[-3000:]}")
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        return {"error": lines[-1][:500] if lines else f"exit {r.returncode}", "command": " ".join(cmd[1:])}
    out = json.loads((Path(run_dir) / "bench.json").read_text())
    out["command"] = " ".join(cmd[1:])
    return out


def bench_each(doc: str, flag: str, variants: list[str], overrides: Callable[[str], list[str]]) -> dict[str, dict]:
    """The command line `--<flag> V... [--out F] [-- extra overrides]` of a script documented by `doc`:
    one bench per variant V (its `overrides(V)`, then the extra ones), each in a fresh process in a
    temporary run directory; the bench.json figures by variant, also written to F."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(f"--{flag}", nargs="+", default=variants)
    ap.add_argument("--out", type=Path, default=None, help="also write the figures to this JSON file")
    ap.add_argument("extra", nargs="*", help="overrides for every bench run (after --)")
    ns = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in getattr(ns, flag):
            rows[name] = run_bench([*overrides(name), *ns.extra], Path(tmp) / name)
            print(f"{name}: done", file=sys.stderr, flush=True)
    if ns.out:
        ns.out.write_text(json.dumps(rows, indent=2) + "\n")
    return rows

