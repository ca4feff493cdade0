"""How a process learns its place in a job (distzo/parallel/launch_env.py) and the self-launch's
checks (distzo/cli/main.py start_own_workers). srun and the elastic agent themselves are exercised
for real in tests/cluster/test_launchers.py; these cover the translation rules and the refusals that
a one-node CPU machine cannot reach for real (several nodes, several GPUs)."""

from __future__ import annotations

import os

import pytest

from distzo.parallel import launch_env
from distzo.parallel.launch_env import LaunchError, adopt_slurm_environment, first_host, launcher, tasks_on_node

SLURM_AND_TORCH = ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE",
                   "SLURM_STEP_NODELIST", "SLURM_JOB_ID", "SLURM_STEP_ID", "DISTZO_LAUNCHED_BY", "TORCHELASTIC_RUN_ID",
                   *launch_env.TORCH_VARS)


@pytest.fixture
def clean_env(monkeypatch):
    """No SLURM or torch variables during the test, and the environment as it was afterwards:
    adopt_slurm_environment writes os.environ itself, which monkeypatch would not undo."""
    saved = dict(os.environ)
    for key in SLURM_AND_TORCH:
        os.environ.pop(key, None)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("nodelist,host", [("node[03-05,7],gpu1", "node03"), ("gpu1,gpu2", "gpu1"),
                                           ("localhost", "localhost"), ("a-b[10,12]", "a-b10")])
def test_first_host_of_a_node_list(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("spec,node,count", [("4", 0, 4), ("2(x3)", 2, 2), ("3,1", 1, 1), ("2(x2),1", 2, 1)])
def test_tasks_on_node(spec, node, count):
    assert tasks_on_node(spec, node) == count


def test_tasks_on_a_node_outside_the_step_is_refused():
    with pytest.raises(LaunchError, match="SLURM_NODEID=3 is not a node"):
        tasks_on_node("2(x2)", 3)


def test_an_srun_task_on_the_second_node_gets_torchs_variables(clean_env):
    """Task 5 of 8 on two nodes of 4: rank 5, local rank 1, 4 on its node, the master on the
    first host of the list, a port from the job and step, and launcher() says srun from then on."""
    env = {"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "1234",
           "SLURM_STEP_ID": "0"}
    for k, v in env.items():
        clean_env.setenv(k, v)
    assert launcher() == "srun"
    assert adopt_slurm_environment() is True
    got = {k: os.environ[k] for k in launch_env.TORCH_VARS}
    assert got == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "gpu07",
                   "MASTER_PORT": str(launch_env.PORT_BASE + (1234 * 131) % launch_env.PORT_SPAN)}
    assert launcher() == "srun" and adopt_slurm_environment() is False  # idempotent


def test_the_launched_place_is_read_from_srun_before_anything_adopted_it(clean_env):
    """launched_rank / launched_local_rank / launched_world_size adopt SLURM's variables themselves:
    the first caller (the mesh, ZOTrainer's is_local_process_zero) need not know about srun."""
    env = {"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]"}
    for k, v in env.items():
        clean_env.setenv(k, v)
    assert launch_env.launched_local_rank() == 2
    assert (launch_env.launched_rank(), launch_env.launched_world_size()) == (6, 8)


def test_a_plain_process_is_rank_zero_of_one(clean_env):
    assert (launch_env.launched_rank(), launch_env.launched_local_rank(), launch_env.launched_world_size()) == (0, 0, 1)


def test_a_set_master_address_and_port_win(clean_env):
    for k, v in {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                 "SLURM_STEP_TASKS_PER_NODE": "2", "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29511"}.items():
        clean_env.setenv(k, v)
    adopt_slurm_environment()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.9", "29511")


def test_srun_without_a_node_list_names_the_fix(clean_env):
    for k, v in {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                 "SLURM_STEP_TASKS_PER_NODE": "2"}.items():
        clean_env.setenv(k, v)
    with pytest.raises(LaunchError, match="set MASTER_ADDR to the first node's address"):
        adopt_slurm_environment()


