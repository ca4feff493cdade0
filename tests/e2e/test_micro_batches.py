"""Micro-batches (`micro_batch_size`): a rank's shard goes through each block in pieces under the same
perturbation, so the step is the step of the whole batch: the same weights on 1x1 and 1x2."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from distzo.run.training import train
from tests.conftest import make_config
from tests.distributed.launch import run_forked

BASE = ("model=tiny", "task=synthetic-cue", "eval_every=0", "log_every=1000", "checkpoint.every=0", "steps=6",
        "batch_size=16", "optim.lr=1e-3", "seed=2", "task.val_size=16", "task.test_size=16", "threads=1")


def weights(run_dir):
    return load_file(run_dir / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    train(make_config(*BASE), out)
    return weights(out)


@pytest.mark.parametrize("mesh,nproc", [("1x1", 1), ("1x2", 2)])
def test_micro_batches_give_the_step_of_the_whole_batch(tmp_path, whole, mesh, nproc):
    """micro_batch_size=4 of a global batch of 16 (four pieces a rank on 1x1, two on 1x2). Pieces pack
    fewer prompts per row, so float32 rounding of the losses differs as between data-parallel layouts;
    held to the tolerance of tests/distributed/test_estimator_layouts.py: 1e-4 of how far training
    moved the weights, and they must have moved."""
    out = tmp_path / "micro"
    r = run_forked(nproc, ["train", *BASE, f"mesh={mesh}", "micro_batch_size=4", f"hydra.run.dir={out}"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = weights(out)
    start = make_config(*BASE)
    from distzo.models.loading import load_model

    model, _ = load_model(start.model)
    initial = model.state_dict()
    moved = max(float((whole[k] - initial[k]).abs().max()) for k in whole)
    diff = max(float((whole[k] - got[k]).abs().max()) for k in whole)
    assert moved > 1e-3 and diff < 1e-4 * moved, (diff, moved)
