"""The PxD mesh with real processes (gloo): layout invariance, replica consistency, bad meshes,
failures that end the job instead of hanging."""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from distzo.parallel.shape import MeshError, MeshShape
from distzo.telemetry.jsonl import read_jsonl
from tests.distributed.launch import ENV, hosted_store, set_rank_env, start_ranks, torchrun

TINY = ["model=tiny", "task=synthetic-cue", "eval_every=0", "log_every=1000", "steps=8", "batch_size=12",
        "optim.lr=1e-3", "estimator.q=2", "seed=3", "task.val_size=48", "task.test_size=48"]


# --- mesh parsing and validation (no processes) -----------------------------------------------------

@pytest.mark.parametrize("text,world,message", [
    ("3x3", 4, "mesh=3x3 needs 9 processes but the job has 4; use a mesh whose product is 4 (1x4, 2x2, 4x1)"),
    ("abc", 4, "mesh='abc' is not PxD"),
    ("0x4", 4, "both degrees must be at least 1"),
    # one process that torchrun or srun started (a plain process starts its own workers instead)
    ("2x2", 1, "this is a single process; run python -m distzo train mesh=2x2 (it starts its 4 workers), or "
               "launch 4 processes with torchrun --nproc-per-node 4 or srun --ntasks 4"),
])
def test_bad_mesh_messages(text, world, message):
    with pytest.raises(MeshError) as err:
        MeshShape.parse(text).check_world(world)
    assert message in str(err.value)


def test_a_collective_whose_peer_is_gone_is_one_line(monkeypatch):
    from distzo.parallel.mesh import peer_failure

    monkeypatch.setenv("RANK", "3")
    gloo = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:35743. This is typically caused by a remote worker crashing. Check the logs.")
    assert peer_failure(gloo) == ("rank 3 lost its peers (Connection closed by peer [127.0.0.1]:35743): another rank "
                                  "of the job stopped first, and its own message, or the launcher's, says why")
    assert peer_failure(RuntimeError("shape mismatch")) is None  # any other error keeps its traceback
    assert peer_failure(ValueError("Connection closed by peer")) is None