def test_a_batch_script_without_srun_is_a_plain_process(clean_env):
    """sbatch --ntasks 4 running python itself: SLURM_NTASKS is set, SLURM_STEP_NUM_TASKS is not."""
    clean_env.setenv("SLURM_NTASKS", "4")
    clean_env.setenv("SLURM_PROCID", "0")
    assert launcher() == "none" and adopt_slurm_environment() is False


def test_a_self_launched_mesh_larger_than_the_gpus_is_one_line(clean_env, capsys):
    """On a CUDA machine a self-launched mesh starts one worker per GPU; more workers than GPUs is
    refused before anything starts (this machine has none: CUDA's device count is patched)."""
    import torch

    import distzo.parallel.mesh as mesh
    from distzo.cli.main import start_own_workers

    clean_env.setattr(mesh, "device_type", lambda device: "cuda")
    clean_env.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit) as exc:
        start_own_workers("train", ["model=tiny", "task=synthetic-cue", "mesh=2x2"])
    assert exc.value.code not in (0, None)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["distzo: error: mesh=2x2 needs 4 processes, one per GPU, but this machine shows 2 GPUs; use a mesh "
                   "of at most 2 processes here, or launch across nodes (torchrun, srun; docs/cluster.md)"]


def test_the_worker_a_signal_killed_is_the_cause_when_a_peer_failed_in_the_same_second():
    """torch's agent stamps failures in whole seconds: a peer that lost the killed worker and exited 1
    in the same poll ties with it, and the launcher must name the kill (tests/cluster kills a worker);
    the workers the agent then stopped (SIGTERM) come after a worker that exited with an error."""
    from types import SimpleNamespace as Failure

    from distzo.run.launcher import root_failure

    lost, killed, stopped = Failure(exitcode=1, timestamp=7), Failure(exitcode=-9, timestamp=7), \
        Failure(exitcode=-15, timestamp=7)
    assert root_failure({0: lost, 1: killed}) == (1, killed)
    # the agent stops the others with SIGTERM once one failed: a worker that exited with an error is the cause
    assert root_failure({0: stopped, 1: lost}) == (1, lost)
    assert root_failure({0: stopped, 1: Failure(exitcode=-15, timestamp=7)}) == (0, stopped)  # among equals
    assert root_failure({0: lost, 1: Failure(exitcode=-9, timestamp=8)}) == (0, lost)  # an earlier second first


def test_threads_beyond_the_cpus_are_warned_of_once_a_node_counting_the_nodes_ranks(clean_env, caplog):
    """threads above the process's CPUs: warned by the node's first rank only. Ranks that share the
    node's CPUs (not bound to CPUs of their own) together run threads x ranks: that must fit too.
    Far beyond (4x the process's CPUs) is refused on every rank."""
    from distzo.errors import ConfigError
    from distzo.run import session

    machine = set(range(8))
    clean_env.setattr(os, "cpu_count", lambda: len(machine))

    def warnings(threads, local_rank, ranks, cpus=machine):
        clean_env.setattr(os, "sched_getaffinity", lambda pid: set(cpus))
        clean_env.setenv("LOCAL_RANK", str(local_rank))
        clean_env.setenv("LOCAL_WORLD_SIZE", str(ranks))
        caplog.clear()
        with caplog.at_level("WARNING", logger="distzo"):
            assert session._threads(threads) == threads
        return [r.getMessage() for r in caplog.records]

    assert warnings(8, 0, 1) == [] and warnings(4, 0, 2) == []
    assert warnings(9, 0, 1) == ["threads=9 is more than the 8 CPUs this process may use, which slows the work; "
                                 "set threads to at most 8"]
    assert warnings(4, 0, 4) == ["threads=4 on each of this node's 4 ranks is 16 threads on its 8 CPUs, which slows "
                                 "the work; set threads to at most 2"]
    assert warnings(4, 1, 4) == [] and warnings(9, 3, 4) == []  # the node's other ranks say nothing
    assert warnings(2, 0, 4, cpus={0, 1}) == []  # bound to 2 CPUs of its own: 2 threads fit
    with pytest.raises(ConfigError, match="threads=33 is more than 4 times the 8 CPUs"):
        warnings(33, 2, 4)
