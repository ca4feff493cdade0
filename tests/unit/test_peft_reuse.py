"""apply_peft on a model object that already carries distzo's adapter (a second ZOTrainer.train() on
the same model, or its auto_find_batch_size retry): the adapter is kept and trained on, not attached
twice; other settings are refused before anything changes; another library's LoRA layer (loralib's,
MeZO's: an nn.Linear with lora_B but no lora_scale) is not taken for distzo's."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from distzo.config.schema import PeftConfig, PeftMethod
from distzo.errors import DistzoError
from distzo.models.loading import random_model
from distzo.peft import apply_peft, attached_peft


def tiny_llama() -> nn.Module:
    return random_model("llama", 300, {}, 0, torch.float32)


def lora(method: str = "lora", **settings) -> PeftConfig:
    return PeftConfig(method=PeftMethod(method), **settings)


def test_a_carried_adapter_is_kept_with_its_values_and_one_hook():
    model = tiny_llama()
    apply_peft(model, lora())
    q_proj = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        q_proj.lora_B.add_(0.5)  # as training left it
    trained = q_proj.lora_B.detach().clone()
    assert attached_peft(model) == "lora r=8 alpha=16 targets=[q_proj, v_proj]"
    apply_peft(model, lora(targets=["v_proj", "q_proj", "q_proj", "c_attn"]))  # the same layers selected
    assert torch.equal(q_proj.lora_B, trained) and len(q_proj._forward_hooks) == 1
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("cfg,asked", [
    (lora(r=4), "lora r=4 alpha=16"),
    (lora(alpha=32.0), "lora r=8 alpha=32"),
    (lora("lora_fa"), "lora_fa r=8 alpha=16"),
    (lora(targets=["q_proj"]), "lora r=8 alpha=16 targets=[q_proj];"),
    (lora("prefix"), "prefix prefix_tokens=5"),
])
def test_other_settings_are_refused_before_anything_changes(cfg, asked):
    model = tiny_llama()
    apply_peft(model, lora())
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(DistzoError, match=r"carries distzo's lora r=8 alpha=16 targets=\[q_proj, v_proj\] adapter "
                                          r".*asks for " + re.escape(asked)):
        apply_peft(model, cfg)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    with pytest.raises(DistzoError, match="peft=none would train the frozen model under it"):
        apply_peft(model, lora("none"))


def test_another_librarys_lora_layer_is_not_distzos():
    class ForeignLoRALinear(nn.Linear):  # loralib's / MeZO's shape: lora_A, lora_B, scaling
        def __init__(self):
            super().__init__(4, 4)
            self.lora_A = nn.Parameter(torch.zeros(2, 4))
            self.lora_B = nn.Parameter(torch.zeros(4, 2))
            self.scaling = 1.0

    model = nn.Sequential(ForeignLoRALinear())
    assert attached_peft(model) is None
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    apply_peft(model, lora("none"))  # its own trainable set: nothing to refuse, nothing changed
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    with pytest.raises(DistzoError, match=r"0 already carries another library's LoRA \(ForeignLoRALinear"):
        apply_peft(model, lora(targets=["0"]))  # distzo's pair would replace its own, applied twice
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before  # refused before freezing