def test_roles():
    from distzo.parallel.mesh import Mesh

    roles = [(r % 2, r // 2) for r in range(4)]  # (perturbation index, data index) on 2x2
    for r, (p, d) in enumerate(roles):
        m = Mesh(MeshShape(2, 2), torch.device("cpu"), rank=r)
        assert (m.pert_rank, m.data_rank) == (p, d)
        assert m.my_probes(4) == [p, p + 2]
    assert Mesh(MeshShape(4, 1), torch.device("cpu"), rank=3).my_probes(2) == []


def test_node_evaluations_are_those_of_the_nodes_ranks():
    """Work division builds the copies a node's ranks need: on a 4x1 mesh over two 2-rank nodes
    (4 evaluations), node 0 runs 0 and 1, node 1 runs 2 and 3; with one node, every evaluation."""
    from distzo.parallel.mesh import Mesh
    from distzo.parallel.node import Node

    for rank in range(4):
        node = Node(local_rank=rank % 2, size=2, index=rank // 2)
        m = Mesh(MeshShape(4, 1), torch.device("cpu"), rank=rank, node=node)
        assert m.node_probes(4) == ([0, 1] if rank < 2 else [2, 3])
        assert set(m.my_probes(4)) <= set(m.node_probes(4))
    whole = Mesh(MeshShape(2, 2), torch.device("cpu"), rank=3, node=Node(local_rank=3, size=4))
    assert whole.node_probes(2) == [0, 1]


# --- layout invariance over real torchrun jobs ------------------------------------------------------

@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Final weights and summaries of the same run on every layout."""
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for mesh, nproc in [("1x1", 1), ("2x1", 2), ("4x1", 4), ("1x2", 2), ("2x2", 4), ("1x4", 4)]:
        run_dir = root / mesh
        r = torchrun(nproc, *TINY, f"mesh={mesh}", f"hydra.run.dir={run_dir}", cwd=root)
        assert r.returncode == 0, f"{mesh}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        out[mesh] = (load_file(run_dir / "final" / "model.safetensors"), read_jsonl(run_dir / "metrics.jsonl"), r)
    return out


def max_difference(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("mesh", ["2x1", "4x1"])
def test_perturbation_parallel_is_bitwise_the_single_process_run(layouts, mesh):
    ref, got = layouts["1x1"][0], layouts[mesh][0]
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    trajectory = [[(r["loss"], r["projected_grads"]) for r in layouts[m][1] if r["type"] == "train"]
                  for m in ("1x1", mesh)]
    assert trajectory[0] == trajectory[1]


@pytest.mark.parametrize("mesh", ["1x2", "2x2", "1x4"])
def test_data_parallel_matches_within_the_stated_tolerance(layouts, mesh):
    """Data shards pack fewer prompts per row, so the forward's matrix shapes and summation order
    differ: per-example losses move by float32 rounding (~1e-7 relative), which reaches g through
    1/(2 eps) and the weights through lr * g * z. After 8 steps the weights agree to 1e-6 absolute
    (observed: 2.4e-7, while training moved them by up to 3.7e-2); a wrong shard, z or reduction
    would be off by the size of an update."""
    ref, got = layouts["1x1"][0], layouts[mesh][0]
    assert max_difference(ref, got) < 1e-6
    g_ref = [r["projected_grads"] for r in layouts["1x1"][1] if r["type"] == "train"]
    g_got = [r["projected_grads"] for r in layouts[mesh][1] if r["type"] == "train"]
    assert torch.allclose(torch.tensor(g_ref), torch.tensor(g_got), rtol=1e-3, atol=1e-4)
    update_size = max_difference(ref, initial_weights())
    assert update_size > 1e-2  # training moved weights by ~4e-2: the tolerance is 4 orders below


def initial_weights():
    """The tiny preset's weights before training, built the way the runs build them."""
    from distzo.models import load_model
    from tests.conftest import make_config

    model, _ = load_model(make_config("model=tiny").model)
    return model.state_dict()


def test_every_rank_holds_the_same_weights(layouts):
    world = {"1x1": 1, "2x1": 2, "4x1": 4, "1x2": 2, "2x2": 4, "1x4": 4}
    checksums = {}
    for mesh, (_, metrics, _) in layouts.items():
        summary = [m for m in metrics if m["type"] == "summary"][0]
        assert summary["mesh"] == mesh and all(m["mesh"] == mesh for m in metrics)
        # Ranks on one machine share the master and divide noise and update work (engine.divide_work
        # auto): the bitwise and tolerance comparisons above cover the divided engine.
        assert summary["engine"] == ("divided" if world[mesh] > 1 else "resident")
        sums = summary["replica_checksums"]  # gathered from every rank after the last step
        assert len(sums) == world[mesh] and len(set(sums)) == 1
        checksums[mesh] = sums[0]
    assert checksums["1x1"] == checksums["2x1"] == checksums["4x1"]


def test_only_rank_0_writes_one_run_directory(tmp_path):
    r = torchrun(2, *TINY, "steps=2", "mesh=1x2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    runs = list((tmp_path / "outputs").glob("*/*"))
    assert len(runs) == 1 and (runs[0] / "metrics.jsonl").is_file() and (runs[0] / "train.log").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]  # nothing else written by rank 1


# --- the replica guard over real gloo processes ------------------------------------------------------

def _replica_worker(rank, world, port, corrupt_rank, out_dir):
    """Checks the replicas twice: as built (every rank the same), then after rank `corrupt_rank`
    moved one weight by one ulp."""
    set_rank_env(rank, world, port)
    from distzo.models.loading import random_model
    from distzo.parallel.consistency import ReplicaDivergence, check_replicas
    from distzo.parallel.mesh import Mesh
    from distzo.zo.params import TrainableParams

    mesh = Mesh.create(f"1x{world}", "cpu", timeout_s=60)
    params = TrainableParams.from_model(random_model("llama", 300, {}, 0, torch.float32))
    messages = []
    for step in (6, 7):
        if step == 7 and rank == corrupt_rank:
            with torch.no_grad():
                w = params.get("model.layers.1.mlp.up_proj.weight").tensor
                w.view(-1)[17] = torch.nextafter(w.view(-1)[17], torch.tensor(1.0))  # one ulp
        try:
            check_replicas(mesh, [p.tensor for p in params], step=step)
            messages.append("consistent")
        except ReplicaDivergence as exc:
            messages.append(str(exc))
    (out_dir / f"rank{rank}.txt").write_text("\n".join(messages))
    mesh.close()


def test_replica_guard_catches_a_corrupted_replica(tmp_path):
    """Consistent replicas pass the guard; one weight one ulp off on one rank fails it on every rank,
    naming that rank (both in one job of three processes)."""
    store = hosted_store(3, 300)
    start_ranks(_replica_worker, 3, (3, store.port, 2, tmp_path))
    for r in range(3):
        consistent, corrupted = (tmp_path / f"rank{r}.txt").read_text().split("\n", 1)
        assert consistent == "consistent"
        assert corrupted.startswith("replica weights diverged at step 7: ranks [2] differ from rank 0"), corrupted


# --- rank 0 decides for every rank ------------------------------------------------------------------

def _decided_worker(rank, world, port, out_dir):
    """Three questions only rank 0 is asked: one it answers, one it refuses with a DistzoError, one
    that fails with a bug; each rank writes what it got."""
    set_rank_env(rank, world, port)
    from distzo.errors import ConfigError
    from distzo.parallel.mesh import Mesh

    mesh = Mesh.create(f"1x{world}", "cpu", timeout_s=60)
    asked = []

    def answer():
        asked.append(rank)
        return {"rank": rank}

    def refuse():
        raise ConfigError("run_dir=/x is taken; pick another")

    def bug():
        return {}["missing"]

    got = [repr(mesh.decided_on_main(answer))]
    for question in (refuse, bug):
        try:
            mesh.decided_on_main(question)
            got.append("no error")
        except Exception as exc:
            got.append(f"{type(exc).__name__}: {exc}")
    got.append(repr(asked))
    (out_dir / f"rank{rank}.txt").write_text("\n".join(got))
    mesh.close()


def test_what_rank_0_decides_every_rank_receives_and_its_errors_every_rank_raises(tmp_path):
    """Mesh.decided_on_main: rank 0's answer on every rank (the question asked on rank 0 alone); a
    refusal raised on every rank with rank 0's line, and a bug named on the others instead of leaving
    them to wait out the timeout for an answer."""
    store = hosted_store(2, 120)
    start_ranks(_decided_worker, 2, (2, store.port, tmp_path))
    rank0, rank1 = ((tmp_path / f"rank{r}.txt").read_text().split("\n") for r in range(2))
    assert rank0 == ["{'rank': 0}", "ConfigError: run_dir=/x is taken; pick another", "KeyError: 'missing'", "[0]"]
    assert rank1 == ["{'rank': 0}", "ConfigError: run_dir=/x is taken; pick another",
                     "RuntimeError: rank 0 failed where every rank waits on its answer: KeyError('missing')", "[]"]


# --- a default group that was there before (accelerate's, under transformers' Trainer) ---------------

def _borrowed_worker(rank, world, port, out_dir):
    """As under a Trainer that torch.distributed is initialised for: the default group exists before
    distzo's mesh. Two meshes in turn (a second train()), each closed; then the default group."""
    set_rank_env(rank, world, port)
    import torch.distributed as dist

    from distzo.parallel.mesh import Mesh

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    before = len(dist.distributed_c10d._world.pg_map)
    got = []
    for text in ("2x2", "1x4"):
        mesh = Mesh.create(text, "cpu", timeout_s=60)
        got.append(mesh.all_gather_object(rank, patient=True))
        mesh.close()
        got.append(len(dist.distributed_c10d._world.pg_map) - before)  # groups the mesh left behind
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)  # the owner's group still works
    got.append(float(t))
    dist.destroy_process_group()
    (out_dir / f"rank{rank}.txt").write_text(repr(got))


def test_a_mesh_on_a_default_group_made_before_it_leaves_that_group_to_its_owner(tmp_path):
    """Mesh.close() takes down the groups the mesh made (its axes', the node's, the patient gloo one)
    and leaves a default group it found initialised: a Trainer under torchrun with use_cpu=True (or on
    GPUs) evaluates with accelerate's group after train(), and a second train() builds another mesh."""
    store = hosted_store(4, 120)
    start_ranks(_borrowed_worker, 4, (4, store.port, tmp_path))
    for r in range(4):
        assert (tmp_path / f"rank{r}.txt").read_text() == repr([[0, 1, 2, 3], 0, [0, 1, 2, 3], 0, 6.0])


# --- bad input and failures end the job --------------------------------------------------------------

@pytest.mark.parametrize("mesh,nproc,message", [
    ("3x3", 2, "mesh=3x3 needs 9 processes but the job has 2"),
    ("3x3", 4, "mesh=3x3 needs 9 processes but the job has 4"),
    ("abc", 2, "mesh='abc' is not PxD"),
    ("0x4", 2, "both degrees must be at least 1"),
])
def test_bad_mesh_fails_on_every_rank_without_a_hang(tmp_path, mesh, nproc, message):
    start = time.time()
    r = torchrun(nproc, "model=tiny", f"mesh={mesh}", cwd=tmp_path, timeout=120)
    assert r.returncode != 0 and time.time() - start < 60
    ours = [line for line in r.stderr.splitlines() if line.startswith("distzo: error:")]
    assert len(ours) == nproc and all(message in line for line in ours), r.stderr[-2000:]
    assert not (tmp_path / "outputs").exists()


def test_multirun_under_torchrun_is_refused(tmp_path):
    r = torchrun(2, "model=tiny", "-m", "optim.lr=1e-4,1e-3", cwd=tmp_path, timeout=120)
    ours = [line for line in r.stderr.splitlines() if line.startswith("distzo: error:")]
    assert r.returncode != 0 and len(ours) == 2 and all("cannot run under torchrun" in x for x in ours)
    assert not any(tmp_path.iterdir())


def test_a_killed_rank_ends_the_job(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "distzo",
           "train", *TINY, "steps=100000", "mesh=2x1", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=tmp_path)
    try:
        victim = None
        deadline = time.time() + 120
        while victim is None and time.time() < deadline:
            time.sleep(1)
            metrics = tmp_path / "run" / "metrics.jsonl"
            if metrics.exists() and '"type": "train"' in metrics.read_text():
                for child in psutil.Process(proc.pid).children(recursive=True):
                    try:
                        if child.environ().get("RANK") == "1":
                            victim = child
                    except psutil.Error:
                        pass
        assert victim is not None, "training never started"
        os.kill(victim.pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "SIGKILL" in output or "Signal 9" in output or "exitcode  : -9" in output, output[-3000:]
    # The surviving rank says in one line that it lost its peer, with no traceback of its own (torchrun
    # prints one of its agent) and none of Hydra's "Error executing job" report (it may also be stopped
    # by torchrun before it gets to say anything).
    assert not re.search(r'File ".*/distzo/', output) and "Error executing job" not in output, output[-3000:]
    lost = [line for line in output.splitlines() if "lost its peers" in line]
    assert all(line.startswith("distzo: error: rank 0 lost its peers (") for line in lost), lost
