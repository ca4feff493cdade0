"""Model FLOPs utilisation (distzo.telemetry.flops), the card table it reads, and the model checks the
table's workload relies on (learned positions, where random weights are drawn)."""

from __future__ import annotations

import pytest
import torch

from distzo.errors import ConfigError
from distzo.models.checks import check_positions
from distzo.models.loading import random_model
from distzo.telemetry.flops import card_peak_tflops, forward_precision, model_flops_utilisation
from tests.conftest import make_config


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                       ("NVIDIA H200", 989.0), ("NVIDIA H20", 148.0),
                                       ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA GeForce RTX 4090", None)])
def test_cards_are_matched_longest_name_first(name, peak):
    assert card_peak_tflops(name, "half") == peak


def test_the_forward_arithmetic_picks_the_peak():
    assert forward_precision("float16", "fp32") == forward_precision("bfloat16", "fp32") == "half"
    assert forward_precision("float32", "bf16") == "half"
    assert forward_precision("float32", "tf32") == "tf32" and forward_precision("float32", "fp32") == "fp32"
    assert forward_precision("float64", "fp32") is None
    assert card_peak_tflops("NVIDIA H100 80GB HBM3", "tf32") == 495.0
    assert card_peak_tflops("NVIDIA H100 80GB HBM3", "fp32") == 67.0


def test_mfu_reproduces_the_papers_own_arithmetic():
    """shared/notes/opt-shapes.md: DistZO2's MeZO column for OPT-1.3B on an H20 (18,720 tokens/s, two
    forward passes a step) is 2 x 1.32e9 x 2 x 18,720 = 99 TFLOP/s, 67% of the card's 148."""
    tokens = 4 * 2048
    m = model_flops_utilisation(1_320_000_000, tokens, 2, tokens / 18_720, 1, "NVIDIA H20", "half", None)
    assert m["achieved_tflops"] == pytest.approx(98.8, abs=0.1)
    assert m["value"] == pytest.approx(0.6677, abs=1e-4) and m["peak_tflops"] == 148.0
    two = model_flops_utilisation(1_320_000_000, tokens, 2, tokens / 18_720, 2, "NVIDIA H20", "half", None)
    assert two["value"] == pytest.approx(m["value"] / 2, abs=1e-4)  # the same throughput on twice the cards
    given = model_flops_utilisation(1_000, 10, 2, 1.0, 1, None, "fp32", 1e-6)  # bench.peak_tflops on a CPU
    assert given["value"] == pytest.approx(2 * 1_000 * 10 * 2 / 1.0 / 1e6, abs=1e-4)
    unknown = model_flops_utilisation(1_000, 10, 2, 1.0, 1, "NVIDIA GeForce RTX 4090", "half", None)
    assert unknown["value"] is None and "bench.peak_tflops" in unknown["why_none"]


def test_learned_positions_refuse_longer_sequences():
    opt = random_model("opt", 1024, {}, 0, torch.float32, device="meta")  # 512 learned positions
    check_positions(opt, lambda: 512, "t")
    with pytest.raises(ConfigError, match="learned position embeddings stop at 512.*max_position_embeddings"):
        check_positions(opt, lambda: 513, "t")
    llama = random_model("llama", 1024, {}, 0, torch.float32, device="meta")  # rotary: extrapolates
    check_positions(llama, lambda: pytest.fail("a rotary model's check read the task"), "t")


def test_init_device_is_for_random_models_only():
    with pytest.raises(ConfigError, match="model.init_device=device sets where a random model's weights are drawn"):
        make_config("model=smollm2-135m", "model.init_device=device")
    cfg = make_config("model=opt-1.3b", "task=lm-2048", "batch_size=4")
    assert str(cfg.model.init_device) == "device" and str(cfg.model.dtype) == "float16"
