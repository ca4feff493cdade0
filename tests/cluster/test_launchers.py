"""The four ways to start a mesh (docs/cluster.md), each against a torchrun run of the same
configuration: `python -m distzo train mesh=1x2` starting its own workers, ranks started by srun,
Hydra's submitit launcher (one SLURM job per run, requeued on its warning signal), and Hydra's
Optuna sweeper tuning the learning rate from the metric `train` returns. SLURM's are the real
one-node cluster of tests/cluster/conftest.py."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

from distzo.telemetry.jsonl import read_jsonl
from tests.cluster.common import ENV, FAST, ROOT, wait_for_jobs
from tests.distributed.launch import ForkedJob, run_forked

SCRIPT = ROOT / "slurm" / "train.sbatch"


def assert_same_weights(a: Path, b: Path) -> None:
    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys() and x
    for k in x:
        assert torch.equal(x[k], y[k]), k


def torchrun_reference(tmp_path: Path, nproc: int, *overrides: str) -> Path:
    """The same configuration trained by torchrun's worker environment (the suite's launcher)."""
    run = tmp_path / "torchrun"
    r = run_forked(nproc, ["train", *overrides, f"hydra.run.dir={run}"], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return run / "final" / "model.safetensors"


def distzo(*args: str, cwd: Path, env: dict | None = None, **kwargs) -> subprocess.Popen:
    """`python -m distzo ARGS` as a fresh interpreter with SLURM's client environment (`env`)."""
    return subprocess.Popen([sys.executable, "-m", "distzo", *args], cwd=cwd, env={**ENV, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def self_launcher(*args: str, cwd: Path) -> ForkedJob:
    """`python -m distzo ARGS` as a plain process (no launcher's environment), forked from the suite's
    preloaded server: the self-launcher, whose workers the elastic agent starts as fresh interpreters."""
    return ForkedJob(1, list(args), cwd=cwd)


def train_lines(run: Path) -> int:
    path = run / "metrics.jsonl"
    return sum(r["type"] == "train" for r in read_jsonl(path)) if path.exists() else 0


# --- python -m distzo train mesh=1x2: its own workers --------------------------------------------

# Two workers: each is a fresh interpreter (about 7 s of CPU for torch's and transformers' imports),
# and starting, stopping and killing them needs no more than two.
SELF_LAUNCHED = ("model=tiny", "task=synthetic-cue", "mesh=1x2", "steps=20", "eval_every=0", "task.val_size=16",
                 "task.test_size=16", "checkpoint.every=0", "log_every=1000")


def test_a_plain_process_starts_its_workers_and_equals_torchrun(tmp_path):
    reference = torchrun_reference(tmp_path, 2, *SELF_LAUNCHED)
    r = self_launcher("train", *SELF_LAUNCHED, f"hydra.run.dir={tmp_path / 'self'}", cwd=tmp_path).wait(600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Starting 2 local workers" in r.stdout
    summary = json.loads((tmp_path / "self" / "summary.json").read_text())
    assert summary["mesh"] == "1x2" and len(summary["replica_checksums"]) == 2
    assert_same_weights(reference, tmp_path / "self" / "final" / "model.safetensors")


def workers_of(launcher: ForkedJob) -> list[psutil.Process]:
    return [c for c in psutil.Process(launcher.ranks[0].pid).children(recursive=True)
            if "distzo" in " ".join(c.cmdline())]


def start_long_self_launched_run(tmp_path: Path, name: str) -> tuple[ForkedJob, Path]:
    run = tmp_path / name
    p = self_launcher("train", *SELF_LAUNCHED[:3], "steps=100000", "eval_every=0", "task.val_size=16",
                      "task.test_size=16", "checkpoint.every=0", f"hydra.run.dir={run}", cwd=tmp_path)
    deadline = time.time() + 300
    while train_lines(run) < 3 and time.time() < deadline and p.running():
        time.sleep(0.2)
    assert p.running() and train_lines(run) >= 3, "" if p.running() else p.wait().stderr[-3000:]
    return p, run


def test_a_killed_worker_ends_the_self_launched_job_with_one_line(tmp_path):
    p, _ = start_long_self_launched_run(tmp_path, "killed")
    workers = workers_of(p)
    assert len(workers) == 2
    workers[1].send_signal(signal.SIGKILL)
    r = p.wait(timeout=300)
    err = r.stderr
    ours = [line for line in err.splitlines() if line.startswith("distzo: error:")]
    assert r.returncode == 128 + signal.SIGKILL
    # The launcher's line ends the job; a surviving worker that noticed the loss before it was stopped
    # says so in one line of its own. No traceback, no Hydra report.
    assert "was killed by SIGKILL, so the job stopped" in ours[-1], err[-3000:]
    assert all(re.fullmatch(r"distzo: error: rank [01] lost its peers \(.+\): another rank of the job stopped "
                            r"first, and its own message, or the launcher's, says why", line)
               for line in ours[:-1]), ours
    assert "Traceback" not in err and "Error executing job" not in err, err[-3000:]


def test_sigterm_to_the_self_launcher_stops_every_worker_after_a_snapshot(tmp_path):
    p, run = start_long_self_launched_run(tmp_path, "stopped")
    p.ranks[0].terminate()  # SIGTERM, as kill and SLURM send it
    r = p.wait(timeout=300)
    err = r.stderr
    assert r.returncode == 75, err[-3000:]  # EXIT_STOPPED: continue with resume=auto
    (snapshot,) = (run / "checkpoints").glob("step-*")
    assert f"snapshot {snapshot}; continue with resume=auto" in err
    assert int(snapshot.name.split("-")[1]) == train_lines(run)  # the step reached, snapshotted


# --- srun: one task per rank -----------------------------------------------------------------------

def sbatch(cluster, cwd, *args, env=None) -> str:
    r = subprocess.run(["sbatch", "--parsable", *args], env={**ENV, **cluster.env, **(env or {})}, cwd=cwd,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def test_srun_ranks_join_the_mesh_and_equal_torchrun(slurm, tmp_path):
    """slurm/train.sbatch with LAUNCHER=srun: `srun` starts 2 tasks, each `python -m distzo train`,
    and they join a 1x2 mesh from SLURM's variables (two: each task is a fresh interpreter, and the
    ranks' environment is the same for any number)."""
    overrides = (*FAST, "mesh=1x2")
    reference = torchrun_reference(tmp_path, 2, *overrides)
    env = {"DISTZO_RUNS": str(tmp_path / "runs"), "PYTHON": sys.executable, "LAUNCHER": "srun"}
    jid = sbatch(slurm, tmp_path, "--ntasks-per-node=2", str(SCRIPT), *overrides, env=env)
    state = wait_for_jobs(slurm, [jid])[jid]
    log = (tmp_path / f"slurm-{jid}.out").read_text()
    assert state == ("COMPLETED", 0), log[-3000:]
    assert f"job {jid} (attempt 1): 2 rank(s) on localhost (srun)" in log
    run = tmp_path / "runs" / jid
    assert json.loads((run / "summary.json").read_text())["mesh"] == "1x2"
    assert_same_weights(reference, run / "final" / "model.safetensors")


def test_srun_with_a_world_that_does_not_fit_the_mesh_fails_on_every_rank(slurm, tmp_path):
    r = subprocess.run(["srun", "--ntasks=2", sys.executable, "-m", "distzo", "train", *FAST, "mesh=2x2"],
                       env={**ENV, **slurm.env}, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    ours = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("distzo: error:")]
    assert r.returncode != 0 and len(ours) == 2, r.stderr[-3000:]
    assert all(line.startswith("distzo: error: mesh=2x2 needs 4 processes but the job has 2;") for line in ours)


# --- Hydra's submitit launcher -------------------------------------------------------------------

SUBMITIT = ("hydra/launcher=distzo_slurm", "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=10")


def test_a_submitit_multirun_runs_each_value_as_a_slurm_job_of_ranks(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    p = distzo("train", "-m", *SUBMITIT, *FAST, "mesh=2x1", "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={sweep}",
               cwd=tmp_path, env=slurm.env)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    for n, lr in enumerate((1e-3, 2e-3)):
        summary = json.loads((sweep / str(n) / "summary.json").read_text())
        assert summary["mesh"] == "2x1" and len(summary["replica_checksums"]) == 2 and summary["steps"] == 3
        assert f"lr: {lr}" in (sweep / str(n) / ".hydra" / "config.yaml").read_text()
        log = (sweep / str(n) / "train.log").read_text()
        assert log.count("] Training 3.22M parameters") == 1  # rank 0 alone writes the run's log


def test_a_submitit_job_sent_its_warning_is_requeued_and_ends_as_the_uninterrupted_run(slurm, tmp_path):
    """submitit's SIGUSR2 (its timeout / preemption warning, sent here at once with scancel): the
    ranks finish the step in flight and snapshot, submitit requeues the job, and the requeued job
    continues the run (resume=auto) to the uninterrupted run's weights."""
    overrides = (*FAST[:2], "steps=150", "eval_every=0", "task.val_size=16", "task.test_size=16",
                 "checkpoint.every=1000", "mesh=2x1", "optim.lr=1e-3")
    reference = torchrun_reference(tmp_path, 2, *overrides)
    sweep = tmp_path / "sweep"
    p = distzo("train", "-m", *SUBMITIT, *overrides, "resume=auto", f"hydra.sweep.dir={sweep}", cwd=tmp_path,
               env=slurm.env)
    run = sweep / "0"
    deadline = time.time() + 300
    while train_lines(run) < 10 and time.time() < deadline:
        time.sleep(0.2)
    assert train_lines(run) >= 10, p.stderr.read()[-3000:] if p.poll() is not None else ""
    jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env={**ENV, **slurm.env}, capture_output=True, text=True)
    (jid,) = jobs.stdout.split()
    subprocess.run(["scancel", "--signal=USR2", jid], env={**ENV, **slurm.env}, check=True)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 150 and 10 <= summary["resumed_from_step"] < 150
    log = "".join(f.read_text() for f in (sweep / ".submitit").glob("*/*_0_log.err"))
    assert "Caught signal SIGUSR2" in log and "DUE TO JOB REQUEUE" in log
    assert_same_weights(reference, run / "final" / "model.safetensors")


# --- Hydra's Optuna sweeper --------------------------------------------------------------------

def test_an_optuna_study_tunes_the_learning_rate_from_the_returned_metric(tmp_path):
    sweep = tmp_path / "study"
    r = run_forked(1, ["train", "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3",
                       "hydra.sweeper.direction=maximize", "hydra.sweeper.sampler.seed=0",
                       "optim.lr=tag(log, interval(1e-4, 1e-2))", *FAST[:2], "steps=20", "eval_every=0",
                       "task.val_size=16", "task.test_size=16", "checkpoint.every=0", f"hydra.sweep.dir={sweep}"],
                   cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import yaml

    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    trials = [json.loads((sweep / str(n) / "summary.json").read_text()) for n in range(3)]
    lrs = [float(yaml.safe_load((sweep / str(n) / ".hydra" / "config.yaml").read_text())["optim"]["lr"])
           for n in range(3)]
    assert all(1e-4 <= lr <= 1e-2 for lr in lrs) and len(set(lrs)) == 3
    values = [t["validation_accuracy_after"] for t in trials]  # what train returned to the sweeper
    assert result["best_value"] == max(values)
    assert result["best_params"]["optim.lr"] in [lr for lr, v in zip(lrs, values) if v == max(values)]
