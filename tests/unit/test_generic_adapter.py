"""The general path (distzo.models.generic) reproduces the stock transformers forward of every decoder
it accepts, and refuses, with the architecture and what is missing named, those it cannot."""

import pytest
import torch
from torch import nn

from distzo.engine import resident_engine
from distzo.engine.weights import CleanWeights
from distzo.models.adapters import UnsupportedModelError
from distzo.models.generic import GenericDecoderAdapter
from distzo.models.loading import random_model
from distzo.models.selection import adapter_for
from distzo.zo.directions import Directions
from distzo.zo.params import TrainableParams
from tests.engine_helpers import clean_logits, label_batch

GENERAL = ["gpt2", "gpt_neox", "phi", "phi3", "gemma3_text", "falcon", "stablelm"]
DEDICATED = ["llama", "mistral", "qwen2", "qwen3", "opt"]  # also run on the general path here
VOCAB = 300


def walk(adapter, ids, positions, w):
    ctx = adapter.context(ids, positions)
    h = adapter.stem(ctx, w)
    for i in range(len(adapter.blocks)):
        h = adapter.block(i, h, ctx, w)
    return adapter.final(h, w)


@pytest.mark.parametrize("arch", GENERAL + DEDICATED)
def test_general_path_is_the_stock_forward(arch):
    """One sequence: the same modules run on the same shapes as the stock forward, so the final
    hidden states are bitwise equal; the head multiplies by the scored rows only (here every row,
    but as a [rows, hidden] product of its own), so logits agree to float32 rounding (1e-5 against
    logits of O(1); a missing scale, norm or soft-cap is off by O(1))."""
    model = random_model(arch, VOCAB, {}, 0, torch.float32)
    adapter = GenericDecoderAdapter(model)
    w = CleanWeights(model)
    ids = torch.randint(3, VOCAB, (1, 11), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        features = walk(adapter, ids, torch.arange(11)[None], w)
        stock = model(ids, output_hidden_states=True)
        assert torch.equal(features, stock.hidden_states[-1])
        every = torch.arange(VOCAB)
        torch.testing.assert_close(adapter.head(features[0], every, w), stock.logits[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", GENERAL)
def test_general_path_packs_prompts_like_each_alone(arch):
    model = random_model(arch, VOCAB, {}, 0, torch.float32)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 12, 1, 9, 7)]
    labels = torch.tensor([4, 250, 17])
    batch = label_batch(seqs, torch.zeros(len(seqs), dtype=torch.long), labels)
    for row_tokens in (1024, 13):  # one packed row, and several rows with padded tails
        engine = resident_engine(model, adapter_for(model), TrainableParams.from_model(model), Directions(0),
                                row_tokens=row_tokens)
        packed = clean_logits(engine, batch)
        with torch.inference_mode():
            alone = torch.stack([model(torch.tensor([s])).logits[0, -1, labels] for s in seqs])
        torch.testing.assert_close(packed, alone, rtol=0, atol=2e-5)


def test_dedicated_families_keep_their_adapters_unless_asked():
    model = random_model("llama", VOCAB, {}, 0, torch.float32)
    assert adapter_for(model).family == "rotary-decoder"
    assert adapter_for(model, "general").family == "general"
    gpt2 = random_model("gpt2", VOCAB, {}, 0, torch.float32)
    assert adapter_for(gpt2).family == "general"
    with pytest.raises(UnsupportedModelError, match="'gpt2' has no dedicated adapter.*model.adapter=auto"):
        adapter_for(gpt2, "dedicated")


class _NoLayers(nn.Module):
    """A causal LM-shaped module with no list of blocks."""

    def __init__(self):
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig()
        self.config.model_type = "mlp-lm"
        self.embed = nn.Embedding(10, 4)
        self.lm_head = nn.Linear(4, 10, bias=False)


def test_a_model_without_decoder_layers_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match=r"_NoLayers \('mlp-lm'\) has no list of decoder layers"):
        adapter_for(_NoLayers())


def cohere():
    """A causal LM whose forward scales its logits outside any module (Cohere's logit_scale)."""
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(0)
    return CohereForCausalLM(CohereConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                          logit_scale=0.25)).eval()


def test_a_forward_the_general_path_cannot_see_falls_back_to_the_whole_model():
    """The general path's self-check catches the logit transform and refuses; `auto` then runs the
    stock forward whole, which reproduces the stock logits of packed prompts like each alone."""
    model = cohere()
    with pytest.raises(UnsupportedModelError, match=r"CohereForCausalLM \('cohere'\): the general path does not "
                                                    r"reproduce the stock forward"):
        adapter_for(model, "general")
    adapter = adapter_for(model)
    assert adapter.family == "whole-model" and adapter.blocks == []
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 12, 1, 9, 7)]
    labels = torch.tensor([4, 250, 17])
    batch = label_batch(seqs, torch.zeros(len(seqs), dtype=torch.long), labels)
    engine = resident_engine(model, adapter, TrainableParams.from_model(model), Directions(0))
    with torch.inference_mode():
        alone = torch.stack([model(torch.tensor([s])).logits[0, -1, labels] for s in seqs])
    torch.testing.assert_close(clean_logits(engine, batch), alone, rtol=0, atol=2e-5)


def test_the_whole_model_fallback_perturbs_like_the_staged_path():
    """Every evaluation of a plan through the fallback (the whole model perturbed in one functional
    call) against the dedicated adapter's stage-by-stage copies: the same theta +- eps z, so the
    same logits up to the head's shapes (all vocabulary columns against the scored rows: float32
    rounding, observed 6e-8; a different z would move them by O(eps))."""
    from distzo.zo.estimators import CLEAN, Probe
    from tests.engine_helpers import plan_logits

    model = random_model("llama", VOCAB, {}, 0, torch.float32)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (4, 9, 6)]
    batch = label_batch(seqs, torch.zeros(3, dtype=torch.long), torch.tensor([7, 99]))
    plan = [Probe(0, +1), Probe(0, -1), Probe(1, +1), Probe(CLEAN, 0)]
    got = {}
    for path in ("dedicated", "whole"):
        engine = resident_engine(model, adapter_for(model, path), TrainableParams.from_model(model), Directions(4),
                                eps=1e-2)
        got[path] = plan_logits(engine, batch, plan, step=2)
    torch.testing.assert_close(got["whole"], got["dedicated"], rtol=0, atol=1e-5)


def test_a_model_no_path_can_drive_is_refused_with_both_reasons():
    """A recurrent model (Mamba): the general path cannot run its layers on packed prompts, nor can
    its stock forward score them."""
    from transformers import MambaConfig, MambaForCausalLM

    model = MambaForCausalLM(MambaConfig(hidden_size=32, num_hidden_layers=1, vocab_size=VOCAB, state_size=4)).eval()
    with pytest.raises(UnsupportedModelError, match=r"MambaForCausalLM \('mamba'\): .*; the whole-model fallback "
                                                    r"cannot run it either"):
        adapter_for(model)
