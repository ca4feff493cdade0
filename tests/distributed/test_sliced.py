"""DistZO2's sliced communication (comm.sliced) with real torchrun jobs: the same weights as resident
training, a quarter of the host-to-device bytes per rank with four local ranks, one host copy of the
master per node, and no shared-memory segment left behind by a killed job."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from distzo.parallel.node import PREFIX, shm_dir
from distzo.telemetry.jsonl import read_jsonl
from tests.distributed.launch import ENV, torchrun

BASE = ["model=tiny", "task=synthetic-cue", "log_every=1000", "batch_size=8", "optim.lr=1e-3", "seed=4",
        "task.val_size=32", "task.test_size=32", "dist_timeout_s=120"]
# Four blocks through one device slot: every block is uploaded every step, so bytes are comparable.
STREAMED = ["offload=cpu", "offload.slots=1", "+model.arch_config.num_hidden_layers=4"]


def run(tmp_path, name, nproc, *args):
    out = tmp_path / name
    r = torchrun(nproc, *BASE, *args, f"hydra.run.dir={out}", cwd=tmp_path)
    assert r.returncode == 0, f"{name}:\n{r.stderr[-3000:]}"
    return out


def weights(out):
    return load_file(out / "final" / "model.safetensors")


def segments() -> set[str]:
    return {p.name for p in shm_dir().glob(f"{PREFIX}*")}


@pytest.mark.parametrize("mesh", ["2x1", "1x2"])
def test_sliced_and_naive_equal_resident(tmp_path, mesh):
    """(2x2 runs sliced against resident in test_offload_mesh, and naive against sliced below.)"""
    common = [f"mesh={mesh}", "steps=5", "eval_every=2", "offload.slots=1"]
    resident = weights(run(tmp_path, "resident", 2, *common))
    for name, sliced in [("sliced", "true"), ("naive", "false")]:
        offloaded = weights(run(tmp_path, name, 2, *common, "offload=cpu", f"comm.sliced={sliced}"))
        assert resident.keys() == offloaded.keys()
        assert all(torch.equal(resident[k], offloaded[k]) for k in resident), name


def test_four_local_ranks_move_a_quarter_and_share_one_master(tmp_path):
    common = ["mesh=2x2", "steps=3", "eval_every=3", *STREAMED]
    sliced = run(tmp_path, "sliced", 4, *common, "comm.sliced=true")
    naive = run(tmp_path, "naive", 4, *common, "comm.sliced=false")
    assert all(torch.equal(a, b) for a, b in zip(weights(sliced).values(), weights(naive).values()))

    def last(out, kind):
        return [m for m in read_jsonl(out / "metrics.jsonl") if m["type"] == kind][-1]

    s, n = last(sliced, "train"), last(naive, "train")
    # Each rank uploads its slice (a quarter, rounded up to an aligned length) and writes back only it.
    assert n["h2d_bytes_per_rank"] > 0 and n["peer_bytes_per_rank"] == 0
    slack = 4 * 4 * 256 * 4  # 4 blocks, slices padded to 256 float32 elements
    assert n["h2d_bytes_per_rank"] <= 4 * s["h2d_bytes_per_rank"] <= n["h2d_bytes_per_rank"] + slack
    # Over the node: one copy of the blocks crosses the host-device link instead of four.
    assert s["h2d_bytes_node"] == n["h2d_bytes_per_rank"] and n["h2d_bytes_node"] == 4 * n["h2d_bytes_per_rank"]
    assert s["peer_bytes_per_rank"] == 3 * s["h2d_bytes_per_rank"]  # the other three slices from peers
    assert 4 * s["d2h_bytes_per_rank"] <= n["d2h_bytes_per_rank"] + slack
    # The node's resident master (measured from /proc/self/smaps, summed over ranks): about one copy.
    ss, ns = last(sliced, "summary"), last(naive, "summary")
    copy = ss["host_master_copy_bytes"]
    assert ss["node_ranks"] == 4 and ss["comm_sliced"] and not ns["comm_sliced"]
    assert copy <= ss["host_master_node_bytes"] <= copy + slack
    assert ns["host_master_node_bytes"] == 4 * copy


def test_killed_rank_leaves_no_shared_segment(tmp_path, monkeypatch):
    # A segment whose creator died between creating and unlinking it (the only leaking window) is
    # swept by the next job on the node. The job's segments go to a folder of its own: /dev/shm
    # also holds those of the jobs the other test worker runs meanwhile.
    monkeypatch.setenv("DISTZO_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = shm_dir() / f"{PREFIX}{dead.pid}-test-deadbeef"
    stale.write_bytes(b"\0" * 4096)
    before = segments() - {stale.name}
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "distzo",
           "train", *BASE, "mesh=2x1", "steps=100000", "eval_every=0", *STREAMED, f"hydra.run.dir={out}"]
    job = subprocess.Popen(cmd, env={**ENV, "DISTZO_SHM_DIR": str(tmp_path / "shm")}, cwd=tmp_path,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        while not any(m["type"] == "train" for m in read_jsonl(out / "metrics.jsonl")):
            assert job.poll() is None and time.time() < deadline, "training did not start"
            time.sleep(0.5)
        assert not stale.exists()
        workers = psutil.Process(job.pid).children()
        assert len(workers) == 2
        os.kill(workers[1].pid, signal.SIGKILL)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert segments() - before == set()
