"""Models that carry the peft library's adapters (a PeftModel's base model, as ZOTrainer trains it):
an adapter on the input embedding or the LM head, which the layer-driving paths read by rows, sends
the model to the whole-model path, whose scores are the stock forward's with the adapter; distzo's
own adapter is not added beside the library's."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from distzo.config.schema import PeftConfig, PeftMethod
from distzo.engine import resident_engine
from distzo.errors import DistzoError
from distzo.models.adapters import UnsupportedModelError
from distzo.models.loading import random_model
from distzo.models.selection import adapter_for
from distzo.models.whole import WholeModelAdapter
from distzo.peft import apply_peft
from distzo.zo.directions import Directions
from distzo.zo.params import TrainableParams
from tests.engine_helpers import clean_logits, label_batch


def peft_llama(**settings) -> torch.nn.Module:
    """A tiny Llama under get_peft_model, its adapters away from their zero start (init_lora_weights=False,
    trainable tokens moved): the adapter changes the logits. Its base model, as ZOTrainer drives it."""
    model = random_model("llama", 300, {}, 0, torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, task_type="CAUSAL_LM", init_lora_weights=False, **settings))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "trainable_tokens_delta" in name:
                p.add_(0.5)
    return peft_model


SEQS = [[5, 17, 33, 9, 120], [7, 7, 250, 3], [44, 12, 6, 99, 140, 2, 11]]
LABELS = torch.tensor([4, 250, 17])


@pytest.mark.parametrize("settings,where", [
    (dict(target_modules=["q_proj", "lm_head"]), "its LM head is wrapped by a PEFT adapter layer"),
    (dict(target_modules=["embed_tokens"]), "its input embedding is wrapped by a PEFT adapter layer"),
    (dict(target_modules=["q_proj"], trainable_token_indices=[5, 7, 250]),
     "its input embedding is wrapped by PEFT's trainable tokens"),
])
def test_an_adapter_on_the_embedding_or_head_runs_on_the_whole_model(settings, where, caplog):
    """The dedicated adapter reads lm_head.weight and the embedding's rows, which under a PEFT layer
    are the frozen base's alone (the adapter left out of the loss while it is perturbed and updated).
    auto picks the whole model, saying why; dedicated and general refuse. The clean scores are the
    stock forward's with the adapter (the same operations, in the stock order: 1e-5 absolute, the
    packing's padding aside), and not those without it."""
    peft_model = peft_llama(**settings)
    base = peft_model.get_base_model()
    for path in ("dedicated", "general"):
        with pytest.raises(UnsupportedModelError, match=where):
            adapter_for(base, path)
    with caplog.at_level("WARNING"):
        adapter = adapter_for(base)
    assert isinstance(adapter, WholeModelAdapter) and where in caplog.text
    engine = resident_engine(base, adapter, TrainableParams.from_model(base), Directions(0))
    scores = clean_logits(engine, label_batch(SEQS, torch.zeros(3, dtype=torch.long), LABELS))
    with torch.inference_mode():
        stock = torch.stack([base(torch.tensor([s])).logits[0, -1, LABELS] for s in SEQS])
        with peft_model.disable_adapter():
            without = torch.stack([base(torch.tensor([s])).logits[0, -1, LABELS] for s in SEQS])
    torch.testing.assert_close(scores, stock, rtol=0, atol=1e-5)
    assert float((stock - without).abs().max()) > 1e-3


def test_an_adapter_inside_the_blocks_stays_on_the_dedicated_path():
    base = peft_llama(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]).get_base_model()
    assert type(adapter_for(base)).__name__ == "RotaryDecoderAdapter"


@pytest.mark.parametrize("method", ["lora", "lora_fa", "prefix"])
def test_distzos_adapter_is_not_added_beside_the_librarys(method):
    """peft=lora on a PEFT model attached distzo's pair to the layers PEFT left plain (v_proj here) and
    trained only that: refused before anything changes."""
    base = peft_llama(target_modules=["q_proj"]).get_base_model()
    before = {n: p.requires_grad for n, p in base.named_parameters()}
    with pytest.raises(DistzoError, match=r"carries the peft library's adapters \(model.layers.0.self_attn.q_proj, "
                                          r"model.layers.1.self_attn.q_proj\).*drop the peft setting"):
        apply_peft(base, PeftConfig(method=PeftMethod(method)))
    assert {n: p.requires_grad for n, p in base.named_parameters()} == before
    apply_peft(base, PeftConfig(method=PeftMethod("none")))  # its own trainable set
