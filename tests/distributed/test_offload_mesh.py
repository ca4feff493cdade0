"""offload=cpu through the whole driver, 1x1 and 2x2: the same weights and the same evaluations as
resident training, for a tied Llama, an OPT and an untied Qwen2 random model; and 4x1, where two of
the four ranks are dealt no evaluation yet must walk every sliced block with their peers."""

import pytest
import torch
from safetensors.torch import load_file

from distzo.telemetry.jsonl import read_jsonl
from tests.distributed.launch import torchrun

BASE = ["task=synthetic-cue", "eval_every=3", "log_every=1000", "steps=6", "batch_size=8", "optim.lr=1e-3",
        "seed=4", "task.val_size=32", "task.test_size=32"]


def run(tmp_path, name, nproc, *args):
    out = tmp_path / name
    r = torchrun(nproc, *BASE, *args, f"hydra.run.dir={out}", cwd=tmp_path)
    assert r.returncode == 0, f"{name}:\n{r.stderr[-3000:]}"
    evals = [(m["step"], m["split"], m["accuracy"], m["loss"]) for m in read_jsonl(out / "metrics.jsonl")
             if m["type"] == "eval"]
    return load_file(out / "final" / "model.safetensors"), evals


@pytest.mark.parametrize("model", ["tiny", "tiny-opt", "tiny-qwen"])
@pytest.mark.parametrize("mesh,nproc,slots", [("1x1", 1, 3), ("2x2", 4, 1)])
def test_offloaded_run_equals_resident_run(tmp_path, model, mesh, nproc, slots):
    resident = run(tmp_path, "resident", nproc, f"model={model}", f"mesh={mesh}")
    offloaded = run(tmp_path, "offloaded", nproc, f"model={model}", f"mesh={mesh}", "offload=cpu",
                    f"offload.slots={slots}")
    weights_r, evals_r = resident
    weights_o, evals_o = offloaded
    assert weights_r.keys() == weights_o.keys() and all(torch.equal(weights_r[k], weights_o[k]) for k in weights_r)
    # evaluations at steps 3 and 6 see the deferred update flushed: identical to the resident run's
    assert evals_r == evals_o and [e[0] for e in evals_r] == [0, 3, 6, 6]


def test_idle_ranks_of_a_sliced_mesh_keep_in_step(tmp_path):
    """mesh=4x1 with MeZO's two evaluations: ranks 2 and 3 evaluate nothing, but the node's blocks reach
    every rank through all-gathers, so they walk them (and pay the same owed updates) with their peers;
    a rank that owed a different stage once waited in another collective until the timeout."""
    weights_r, evals_r = run(tmp_path, "resident", 1, "model=tiny")
    weights_o, evals_o = run(tmp_path, "sliced", 4, "model=tiny", "mesh=4x1", "offload=cpu", "dist_timeout_s=60")
    assert all(torch.equal(weights_r[k], weights_o[k]) for k in weights_r)
    assert evals_r == evals_o
