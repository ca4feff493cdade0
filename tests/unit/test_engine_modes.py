"""`build_engine` picks each mode once, from the configuration and the mesh: the one step loop, built
with the mode's store (and P-RGE's stacked probes), among the registered engine modes."""

from __future__ import annotations

import pytest
import torch

from distzo.engine import EngineConfigError, EngineSetup, StageLoop, build_engine, work_division
from distzo.engine.offload import OffloadStore
from distzo.engine.stores import ResidentStore
from distzo.models.loading import random_model
from distzo.models.selection import adapter_for
from distzo.parallel.mesh import Mesh
from distzo.parallel.node import Node
from distzo.parallel.shape import MeshShape
from distzo.peft import apply_peft
from distzo.zo.directions import Directions
from distzo.zo.estimators import build_estimator
from distzo.zo.params import TrainableParams
from tests.conftest import make_config


def engine_for(*overrides, vocab: int = 300):
    from distzo.models.quantize import quantize_base

    cfg = make_config("model=tiny", *overrides)
    model = random_model("llama", vocab, {}, 0, torch.float32)
    quantize_base(model, cfg.model.quantize)
    apply_peft(model, cfg.peft)
    params = TrainableParams.from_model(model)
    estimator = build_estimator(cfg.estimator)
    return build_engine(EngineSetup(Mesh.single(), model, adapter_for(model), params, Directions(0), estimator,
                                    cfg.engine, cfg.offload, cfg.comm, str(cfg.peft.method), cfg.micro_batch_size))


STACKED = "resident, each rank's probes in one batched forward over stacked LoRA B copies"


@pytest.mark.parametrize("overrides,store,stacked,mode,described", [
    ((), ResidentStore, False, "resident", "resident"),
    (("offload=cpu",), OffloadStore, False, "offload", "blocks offloaded to host memory"),
    (("offload=cpu", "offload.transfer_dtype=bfloat16"), OffloadStore, False, "offload",
     "blocks offloaded to host memory, moved in bfloat16"),
    (("estimator=prge", "peft=lora_fa"), ResidentStore, True, "stacked-lora", STACKED + " (materialised)"),
    (("estimator=prge", "peft=lora_fa", "estimator.prge.materialize=false"), ResidentStore, True, "stacked-lora",
     STACKED + " (drawn inside each layer)"),
    (("peft=lora",), ResidentStore, False, "resident", "resident"),
])
def test_the_mode_is_chosen_at_construction(overrides, store, stacked, mode, described):
    engine = engine_for(*overrides)
    assert type(engine) is StageLoop and type(engine.store) is store and engine.mode == mode
    assert (engine.stacked is not None) == stacked
    assert engine.describe() == described


def fake_mesh(shape, node_size, device="cpu"):
    return Mesh(MeshShape.parse(shape), torch.device(device), rank=0, node=Node(local_rank=0, size=node_size))


def division(cfg, mesh):
    return work_division(EngineSetup(mesh, None, None, None, Directions(0), build_estimator(cfg.estimator), cfg.engine,
                                     cfg.offload, cfg.comm, str(cfg.peft.method)))


@pytest.mark.parametrize("overrides,shape,node,why", [
    ((), "2x1", 1, None),  # no peers on the machine: not divided, no error under auto
    (("offload=cpu",), "2x1", 2, "offloaded runs divide the update by slices already"),
    (("estimator=agzo",), "2x1", 2, "it serves full-parameter runs of the block-streaming estimators"),
    (("peft=lora",), "2x1", 2, "it serves full-parameter runs of the block-streaming estimators"),
    (("estimator.q=1",), "4x1", 4, "would have no perturbed probe"),
])
def test_work_division_says_why_it_cannot_apply(overrides, shape, node, why):
    cfg = make_config("model=tiny", *overrides)
    mesh = fake_mesh(shape, node)
    assert division(cfg, mesh) is False
    forced = make_config("model=tiny", *overrides, "engine.divide_work=true")
    if node > 1:
        with pytest.raises(EngineConfigError, match=why):
            division(forced, mesh)


def test_work_division_applies_where_every_rank_has_a_perturbed_evaluation():
    cfg = make_config("model=tiny", "estimator.q=2")
    assert division(cfg, fake_mesh("4x1", 4)) is True
    assert division(cfg, fake_mesh("2x2", 4)) is True


