"""slurm/train.sbatch and `sweep sweep.launcher=slurm` on a real (one-node, localhost) SLURM."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from distzo.telemetry.jsonl import read_jsonl
from tests.cluster.common import ENV, FAST, ROOT, wait_for_jobs

SCRIPT = ROOT / "slurm" / "train.sbatch"


def sbatch(cluster, cwd, *args, env=None):
    r = subprocess.run(["sbatch", "--parsable", *args], env={**ENV, **cluster.env, **(env or {})}, cwd=cwd,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def test_sbatch_a_two_node_job_on_one_host(slurm, tmp_path):
    """Two SLURM tasks on this host: two torchrun agents (two "nodes"), one rank each, joined by the
    script's c10d rendezvous with --nnodes 2. (One-node jobs of one and two ranks: the sweep below.)"""
    env = {"DISTZO_RUNS": str(tmp_path / "runs"), "PYTHON": sys.executable}
    jid = sbatch(slurm, tmp_path, "--ntasks=2", "--ntasks-per-node=2", str(SCRIPT), "mesh=2x1", *FAST, env=env)
    state = wait_for_jobs(slurm, [jid])[jid]
    log = (tmp_path / f"slurm-{jid}.out").read_text()  # SLURM's log, keyed by the job id
    assert state == ("COMPLETED", 0), log[-3000:]
    assert f"[distzo] job {jid} (attempt 1): 2 agent(s) x 1 rank(s)" in log
    run = tmp_path / "runs" / jid  # the run directory, keyed by the job id
    records = read_jsonl(run / "metrics.jsonl")
    summary = records[-1]
    assert summary["type"] == "summary" and summary["mesh"] == "2x1" and summary["steps"] == 3
    assert len(summary["replica_checksums"]) == 2  # one per rank: world size 2
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3]
    assert (run / "final" / "model.safetensors").is_file() and (run / ".hydra" / "config.yaml").is_file()


def test_sweep_through_slurm(slurm, tmp_path):
    out = tmp_path / "sweep"
    r = subprocess.run([sys.executable, "-m", "distzo", "sweep", "mesh=1x1,1x2", *FAST, "save_final=false",
                        "sweep.launcher=slurm", "sweep.progress_every_s=5", f"hydra.sweep.dir={out}"],
                       env={**ENV, **slurm.env}, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "SLURM job" in r.stdout
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    assert [(x["mesh"], x["status"]) for x in runs] == [("1x1", "ok"), ("1x2", "ok")]
    for n, x in enumerate(runs):
        (log,) = (out / str(n)).glob("slurm-*.out")
        assert f"1 agent(s) x {n + 1} rank(s)" in log.read_text() and x["steps"] == 3
        summary = read_jsonl(out / str(n) / "metrics.jsonl")[-1]
        assert summary["type"] == "summary" and len(summary["replica_checksums"]) == n + 1
    assert (out / "sweep.png").stat().st_size > 0


def test_the_early_warning_stops_requeues_and_completes(slurm, tmp_path):
    """SLURM's early warning (--signal=B:USR1@...: SIGUSR1 to the batch script, sent here at once with
    scancel --batch) reaches every rank, which finish their step and snapshot; the script requeues the
    job, and the second attempt continues the same run directory with resume=auto to the end."""
    script = SCRIPT.read_text()
    assert "#SBATCH --signal=B:USR1@" in script and "#SBATCH --requeue" in script
    env = {"DISTZO_RUNS": str(tmp_path / "runs"), "PYTHON": sys.executable, "NPROC_PER_NODE": "2"}
    steps = 120
    jid = sbatch(slurm, tmp_path, "--ntasks=1", str(SCRIPT), "mesh=1x2", *FAST, f"steps={steps}",
                 "checkpoint.every=1000", env=env)
    run = tmp_path / "runs" / jid
    deadline = time.time() + 240
    while time.time() < deadline:  # the run is training
        records = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
        if sum(r["type"] == "train" for r in records) >= 10:
            break
        time.sleep(0.2)
    r = subprocess.run(["scancel", "--signal=USR1", "--batch", jid], env={**ENV, **slurm.env}, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    state = wait_for_jobs(slurm, [jid], timeout_s=400)[jid]
    log = (tmp_path / f"slurm-{jid}.out").read_text()  # both attempts (--open-mode=append)
    assert state == ("COMPLETED", 0), log[-3000:]
    assert "SIGUSR1 received" in log and "requeueing it" in log and f"job {jid} (attempt 2)" in log
    summary = read_jsonl(run / "metrics.jsonl")[-1]
    assert summary["type"] == "summary" and summary["steps"] == steps and 10 <= summary["resumed_from_step"] < steps
    train = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["type"] == "train"]
    assert train == list(range(1, steps + 1))  # every step once, across the two attempts
