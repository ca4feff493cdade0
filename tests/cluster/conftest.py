"""Fixtures for the cluster tests: a throw-away one-node SLURM cluster."""

from __future__ import annotations

import os

import pytest

from tests.cluster.slurm import LocalSlurm, SlurmError, SlurmUnavailable


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A one-node SLURM on localhost (installed with apt-get when missing). It skips only where this machine can
    never run it (not root, or no apt-get to install it); an install or start that fails fails the tests, since a
    skipped cluster test on a machine that can run them is a hole nobody sees."""
    root = tmp_path_factory.mktemp("slurm")
    os.chmod(root, 0o700)  # munged refuses a socket directory that others can write
    cluster = LocalSlurm(root, cpus=max(4, os.cpu_count() or 1))  # a 2x2 mesh of srun tasks
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        pytest.skip(f"no test SLURM cluster: {exc}")
    except SlurmError as exc:
        raise pytest.fail.Exception(f"the test SLURM cluster did not start: {exc}", pytrace=False) from None
    yield cluster
    cluster.stop()
