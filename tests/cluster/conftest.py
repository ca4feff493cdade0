"""Fixtures for the cluster tests: a throw-away one-node SLURM cluster."""

from __future__ import annotations

import os

import pytest

from tests.cluster.slurm import LocalSlurm, SlurmUnavailable


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A one-node SLURM on localhost (installed with apt-get when missing); skips unless root."""
    if os.geteuid() != 0:
        pytest.skip("SLURM tests need root: they install slurm-wlm and munge and start a one-node cluster on localhost")
    root = tmp_path_factory.mktemp("slurm")
    os.chmod(root, 0o700)  # munged refuses a socket directory that others can write
    cluster = LocalSlurm(root, cpus=max(4, os.cpu_count() or 1))  # a 2x2 mesh of srun tasks
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        pytest.skip(f"no test SLURM cluster: {exc}")
    yield cluster
    cluster.stop()
