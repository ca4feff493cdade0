"""Naive vs sliced offload communication (DistZO2 §6.1, `comm.sliced`), two torchrun jobs on CPU.

    python benchmarks/sliced_comm.py                      # 4 ranks, mesh 2x2, tiny model with 8 blocks
    python benchmarks/sliced_comm.py --repeats 3 --steps 12
    python benchmarks/sliced_comm.py -- +model.arch_config.hidden_size=256   # extra overrides, both runs

Runs `torchrun --standalone --nproc-per-node N -m distzo train` twice per repeat, with
`comm.sliced=false` (every rank keeps its own host master and moves whole blocks) and
`comm.sliced=true` (one node-shared master; each rank moves 1/N of every block and all-gathers the
rest), on the same configuration: `offload=cpu offload.slots=1` so every block is uploaded every
step, `task=synthetic-cue` with 32 validation and 32 test sentences (a run still evaluates before
and after training), `eval_every=0 save_final=false checkpoint.every=0`, OMP_NUM_THREADS=1. Extra
overrides after `--` come last, so they can change any of these (the block count: `--layers`).
From each run's `metrics.jsonl` it reads the train lines after `--warmup` steps (medians; the first step has no
deferred update to write back) and the summary line (the node's resident host master, measured
from /proc/self/smaps and summed over the node's ranks). Per-rank figures are rank 0's (only rank 0
writes metrics). With --repeats R the runs alternate (naive, sliced, naive, ...) and every figure
is the median over the R runs.

On CPU the "device" is host memory: an upload is a memcpy, the all-gather goes through gloo, so
the step-time ratio measures the overhead of the collective, not PCIe relief. `--device cuda` runs
the same comparison on GPUs (NCCL), one per rank.

Standard library and distzo only. Prints a JSON object and writes it to --json (default:
<workdir>/sliced_comm.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from distzo.telemetry.jsonl import read_jsonl

TRAIN_KEYS = ("step_time_s", "h2d_bytes_per_rank", "d2h_bytes_per_rank", "peer_bytes_per_rank", "h2d_bytes_node",
              "d2h_bytes_node", "transfer_s")
SUMMARY_KEYS = ("host_master_copy_bytes", "host_master_node_bytes", "node_ranks", "comm_sliced")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="ranks on this node (default 4)")
    p.add_argument("--mesh", default="2x2", help="PxD mesh, P*D = nproc (default 2x2)")
    p.add_argument("--model", default="tiny", help="model preset (default tiny)")
    p.add_argument("--layers", type=int, default=8,
                   help="+model.arch_config.num_hidden_layers (default 8; 0 leaves the preset's)")
    p.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="train lines skipped before the medians (default 2)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each path; figures are medians (default 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (gloo, default) or cuda (NCCL; one GPU per rank)")
    p.add_argument("--workdir", type=Path, default=None, help="run directories go here (default: a new temp dir)")
    p.add_argument("--json", type=Path, default=None, help="write the result here (default <workdir>/sliced_comm.json)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per torchrun job (default 600)")
    p.add_argument("overrides", nargs="*", help="extra distzo overrides for both runs (after --)")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def base_overrides(args: argparse.Namespace) -> list[str]:
    out = [f"mesh={args.mesh}", f"model={args.model}", "task=synthetic-cue", "task.val_size=32", "task.test_size=32",
           "batch_size=16", "seed=0", "offload=cpu", "offload.slots=1", f"steps={args.steps}", "eval_every=0",
           "save_final=false", "checkpoint.every=0", "log_every=1000", f"device={args.device}"]
    if args.layers:
        out.append(f"+model.arch_config.num_hidden_layers={args.layers}")
    return out + list(args.overrides)


def command(args: argparse.Namespace, sliced: str, run_dir: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
            "-m", "distzo", "train", *base_overrides(args), f"comm.sliced={sliced}", f"hydra.run.dir={run_dir}"]


def run_once(args: argparse.Namespace, sliced: bool, run_dir: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = command(args, str(sliced).lower(), str(run_dir))
    started = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        sys.stderr.write(r.stderr[-4000:])
        raise SystemExit(f"{'sliced' if sliced else 'naive'} run failed (exit {r.returncode}): {shlex.join(cmd)}")
    records = read_jsonl(run_dir / "metrics.jsonl")
    train = [m for m in records if m.get("type") == "train" and not m.get("skipped")][args.warmup:]
    summary = [m for m in records if m.get("type") == "summary"]
    if not train or not summary:
        raise SystemExit(f"{run_dir / 'metrics.jsonl'}: no train lines after the warm-up, or no summary line")
    out = {k: _median([m[k] for m in train]) for k in TRAIN_KEYS}
    out.update({k: summary[-1][k] for k in SUMMARY_KEYS})
    out["timed_steps"] = len(train)
    out["job_wall_s"] = round(time.time() - started, 1)
    return out


def _median(values: list):
    """The median: an int when the values are ints and the median is whole (byte counts), else
    rounded to 4 decimals (seconds)."""
    m = statistics.median(values)
    return int(m) if all(isinstance(v, int) for v in values) and m == int(m) else round(m, 4)


def median_of(runs: list[dict]) -> dict:
    out = {}
    for k in runs[0]:
        values = [r[k] for r in runs]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        out[k] = _median(values) if numeric else values[0]
    out["step_time_s_runs"] = [r["step_time_s"] for r in runs]
    return out


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="distzo-sliced-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"naive": [], "sliced": []}
    for rep in range(args.repeats):
        for name, sliced in (("naive", False), ("sliced", True)):
            run_dir = workdir / f"{name}-{rep}"
            print(f"[{rep + 1}/{args.repeats}] {name}: {run_dir}", file=sys.stderr, flush=True)
            runs[name].append(run_once(args, sliced, run_dir))
    naive, sliced = median_of(runs["naive"]), median_of(runs["sliced"])
    copy = sliced["host_master_copy_bytes"]
    result = {
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(["sliced_comm.py", *argv]),
        "train_command": "OMP_NUM_THREADS=1 python " + shlex.join(command(args, "false|true", "<run dir>")[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": metadata.version("torch"),
                    "backend": "gloo (CPU)" if args.device == "cpu" else "NCCL (CUDA)"},
        "nproc": args.nproc, "mesh": args.mesh, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
        "naive": naive,
        "sliced": sliced,
        "step_time_ratio_sliced_over_naive": ratio(sliced["step_time_s"], naive["step_time_s"]),
        "h2d_per_rank_ratio_naive_over_sliced": ratio(naive["h2d_bytes_per_rank"], sliced["h2d_bytes_per_rank"]),
        "d2h_per_rank_ratio_naive_over_sliced": ratio(naive["d2h_bytes_per_rank"], sliced["d2h_bytes_per_rank"]),
        "host_master_one_copy_bytes": copy,
        "host_master_node_over_copy": {"naive": ratio(naive["host_master_node_bytes"], copy),
                                       "sliced": ratio(sliced["host_master_node_bytes"], copy)},
        "host_master_node_ratio_naive_over_sliced": ratio(naive["host_master_node_bytes"],
                                                          sliced["host_master_node_bytes"]),
        "workdir": str(workdir),
    }
    path = args.json or workdir / "sliced_comm.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    print(f"written to {path}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