def test_the_run_layer_never_asks_which_mode_runs():
    """The driver, evaluation, bench and snapshots use the engine's interface only: no `engine.mode`
    (nor an isinstance test on an engine class) in distzo/run/ or distzo/state/."""
    import ast
    from pathlib import Path

    import distzo.engine as engine_package

    root = Path(engine_package.__file__).parents[1]
    classes = {"StageLoop", "ResidentStore", "OffloadStore", "SlicedOffloadStore", "NodeSharedStore"}
    found = []
    for path in [*root.joinpath("run").rglob("*.py"), *root.joinpath("state").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "mode" and "engine" in ast.unparse(node.value):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.Name) and node.id in classes:
                found.append(f"{path.name}:{node.lineno} {node.id}")
    assert not found, found


@pytest.mark.parametrize("overrides", [(), ("offload=cpu",), ("peft=lora",)])
@pytest.mark.parametrize("replace", ["to cpu:0", "half", "in place"])
def test_parameters_given_new_tensors_while_read_are_refused(overrides, replace):
    """`model.to("cpu:0")` (what accelerate's prepare_model does on a distributed CPU job) copies every
    parameter, `half()` casts them: inside `materialized()` either would leave the engine updating
    tensors the model no longer reads, so it raises, naming the fix. Writing into the parameters in
    place (loading a state dict) keeps their tensors and is allowed."""
    from distzo.engine.base import ParametersReplaced

    engine = engine_for(*overrides)
    model = engine.model

    def read_then(change):
        with engine.materialized():
            change()

    if replace == "in place":
        read_then(lambda: model.load_state_dict(model.state_dict()))
        return
    change = (lambda: model.to(torch.device("cpu", 0))) if replace == "to cpu:0" else model.half
    with pytest.raises(ParametersReplaced, match="move, cast or wrap the model before training starts"):
        read_then(change)


@pytest.mark.parametrize("overrides", [("offload=cpu",), ("offload=cpu", "offload.transfer_dtype=bfloat16"),
                                       ("offload=cpu", "peft=lora", "model.quantize=int8")])
def test_the_stock_forward_of_an_offloaded_model_streams_its_blocks(overrides):
    """What transformers' Trainer evaluates through mid-run on a GPU, where offloaded blocks (or a
    streamed quantized base's) live in host memory (the engine's `stock_forward`): each block's
    parameters stand in from its slot while the block runs, and are the host copies again
    afterwards. Forced on the CPU: the logits equal the plain forward's bitwise (the same values, the
    same operations), except through a bfloat16 transfer, which rounds the block weights as the
    engine's own walk reads them; the parameters, hooks and slots are as before."""
    engine = engine_for(*overrides)
    model, store = engine.model, engine.store
    q_proj = model.model.layers[1].self_attn.q_proj
    read = []
    probe = q_proj.register_forward_pre_hook(lambda m, a: read.append(m._parameters["weight"]))
    ids = torch.tensor([[5, 17, 33, 9, 120, 7]])
    with engine.materialized():
        before = list(model.parameters())
        with torch.inference_mode():
            plain = model(ids).logits
            with store.stock_forward(force=True):
                streamed = model(ids).logits
        assert all(a is b for a, b in zip(model.parameters(), before))
    probe.remove()
    assert read[0] is q_proj._parameters["weight"] and read[1] is not read[0]  # the host copy, then its slot's
    assert not any(m._forward_pre_hooks for m in model.modules() if m is not q_proj)
    if "offload.transfer_dtype=bfloat16" in overrides:
        assert not torch.equal(streamed, plain) and torch.allclose(streamed, plain, atol=5e-2)
    else:
        assert torch.equal(streamed, plain)


def test_greedy_decoding_through_streamed_blocks_is_the_plain_decoding():
    """Generation tasks evaluate with the stock `generate` (KV cache) on the master weights; where the
    blocks live in host memory on a GPU each decode step's forward streams them (`stock_forward`).
    Forced on the CPU, the answers are the plain decoding's (its argmax over the same logits)."""
    from distzo.data.decoding import greedy_decode
    from distzo.models.loading import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    engine = engine_for("offload=cpu", vocab=len(tokenizer))
    model = engine.model
    prompts = [tokenizer("Q: what is red A:").input_ids, tokenizer("Q: name a cat A:").input_ids]
    with engine.materialized(), torch.inference_mode():
        plain = greedy_decode(model, tokenizer, prompts, 6, "\n", tokenizer.pad_token_id)
        with engine.store.stock_forward(force=True):
            streamed = greedy_decode(model, tokenizer, prompts, 6, "\n", tokenizer.pad_token_id)
    assert streamed == plain and any(answer.strip() for answer in plain)
