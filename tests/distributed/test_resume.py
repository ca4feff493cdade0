"""Nothing lost (I6, docs/architecture.md#invariants): runs killed at any point resume to the weights of
an uninterrupted run. Every test starts real processes and kills them for real (SIGKILL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from distzo.state.snapshots import list_snapshots, read_snapshot
from distzo.telemetry.jsonl import read_jsonl
from tests.distributed.launch import ENV, ForkedJob, run_forked, torchrun

BASE = ["model=tiny", "task=synthetic-cue", "eval_every=0", "log_every=1000", "batch_size=8", "optim.lr=1e-3",
        "estimator.q=2", "seed=9", "task.val_size=32", "task.test_size=32", "checkpoint.every=5",
        "checkpoint.keep=10"]


def launch_cmd(nproc: int, *args: str, restarts: int = 0) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "distzo", "train", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={restarts}", "-m", "distzo", "train", *args]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "final" / "model.safetensors")


def assert_bitwise(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), \
        max(float((a[k] - b[k]).abs().max()) for k in a)


def trained_steps(run_dir: Path) -> int:
    """The last step metrics.jsonl records (what a kill waits for)."""
    return max([r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["type"] == "train"], default=0)


def logged_steps(run_dir: Path) -> int:
    """The last step trajectory.jsonl records, which is what resume re-applies. A step appends to it
    after its metrics line, so a kill between the two leaves it one step behind trained_steps (and
    resume drops that metrics line with the step, which runs again)."""
    return max([r["step"] for r in read_jsonl(run_dir / "trajectory.jsonl")], default=0)


def kill_rank_when(job: ForkedJob | subprocess.Popen, run_dir: Path, min_step: int, rank: str,
                   timeout: float = 180) -> None:
    """SIGKILL the worker with RANK=rank once the run has logged min_step: a rank of a forked job, or
    a worker of a real torchrun (or python -m distzo) process."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        ended = not job.running() if isinstance(job, ForkedJob) else job.poll() is not None
        if ended:
            raise AssertionError(f"the job ended before step {min_step}")
        if trained_steps(run_dir) >= min_step:
            if isinstance(job, ForkedJob):
                os.kill(job.ranks[int(rank)].pid, signal.SIGKILL)
                return
            for child in psutil.Process(job.pid).children(recursive=True) + [psutil.Process(job.pid)]:
                try:
                    env = child.environ()
                except psutil.Error:
                    continue
                if env.get("RANK", "0" if job.pid == child.pid and "torch.distributed.run" not in " ".join(
                        job.args) else None) == rank and "distzo" in " ".join(child.cmdline()):
                    os.kill(child.pid, signal.SIGKILL)
                    return
        time.sleep(0.1)
    raise AssertionError("never reached the step to kill at")


