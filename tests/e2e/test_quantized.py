"""A quantized frozen base under the adapters (model.quantize, distzo.models.quantize): the quantized
layers' bytes against float32's in the run's summary and in bench, LoRA / LoRA-FA / prefix training
on an int8 and an int4 (NF4) base, the PEFT round trip on the same quantized base, and the one-line
refusal of a quantized base with every weight trainable. The mesh invariance of a quantized-base run
is in tests/distributed/test_estimator_layouts.py (lora-int8, lora-int4, prge-int4)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import make_config
from tests.distributed.launch import run_forked
from tests.e2e.test_tasks import FAST, peft_adapter_gives_distzos_logits, trained

CUE = ("task=synthetic-cue", "task.val_size=16", "task.test_size=16")
# The quantized layers' bytes (values with their scales) over the same layers in float32: at most
# (issue 37's bounds; per-row int8 is 1/4 plus a float32 scale per row, NF4 1/8 plus its block scales).
BOUND = {"int8": 0.3, "int4": 0.175}


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_lora_on_a_quantized_base_trains_reports_its_bytes_and_exports_to_peft(tmp_path, quantize):
    settings = (*CUE, "peft=lora", f"model.quantize={quantize}")
    run_dir, summary, _ = trained(tmp_path, quantize, *settings, "steps=8", "optim.lr=1e-2", "estimator.eps=1e-2")
    assert summary["quantize"] == quantize and summary["quantized_layers"] == 14  # 2 blocks x 7 projections
    assert 0 < summary["quantized_bytes"] <= BOUND[quantize] * summary["quantized_float32_bytes"]
    assert summary["quantized_bytes_ratio"] == pytest.approx(
        summary["quantized_bytes"] / summary["quantized_float32_bytes"], abs=1e-4)
    peft_adapter_gives_distzos_logits(run_dir, *settings)


@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_an_nf4_base_trains_the_same_with_the_cpu_kernels_decoding_it(tmp_path, compute):
    """With the C kernels (engine.native=auto, the default), torchao's NF4 linears on a CPU decode
    their weights in one pass into a shared buffer and run F.linear on it (models/decode.py); without
    them (engine.native=false) torchao's own forward runs. The two runs are one run, bitwise: the same
    trained weights (the replicas' checksums) and the same test evaluation, in float32 and in bfloat16
    compute (autocast: the weight decoded to bfloat16, as autocast casts torchao's)."""
    settings = (*CUE, "peft=lora", "model.quantize=int4", "steps=6", "optim.lr=1e-2", "estimator.eps=1e-2",
                f"engine.compute={compute}")
    _, kernels, tested = trained(tmp_path, "kernels", *settings)
    _, torch_ops, tested_torch = trained(tmp_path, "torch", *settings, "engine.native=false")
    assert kernels["replica_checksums"] == torch_ops["replica_checksums"]
    assert tested["loss"] == tested_torch["loss"] and tested["accuracy"] == tested_torch["accuracy"]


def test_the_quantized_weights_are_torchaos_and_the_rest_stays_float():
    from distzo.config.compose import typed
    from distzo.models.loading import load_model
    from distzo.models.quantize import quantize_base

    cfg = typed(make_config(*FAST, *CUE, "peft=lora", "model.quantize=int8"))
    model, _ = load_model(cfg.model)
    ids = torch.tensor([[5, 9, 2, 7, 1, 3]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    report = quantize_base(model, "int8")
    quantized = {name for name, _ in model.named_modules() if name in set(report.layers)}
    assert len(quantized) == 14 and all(".layers." in n for n in quantized)
    for name, p in model.named_parameters():
        kind = type(p.data).__name__ if hasattr(p, "data") else type(p).__name__
        if name.rsplit(".", 1)[0] in quantized:
            assert kind == "Int8Tensor" and not p.requires_grad, name
        else:
            assert kind == "Tensor", name  # embeddings, norms, the head: float
    with torch.no_grad():
        after = model(input_ids=ids).logits
    # per-row int8 moves the logits of a random model by its rounding, not more
    assert 0 < float((after - before).abs().max()) < 0.05


@pytest.mark.parametrize("settings", [("peft=lora_fa", "estimator=prge"), ("peft=prefix",)])
def test_other_adapters_train_on_a_quantized_base(tmp_path, settings):
    run_dir, summary, _ = trained(tmp_path, "run", *CUE, *settings, "model.quantize=int4", "steps=4")
    assert summary["quantize"] == "int4" and summary["steps"] == 4
    assert summary["quantized_bytes"] <= BOUND["int4"] * summary["quantized_float32_bytes"]


def test_bench_reports_the_quantized_bytes(tmp_path):
    r = run_forked(1, ["bench", "model=tiny", *CUE, "peft=lora", "model.quantize=int4", "bench.warmup=1",
                       "bench.steps=1", f"hydra.run.dir={tmp_path / 'b'}"], cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert out["quantize"] == "int4" and out["quantized_bytes"] <= BOUND["int4"] * out["quantized_float32_bytes"]
    assert "quantized base     int4: 14 linear layers" in r.stdout


def test_a_quantized_base_with_every_weight_trainable_is_one_line(tmp_path):
    r = run_forked(1, ["train", *FAST, *CUE, "model.quantize=int8", f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "distzo: error: model.quantize=int8 quantizes a frozen base, and peft=none trains every weight of it; add "
        "peft=lora (or lora_fa, prefix), or use model.quantize=none")
    assert not (tmp_path / "r").exists()
