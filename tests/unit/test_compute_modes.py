"""engine.compute: the forward's arithmetic, with the master and the perturbations left in the
weights' dtype (docs/performance.md#compute-modes)."""

import pytest
import torch

from distzo.engine import EngineConfigError, offload_engine, resident_engine
from distzo.models.loading import random_model
from distzo.models.selection import adapter_for
from distzo.zo.directions import Directions
from distzo.zo.params import TrainableParams
from tests.engine_helpers import clean_logits, materialize
from tests.unit.test_offload import batches, train_steps


def engine(compute, offload=False, dtype=torch.float32):
    model = random_model("llama", 400, {"num_hidden_layers": 3}, 0, dtype)
    params = TrainableParams.from_model(model)
    kind = offload_engine if offload else resident_engine
    extra = {"slots": 2} if offload else {}
    return model, kind(model, adapter_for(model), params, Directions(11), eps=1e-3, compute=compute, **extra)


def test_bf16_compute_rounds_only_the_forward():
    """Logits under bfloat16 autocast differ from float32's by bfloat16's rounding of the products'
    inputs (8-bit significands: relative 2^-9 per input; over three layers of 64-wide sums the
    logits move by well under 0.05 of their spread), and are not float32's; offloading still
    changes nothing, bitwise (the same operations on the same shapes)."""
    b = next(batches(1))
    _, fp32 = engine("fp32")
    model, bf16 = engine("bf16")
    exact, rounded = clean_logits(fp32, b), clean_logits(bf16, b)
    assert exact.dtype == rounded.dtype == torch.float32
    assert not torch.equal(exact, rounded)
    assert (exact - rounded).abs().max() < 0.05 * (exact.max() - exact.min())
    # the stock forward (what decoding in evaluation runs) takes the same arithmetic inside the mode
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        plain = model(ids).logits
        with bf16.forward_arithmetic():
            mixed = model(ids).logits
    assert not torch.equal(plain, mixed) and (plain - mixed).abs().max() < 0.05 * (plain.max() - plain.min())
    _, resident = engine("bf16")
    _, offloaded = engine("bf16", offload=True)
    assert train_steps(resident, steps=3) == train_steps(offloaded, steps=3)


def test_a_float32_master_keeps_updates_that_a_bfloat16_master_loses():
    """An update of lr * c * z with lr = 1e-6 is far below half a bfloat16 ulp of weights around 0.02
    (2^-14 / 2 ~ 3e-5): a bfloat16 master keeps all but its near-zero weights (whose ulp is finer);
    with compute=bf16 the float32 master moves everywhere, while the forward runs in bfloat16."""
    moved = {}
    for name, dtype, compute in (("bf16 master", torch.bfloat16, "fp32"), ("fp32 master", torch.float32, "bf16")):
        model, eng = engine(compute, dtype=dtype)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        eng.run_probes(next(batches(1)), [], 0)
        eng.apply(0, [(0, 1.0)], 1e-6, 0.0)
        materialize(eng)
        w = "model.layers.0.mlp.down_proj.weight"
        moved[name] = (dict(model.named_parameters())[w].detach() != before[w]).float().mean().item()
    assert moved["bf16 master"] < 0.05
    assert moved["fp32 master"] > 0.9


@pytest.mark.parametrize("overrides, message", [
    (["engine.copy_stream=true"], "overlaps two CUDA streams, and this run computes on cpu"),
    (["engine.copy_stream=true", "offload=cpu"], "this run's engine is offload"),
])
def test_copy_stream_true_is_refused_where_it_cannot_apply(tmp_path, overrides, message):
    """engine.copy_stream=true asks for resident CUDA weights: a CPU run, or an offloaded one (whose
    blocks stream on their own), is refused with one error naming the setting, before training."""
    from distzo.run.training import train
    from tests.conftest import make_config

    with pytest.raises(EngineConfigError, match=message):
        train(make_config("model=tiny", "task=synthetic-cue", "steps=1", *overrides), tmp_path / "r")
    assert not (tmp_path / "r" / "final").exists()


def test_copy_stream_auto_keeps_one_stream_off_cuda(tmp_path):
    """auto resolves per run: on a CPU the resident engine walks with one stream."""
    from distzo.run.training import Trainer
    from tests.conftest import make_config

    with Trainer(make_config("model=tiny", "task=synthetic-cue", "steps=1"), tmp_path / "r") as t:
        t.fit()
        assert t.components.engine.mode == "resident" and t.components.engine.copy_streams is None


def test_tf32_is_refused_off_cuda(tmp_path):
    from distzo.run.training import train
    from tests.conftest import make_config

    with pytest.raises(EngineConfigError, match="engine.compute=tf32"):
        train(make_config("model=tiny", "task=synthetic-cue", "steps=1", "engine.compute=tf32"), tmp_path / "r")
    assert not (tmp_path / "r" / "final").exists()
