"""launch/local.sh and launch/multinode.sh as users run them, and wandb logging from rank 0."""

from __future__ import annotations

import os
import subprocess
import sys

from distzo.telemetry.jsonl import read_jsonl
from tests.cluster.common import ENV, FAST, ROOT
from tests.cluster.wandb_records import read_run
from tests.ports import free_port

LOCAL, MULTINODE = ROOT / "launch" / "local.sh", ROOT / "launch" / "multinode.sh"
SCRIPT_ENV = {**ENV, "PYTHON": sys.executable}


def test_wrappers_explain_missing_arguments():
    r = subprocess.run(["bash", str(LOCAL), "mesh=2x2"], env=SCRIPT_ENV, capture_output=True, text=True)
    assert r.returncode == 2 and "usage: launch/local.sh NPROC" in r.stderr
    env = {k: v for k, v in SCRIPT_ENV.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR")}
    r = subprocess.run(["bash", str(MULTINODE), "mesh=1x2"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "set NNODES NODE_RANK MASTER_ADDR" in r.stderr
    env = {k: v for k, v in SCRIPT_ENV.items() if not k.startswith("SLURM_")}
    r = subprocess.run(["bash", str(ROOT / "slurm" / "train.sbatch"), "mesh=1x2"], env=env, capture_output=True,
                       text=True)
    assert r.returncode != 0 and "submit this script with sbatch" in r.stderr


def test_local_two_processes_with_wandb_offline(tmp_path):
    """launch/local.sh 2 mesh=1x2 logger=wandb: one offline wandb run (rank 0's) holding the metrics of
    metrics.jsonl, the resolved config and the mesh."""
    run = tmp_path / "run"
    env = {k: v for k, v in SCRIPT_ENV.items() if not k.startswith("WANDB_")}
    r = subprocess.run(["bash", str(LOCAL), "2", "mesh=1x2", *FAST, "save_final=false", "logger=wandb",
                        "logger.project=distzo-test", f"hydra.run.dir={run}"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (wandb_run,) = (run / "wandb").glob("offline-run-*")  # rank 0 only
    assert len(list(tmp_path.rglob("run-*.wandb"))) == 1 and not (tmp_path / "wandb").exists()
    logged = read_run(wandb_run)
    assert logged["project"] == "distzo-test" and logged["name"] == "run"
    config = logged["config"]
    assert config["mesh"] == "1x2" and config["steps"] == 3 and config["model"]["name"] == "tiny"
    assert config["launch"] == {"world_size": 2, "pert": 1, "data": 2, "nodes": 1, "seed": 0}
    records = read_jsonl(run / "metrics.jsonl")
    train = {r["step"]: r for r in records if r["type"] == "train"}
    history = {h["_step"]: h for h in logged["history"]}
    assert sorted(train) == [1, 2, 3] and len(logged["history"]) >= 3  # FAST: steps=3, each logged
    for step, line in train.items():
        assert history[step]["train/loss"] == line["loss"] and history[step]["train/tokens"] == line["tokens"]
        assert history[step]["train/step_time_s"] == line["step_time_s"]
    final_val = [r for r in records if r["type"] == "eval" and r["split"] == "validation"][-1]
    assert history[3]["validation/accuracy"] == final_val["accuracy"]
    summary = records[-1]
    assert logged["summary"]["test_accuracy"] == summary["test_accuracy"] and logged["summary"]["mesh"] == "1x2"
    # nothing secret on disk: distzo passes no credentials, and offline wandb reads none
    for path in run.rglob("*"):
        if path.is_file() and path.suffix not in (".wandb",):
            assert "api_key" not in path.read_text(errors="replace").lower(), path


def test_two_nodes_on_one_host_join_by_c10d(tmp_path):
    """Two torchrun agents (NNODES=2), one rank each, meeting at MASTER_ADDR:MASTER_PORT."""
    run = tmp_path / "run"
    base = {**SCRIPT_ENV, "NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "NPROC_PER_NODE": "1"}
    args = ["bash", str(MULTINODE), "mesh=2x1", *FAST, "save_final=false", f"hydra.run.dir={run}"]
    # node 1 first: it must wait for node 0's rendezvous store rather than fail
    agents = [subprocess.Popen(args, env={**base, "NODE_RANK": rank}, cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for rank in ("1", "0")]
    outputs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    summary = read_jsonl(run / "metrics.jsonl")[-1]
    assert summary["type"] == "summary" and summary["mesh"] == "2x1"
    assert len(summary["replica_checksums"]) == 2 and len(set(summary["replica_checksums"])) == 1  # world size 2
    assert os.path.exists(run / "summary.json")
