"""One `python -m distzo bench` invocation in a fresh process (a process's peak memory belongs to one
run), for the benchmark scripts of this folder: its bench.json, with the command that made it; the
command line of the scripts that bench one run per variant; and the same training built once per
variant in one process, its full ZO steps timed in interleaved rounds (`interleaved_steps`)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
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



def interleaved_steps(variants: dict[str, list[str]], rounds: int, warmup: int,
                      show: Callable[[int, dict], None] | None = None) -> tuple[dict[str, float], bool, dict]:
    """The same training built once per variant (its config overrides) in this process (same seed,
    weights and batches), then full ZO steps (`distzo.run.training.zo_step`) in interleaved rounds,
    so every variant sees the same machine state: the median step time of each after `warmup`
    steps, whether every variant's losses were bitwise equal at every step, and the built
    components by variant (close them when done). show(step, losses by variant): after each step."""
    import torch

    from distzo.config.compose import compose_config
    from distzo.parallel.mesh import Mesh
    from distzo.run.components import build_components
    from distzo.run.training import zo_step

    built = {name: build_components(compose_config(args), Mesh.single(), 0) for name, args in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in built}
    same = True
    for step in range(1, warmup + rounds + 1):
        losses = {}
        for name, c in built.items():
            start = time.perf_counter()
            losses[name] = zo_step(c, step).losses
            if step > warmup:
                times[name].append(time.perf_counter() - start)
        first = next(iter(losses.values()))
        same = same and all(torch.equal(first, other) for other in losses.values())
        if show is not None:
            show(step, losses)
    return {name: statistics.median(t) for name, t in times.items()}, same, built
