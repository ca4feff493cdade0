"""offload=cpu through the whole driver, 1x1 and 2x2: the same weights and the same evaluations as
resident training, for a tied Llama, an OPT and an untied Qwen2 random model; 4x1, where two of
the four ranks are dealt no evaluation yet must walk every sliced block with their peers; and the
optimizers with state, streamed with the blocks and held once per node."""

import json

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


def resident_and_offloaded_on_2x2(tmp_path, *args) -> list[dict]:
    """The same 2x2 run resident and with offload=cpu on one slot: weights and evaluations equal,
    bitwise; the two runs' summaries."""
    weights_r, evals_r = run(tmp_path, "resident", 4, *args)
    weights_o, evals_o = run(tmp_path, "offloaded", 4, *args, "offload=cpu", "offload.slots=1")
    assert all(torch.equal(weights_r[k], weights_o[k]) for k in weights_r)
    assert evals_r == evals_o
    return [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("resident", "offloaded")]


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
    every rank through all-gathers, so they walk them (and pay the same pending updates) with their peers;
    a rank awaiting the update at a different stage once waited in another collective until the timeout."""
    weights_r, evals_r = run(tmp_path, "resident", 1, "model=tiny")
    weights_o, evals_o = run(tmp_path, "sliced", 4, "model=tiny", "mesh=4x1", "offload=cpu", "dist_timeout_s=60")
    assert all(torch.equal(weights_r[k], weights_o[k]) for k in weights_r)
    assert evals_r == evals_o


@pytest.mark.parametrize("optimizer", ["momentum", "adam", "sign"])
def test_offloaded_optimizer_state_equals_resident_on_a_sliced_mesh(tmp_path, optimizer):
    """2x2 with one slot: the node's four ranks share one host master and one copy of the
    optimizer's state, each uploading, updating and writing back its slice of both every step; the
    weights and evaluations are the resident run's (whose ranks share the master and the state
    under work division), bitwise."""
    args = ["model=tiny", "mesh=2x2", "estimator.q=2", f"optim.name={optimizer}", "optim.weight_decay=0.1"]
    summaries = resident_and_offloaded_on_2x2(tmp_path, *args)
    assert [s["engine"] for s in summaries] == ["divided", "offload-sliced"]
    slots = {"momentum": 1, "adam": 2, "sign": 0}[optimizer]
    one_copy = summaries[0]["optimizer_state_bytes"]
    assert one_copy == summaries[1]["optimizer_state_bytes"] == 4 * slots * summaries[0]["trainable_parameters"]
    assert all(s["optimizer"] == optimizer for s in summaries)
    # divided: one copy on the node; sliced: one copy of the blocks' state (plus its slices' padding)
    # and, like the outer stage's weights, a private copy of the outer stage's state on every rank
    pages = 4096 * 4 * slots  # Pss is counted in kB per rank, and mappings end on whole pages
    assert abs(summaries[0]["optimizer_state_node_bytes"] - one_copy) <= pages
    outer, blocks = outer_parameters()
    padding = 4 * slots * 4 * 256 * blocks  # each block padded to 4 slices of 256-element multiples
    node = summaries[1]["optimizer_state_node_bytes"]
    assert one_copy + 3 * 4 * slots * outer - pages <= node <= one_copy + 3 * 4 * slots * outer + padding + pages
    assert slots == 0 or node < 4 * one_copy


def outer_parameters() -> tuple[int, int]:
    """The tiny preset's trainable elements outside its blocks (embedding, final norm), and its blocks."""
    from distzo.models import adapter_for, load_model
    from tests.conftest import make_config

    model, _ = load_model(make_config("model=tiny").model)
    blocks = adapter_for(model).blocks
    in_blocks = {id(p) for _, block in blocks for p in block.parameters()}
    outside = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if id(p) not in in_blocks)
    return outside, len(blocks)


def test_offloaded_fzoo_equals_resident_on_a_sliced_mesh(tmp_path):
    """FZOO keeps no state: it rescales the step's coefficients by the spread of its one-sided losses,
    then pays sgd's update. On 2x2 with one slot (each rank moves its slice of every block) the
    weights and evaluations are the resident run's, bitwise."""
    args = ["model=tiny", "mesh=2x2", "optim.name=fzoo", "estimator.difference=forward", "estimator.q=4",
            "estimator.distribution=rademacher"]
    summary = resident_and_offloaded_on_2x2(tmp_path, *args)[1]
    assert summary["optimizer"] == "fzoo" and summary["optimizer_state_bytes"] == 0


def test_offloaded_hizoo_equals_resident_on_a_mesh_streaming_whole_blocks(tmp_path):
    """HiZOO's probes read the Hessian of the whole block, so on 2x2 with offload=cpu each rank streams
    whole blocks with their state (the `offload` mode, not the sliced one), the state going up with
    every block, pending update or not: weights, Hessian and evaluations are the resident run's
    (the node's ranks share the master and the Hessian under work division), bitwise."""
    args = ["model=tiny", "mesh=2x2", "estimator.clean=true", "optim.name=hizoo", "optim.alpha=1e-3",
            "optim.weight_decay=0.1", "checkpoint.every=4"]
    summaries = resident_and_offloaded_on_2x2(tmp_path, *args)
    assert [s["engine"] for s in summaries] == ["divided", "offload"]
    states = [read_state(sorted((tmp_path / name / "checkpoints").iterdir())[-1]) for name in ("resident", "offloaded")]
    assert states[0].keys() == states[1].keys() and all(k.startswith("hessian/") for k in states[0])
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert any(bool((v != 1).any()) for v in states[0].values())  # the Hessian moved