def uninterrupted_run(tmp_path_factory, nproc: int, mesh: str) -> Path:
    """A reference run: 30 steps on `mesh`, never interrupted (its run directory)."""
    root = tmp_path_factory.mktemp(f"reference-{mesh}")
    r = torchrun(nproc, *BASE, "steps=30", f"mesh={mesh}", f"hydra.run.dir={root / 'run'}", cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    return root / "run"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 2x2."""
    return uninterrupted_run(tmp_path_factory, 4, "2x2")


@pytest.fixture(scope="module")
def uninterrupted_2x1(tmp_path_factory):
    """The reference of the tests that restart real worker processes: 2x1. Two workers, not four: each
    fresh worker pays torch's and transformers' imports (about 7 s of CPU), and what those tests
    check (a killed worker restarted, the run continued) needs no more than two."""
    return uninterrupted_run(tmp_path_factory, 2, "2x1")


def test_sigkill_7_steps_after_a_snapshot_resumes_from_the_last_logged_step(tmp_path, uninterrupted):
    """Killed 7 or more steps after its snapshot at step 10: the resumed run re-applies every step the
    trajectory logged after it (no forward passes), continues from the last one, and ends bitwise
    equal to the uninterrupted run."""
    run_dir = tmp_path / "run"
    args = [*BASE, "steps=30", "mesh=2x2", "resume=auto", "checkpoint.every=10", f"hydra.run.dir={run_dir}"]
    job = ForkedJob(4, ["train", *args], cwd=tmp_path)
    kill_rank_when(job, run_dir, min_step=17, rank="2")
    assert job.wait(timeout=120).returncode != 0 and not (run_dir / "final").exists()
    killed_at = logged_steps(run_dir)
    # The kill lands 3 steps before the next snapshot (step 20) at the earliest; on a loaded machine it
    # may come later, and the run then resumes from that one.
    snapshots = [read_snapshot(p)[1]["step"] for p in list_snapshots(run_dir)]
    newest = snapshots[-1]
    assert 17 <= killed_at < 30 and snapshots in ([10], [10, 20]) and newest <= killed_at
    r = torchrun(4, *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert killed_at == newest or f"Re-applying the {killed_at - newest} step(s) logged after it" in r.stdout + r.stderr
    assert_bitwise(weights(uninterrupted), weights(run_dir))
    train = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["type"] == "train"]
    assert train == list(range(1, 31))  # every step once: none was trained twice or lost
    traj = [json.loads(line)["step"] for line in open(run_dir / "trajectory.jsonl")]
    assert traj == list(range(1, 31))


def test_sigterm_stops_after_the_step_in_flight_with_a_snapshot(tmp_path, uninterrupted):
    """SIGTERM to every rank at once, as torchrun's agent forwards the SIGTERM that kill and SLURM send
    it (the agent's forwarding is tests/cluster/test_launchers.py's, through the self-launcher, which
    runs the same agent): every rank finishes its step, a snapshot of exactly the step reached is
    written, the workers exit with status 75, and resume=auto ends bitwise equal to the uninterrupted
    run."""
    run_dir = tmp_path / "run"
    args = [*BASE, "steps=30", "mesh=2x2", "resume=auto", "checkpoint.every=1000", f"hydra.run.dir={run_dir}"]
    job = ForkedJob(4, ["train", *args], cwd=tmp_path)
    deadline = time.time() + 180
    while trained_steps(run_dir) < 8 and time.time() < deadline and job.running():
        time.sleep(0.1)
    for rank in job.ranks:
        os.kill(rank.pid, signal.SIGTERM)
    r = job.wait(timeout=120)
    stopped = trained_steps(run_dir)
    assert r.returncode == 75 and [p.exitcode for p in job.ranks] == [75] * 4, r.stderr[-3000:]
    assert 8 <= stopped < 30, r.stderr[-3000:]
    assert [p.name for p in list_snapshots(run_dir)] == [f"step-{stopped:08d}"]
    assert read_snapshot(list_snapshots(run_dir)[0])[1]["step"] == stopped
    assert f"distzo: stopped on SIGTERM after step {stopped}" in r.stderr
    r = torchrun(4, *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_bitwise(weights(uninterrupted), weights(run_dir))


def test_killed_before_its_first_snapshot_resumes_from_the_initial_weights(tmp_path):
    """No snapshot yet (checkpoint.every=0): run.json holds the run's identity and the initial
    weights are a function of the configuration, so resume=auto re-applies every logged step."""
    ref, run_dir = tmp_path / "ref", tmp_path / "run"
    args = [*BASE, "steps=20", "mesh=1x1", "checkpoint.every=0"]
    assert torchrun(1, *args, f"hydra.run.dir={ref}", cwd=tmp_path).returncode == 0
    job = ForkedJob(1, ["train", *args, "resume=auto", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    kill_rank_when(job, run_dir, min_step=6, rank="0")
    assert job.wait(timeout=120).returncode == 128 + signal.SIGKILL
    killed_at = logged_steps(run_dir)
    with open(run_dir / "trajectory.jsonl", "a") as fh:
        fh.write('{"step": ' + str(killed_at + 1) + ', "upd')  # a line torn by the kill: ignored
    r = torchrun(1, *args, "resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"Re-applying the {killed_at} step(s) logged after the initial weights" in r.stdout + r.stderr
    assert_bitwise(weights(ref), weights(run_dir))
    assert [json.loads(line)["step"] for line in open(run_dir / "trajectory.jsonl")] == list(range(1, 21))


def test_torchrun_restarts_a_failed_worker_and_the_run_resumes(tmp_path, uninterrupted_2x1):
    run_dir = tmp_path / "run"
    args = [*BASE, "steps=30", "mesh=2x1", "resume=auto", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(launch_cmd(2, *args, restarts=1), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=ENV, cwd=tmp_path)
    kill_rank_when(proc, run_dir, min_step=12, rank="1")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert_bitwise(weights(uninterrupted_2x1), weights(run_dir))


def test_killed_while_writing_a_snapshot_resumes_from_the_previous_one(tmp_path):
    ref, run_dir = tmp_path / "ref", tmp_path / "run"
    args = [*BASE, "steps=20", "mesh=1x1"]
    assert torchrun(1, *args, f"hydra.run.dir={ref}", cwd=tmp_path).returncode == 0
    env = {"DISTZO_TEST_KILL_IN_SNAPSHOT": "15"}  # die between writing and renaming step 15's
    r = run_forked(1, ["train", *args, "resume=auto", f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=300, env=env)
    assert r.returncode == 128 + signal.SIGKILL
    leftovers = list((run_dir / "checkpoints").glob(".step-00000015.tmp-*"))
    assert leftovers and [p.name for p in list_snapshots(run_dir)] == ["step-00000005", "step-00000010"]
    r = torchrun(1, *args, "resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Resuming from" in r.stdout and "step-00000010" in r.stdout
    assert not list((run_dir / "checkpoints").glob(".step-*"))  # the unfinished snapshot was removed
    assert_bitwise(weights(ref), weights(run_dir))


def test_resume_on_another_mesh(tmp_path, uninterrupted):
    """Snapshots are layout-free: a 2x2 run continued on 1x4 agrees within the layout tolerance."""
    run_dir = tmp_path / "run"
    common = [*BASE, "resume=auto", f"hydra.run.dir={run_dir}"]
    assert torchrun(4, *common, "steps=15", "mesh=2x2", cwd=tmp_path).returncode == 0
    r = torchrun(4, *common, "steps=30", "mesh=1x4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = weights(uninterrupted), weights(run_dir)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6  # docs/mesh.md: D > 1 tolerance


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_replay_rebuilds_the_final_weights_from_the_first_snapshot(tmp_path, offload):
    run_dir = tmp_path / "run"
    assert torchrun(1, *BASE, "steps=17", f"offload={offload}", f"hydra.run.dir={run_dir}",
                    cwd=tmp_path).returncode == 0
    assert [p.name for p in list_snapshots(run_dir)][0] == "step-00000005"
    out = tmp_path / "replayed.safetensors"
    r = run_forked(1, ["replay", str(run_dir), "--from-step", "5", "--out", str(out)], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    replayed, final = load_file(out), weights(run_dir)
    assert replayed  # an empty or partial file must not pass: the same tensors, bitwise
    assert_bitwise(replayed, final)  # 12 updates, no data, no forward
    log_bytes = (run_dir / "trajectory.jsonl").stat().st_size
    assert log_bytes / 17 < 400  # the checkpoint of a step is a few hundred bytes


def test_a_corrupt_snapshot_is_rejected_and_the_previous_one_used(tmp_path):
    ref, run_dir = tmp_path / "ref", tmp_path / "run"
    assert torchrun(1, *BASE, "steps=20", f"hydra.run.dir={ref}", cwd=tmp_path).returncode == 0
    common = [*BASE, "resume=auto", f"hydra.run.dir={run_dir}"]
    assert torchrun(1, *common, "steps=15", cwd=tmp_path).returncode == 0
    newest = list_snapshots(run_dir)[-1]
    assert newest.name == "step-00000015"
    data = bytearray((newest / "weights.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit in the middle of a weight
    (newest / "weights.safetensors").write_bytes(bytes(data))
    r = torchrun(1, *common, "steps=20", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Skipping a corrupt snapshot" in r.stdout + r.stderr and "step-00000010" in r.stdout
    assert_bitwise(weights(ref), weights(run_dir))


def test_repeated_nonfinite_losses_stop_with_a_valid_snapshot(tmp_path):
    run_dir = tmp_path / "run"
    r = torchrun(1, *BASE, "steps=20", "model.dtype=float16", "optim.lr=1e8", "max_nonfinite_steps=2",
                 f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.startswith("distzo: error:")]
    assert len(lines) == 1 and "2 steps in a row had non-finite losses" in lines[0] and "resume=auto" in lines[0]
    skipped = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m.get("skipped")]
    assert len(skipped) == 2
    newest = list_snapshots(run_dir)[-1]
    tensors, state = read_snapshot(newest)  # verifies
    assert state["step"] == skipped[-1]["step"] and state["nonfinite_in_a_row"] == 2


AFTER, BEFORE = ("after", 13, ["step-00000008"]), ("before", 5, [])


@pytest.mark.parametrize("settings,cases", [
    (["optim.name=adam"], (AFTER, BEFORE)),
    # HiZOO's Hessian (ones at the start) and its curvature, logged among the coefficients; q=1
    (["optim.name=hizoo", "estimator.clean=true", "optim.alpha=1e-3"], (AFTER,)),
], ids=["adam", "hizoo"])
def test_sigkill_of_a_stateful_run_resumes_bitwise(tmp_path, settings, cases):
    """An optimizer with state on 2x2 (the node's ranks share the master and the state: Adam's m and
    v, HiZOO's Hessian): killed 5 or more steps after its snapshot at step 8, which holds the state
    (optimizer.safetensors), the resumed run loads it, re-applies the logged steps through the same
    rule (no forward passes) and ends bitwise equal to the uninterrupted run; so does an Adam run
    killed before its first snapshot, whose state is rebuilt from zeros and the whole trajectory
    (HiZOO's rebuild from its initial state: test_optimizers.py's replay --from-step 0)."""
    base = [a for a in BASE if not (a == "estimator.q=2" and "optim.name=hizoo" in settings)]
    stateful = [*base, *settings, "optim.weight_decay=0.1", "steps=20", "mesh=2x2", "checkpoint.every=8"]
    ref = tmp_path / "ref"
    r = torchrun(4, *stateful, f"hydra.run.dir={ref}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    for name, kill_at, snapshots in cases:
        run_dir = tmp_path / name
        args = [*stateful, "resume=auto", f"hydra.run.dir={run_dir}", *([] if snapshots else ["checkpoint.every=0"])]
        job = ForkedJob(4, ["train", *args], cwd=tmp_path)
        kill_rank_when(job, run_dir, min_step=kill_at, rank="1")
        killed = job.wait(timeout=120)
        killed_at = trained_steps(run_dir)
        assert killed.returncode != 0 and kill_at <= killed_at < 20
        assert [p.name for p in list_snapshots(run_dir)][:1] == snapshots
        if snapshots:
            assert read_snapshot(list_snapshots(run_dir)[0])[1]["optimizer_sha256"]
        r = torchrun(4, *args, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "Re-applying the" in r.stdout + r.stderr
        assert_bitwise(weights(ref), weights(run_dir))


def test_a_self_launched_mesh_restarted_after_a_kill_continues_its_run(tmp_path, uninterrupted_2x1):
    """`python -m distzo train mesh=2x1 launch.max_restarts=1`, no resume=auto and Hydra's timestamped
    run directory: one worker SIGKILLed mid-run, the restarted workers continue the run in the same
    directory from its newest snapshot and logged steps, and the job ends with exit 0 and the
    uninterrupted run's weights, bitwise; the result's line is printed once."""
    args = [*BASE, "steps=30", "mesh=2x1", "launch.max_restarts=1"]
    proc = subprocess.Popen([sys.executable, "-m", "distzo", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path)
    deadline = time.time() + 120
    while not list(tmp_path.glob("outputs/*/*")) and time.time() < deadline:
        time.sleep(0.2)
    (run_dir,) = tmp_path.glob("outputs/*/*")  # fixed once by the launching process, for every restart
    kill_rank_when(proc, run_dir, min_step=12, rank="1")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "continuing the run from its newest snapshot" in out + err
    assert list(tmp_path.glob("outputs/*/*")) == [run_dir]
    assert_bitwise(weights(uninterrupted_2x1), weights(run_dir))
    assert (out + err).count("] Validation (resumed at step") == 1, (out + err)[-3000:]


@pytest.mark.parametrize("name,args", [
    ("lozo-m", ["estimator=lozo", "estimator.lazy_interval=4", "estimator.factor_momentum=0.8"]),
    ("sparse", ["estimator=sparse_mezo", "estimator.mask_interval=4", "optim.lr=1e-2"]),
])
def test_sigkill_of_a_run_whose_directions_keep_state_resumes_bitwise(tmp_path, name, args):
    """LOZO-M's momentum factors and Sparse MeZO's re-derived thresholds are state of the directions:
    a 2x2 run killed after its snapshot at step 8 resumes from the snapshot's (directions/... beside the
    weights) and re-applies the logged steps after it, re-deriving the thresholds at the same steps,
    to the uninterrupted run's weights, bitwise."""
    common = [*BASE, *args, "steps=16", "mesh=2x2", "checkpoint.every=8"]
    ref = tmp_path / "ref"
    r = torchrun(4, *common, f"hydra.run.dir={ref}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "run"
    job = ForkedJob(4, ["train", *common, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    kill_rank_when(job, run_dir, min_step=11, rank="1")
    killed = job.wait(timeout=300)
    killed_at = trained_steps(run_dir)
    assert killed.returncode != 0 and 11 <= killed_at < 16 and [p.name for p in list_snapshots(run_dir)] == [
        "step-00000008"]
    state = load_file(run_dir / "checkpoints" / "step-00000008" / "optimizer.safetensors")
    assert state and all(k.startswith("directions/") for k in state)
    r = torchrun(4, *common, "resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_bitwise(weights(ref), weights(run_dir))
