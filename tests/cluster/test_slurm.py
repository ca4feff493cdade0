"""slurm/train.sbatch and `sweep sweep.launcher=slurm` on a real (one-node, localhost) SLURM."""

from __future__ import annotations

import json
import subprocess
import sys

from distzo.jsonl import read_jsonl
from tests.cluster.common import ENV, FAST, ROOT, wait_for_jobs

SCRIPT = ROOT / "slurm" / "train.sbatch"


def sbatch(cluster, cwd, *args, env=None):
    r = subprocess.run(["sbatch", "--parsable", *args], env={**ENV, **cluster.env, **(env or {})}, cwd=cwd,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def test_sbatch_one_node_and_a_two_node_style_job(slurm, tmp_path):
    env = {"DISTZO_RUNS": str(tmp_path / "runs"), "PYTHON": sys.executable}
    # One agent with two ranks; and two agents (two "nodes" on this host) with one rank each, joined by
    # the script's c10d rendezvous (--nnodes 2).
    single = sbatch(slurm, tmp_path, str(SCRIPT), "mesh=1x2", *FAST, env={**env, "NPROC_PER_NODE": "2"})
    double = sbatch(slurm, tmp_path, "--ntasks=2", "--ntasks-per-node=2", str(SCRIPT), "mesh=2x1", *FAST,
                    "save_final=false", env=env)
    states = wait_for_jobs(slurm, [single, double])
    for jid, agents, mesh in ((single, 1, "1x2"), (double, 2, "2x1")):
        log = (tmp_path / f"slurm-{jid}.out").read_text()
        assert states[jid] == ("COMPLETED", 0), log[-3000:]
        assert f"[distzo] job {jid}: {agents} agent(s)" in log
        run = tmp_path / "runs" / jid  # keyed by the job id
        records = read_jsonl(run / "metrics.jsonl")
        summary = records[-1]
        assert summary["type"] == "summary" and summary["mesh"] == mesh and summary["steps"] == 3
        assert len(summary["replica_checksums"]) == 2  # one per rank: world size 2
        assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3]
    assert (tmp_path / "runs" / single / "final" / "model.safetensors").is_file()
    # Both layouts compute the same step (DESIGN I2), whatever launched them.
    losses = [[r["loss"] for r in read_jsonl(tmp_path / "runs" / j / "metrics.jsonl") if r["type"] == "train"]
              for j in (single, double)]
    assert losses[0] == losses[1] or max(abs(a - b) for a, b in zip(*losses)) < 1e-6


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
        assert list((out / str(n)).glob("slurm-*.out")) and x["steps"] == 3
    assert (out / "sweep.png").stat().st_size > 0