def read_state(snapshot):
    from distzo.state.snapshots import read_optimizer_state

    return read_optimizer_state(snapshot)


@pytest.mark.parametrize("mesh,nproc,settings", [
    ("1x1", 1, ["peft=lora", "model.quantize=int8", "engine.quantized_matmul=decoded"]),
    ("2x2", 4, ["peft=lora", "model.quantize=int4", "estimator.q=2"]),
    ("2x2", 4, ["estimator=prge", "peft=lora_fa", "model.quantize=int8", "estimator.q=2", "optim.lr=0.5"]),
])
def test_a_streamed_quantized_base_equals_its_resident_run(tmp_path, mesh, nproc, settings):
    """offload=cpu with adapters: the adapters stay resident and the frozen base streams from host
    memory in its quantized form (engine/streamed_base.py): on 2x2 the node's four ranks share one
    host copy, each uploading a slice of every block's bytes and all-gathering the rest. The same
    operations on the same shapes as the resident run: the adapters and the evaluations are equal,
    bitwise, also with each weight decoded into the shared buffer (engine.quantized_matmul=decoded);
    each step moves about the quantized base's bytes, not its float32 bytes."""
    args = ["model=tiny", f"mesh={mesh}", *settings]
    out = {}
    for name, extra in (("resident", []), ("streamed", ["offload=cpu", "offload.slots=1"])):
        run_dir = tmp_path / name
        r = torchrun(nproc, *BASE, *args, *extra, f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert r.returncode == 0, f"{name}:\n{r.stderr[-3000:]}"
        evals = [(m["step"], m["split"], m["accuracy"], m["loss"]) for m in read_jsonl(run_dir / "metrics.jsonl")
                 if m["type"] == "eval"]
        out[name] = (load_file(run_dir / "final" / "adapter.safetensors"), evals,
                     json.loads((run_dir / "summary.json").read_text()))
    (a, evals_r, summary_r), (b, evals_s, summary_s) = out["resident"], out["streamed"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert evals_r == evals_s and summary_r["engine"] in ("resident", "stacked-lora")
    assert summary_s["engine"] == ("offload-base" if nproc == 1 else "offload-base-sliced")
    quantized, everything = summary_s["quantized_bytes"], summary_s["host_master_copy_bytes"]
    # the host copy is the quantized layers plus the blocks' float frozen tensors: their norms (2 x 2 x 64
    # float32) and LoRA-FA's frozen A (2 blocks x 2 targets x r=8 x 64 float32), and alignment padding
    assert quantized < everything <= quantized + 4 * (2 * 2 * 64 + 2 * 2 * 8 * 64) + 16 * 64
    slice_share = everything / (4 if nproc == 4 else 1)
    per_step = summary_s["h2d_bytes_per_step"]  # one walk of the blocks (the sliced path: my slice of each)
    assert slice_share <= per_step <= everything + 4096
    assert per_step < summary_s["quantized_float32_bytes"] / (4 if nproc == 4 else 1)


STRUCTURED = {  # the structured directions (docs/estimators.md), renewing their factors, thresholds and
    # momentum within the run's six steps
    "lozo-m": ["estimator=lozo", "estimator.lazy_interval=2", "estimator.factor_momentum=0.9"],
    "subzero": ["estimator=subzero", "estimator.rank=4", "estimator.subspace_interval=2"],
    "sparse": ["estimator=sparse_mezo", "estimator.mask_interval=2", "optim.lr=1e-2"],
}


@pytest.mark.parametrize("name", list(STRUCTURED))
@pytest.mark.parametrize("mesh,nproc,slots", [("1x1", 1, 3), ("2x2", 4, 1)])
def test_structured_directions_offloaded_equal_resident(tmp_path, name, mesh, nproc, slots):
    """LOZO-M, SubZero and Sparse MeZO: on 1x1 the offloaded blocks' chunk passes draw the factors and
    read the masks as the resident ones do; on 2x2 each rank updates only its slice of a block while the
    resident run divides the node's chunks, and LOZO-M's momentum factors advance on every rank from the
    steps it recorded. Weights and evaluations bitwise."""
    args = ["model=tiny", f"mesh={mesh}", "estimator.q=2", *STRUCTURED[name]]
    weights_r, evals_r = run(tmp_path, "resident", nproc, *args)
    weights_o, evals_o = run(tmp_path, "offloaded", nproc, *args, "offload=cpu", f"offload.slots={slots}")
    assert all(torch.equal(weights_r[k], weights_o[k]) for k in weights_r)
    assert evals_r == evals_o
