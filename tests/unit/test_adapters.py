"""The dedicated adapters reproduce the stock transformers forward of their families (the general
path: test_generic_adapter.py)."""

import pytest
import torch

from distzo.engine import resident_engine
from distzo.engine.weights import CleanWeights
from distzo.models.loading import random_model
from distzo.models.selection import adapter_for
from distzo.zo.directions import Directions
from distzo.zo.params import TrainableParams
from tests.engine_helpers import clean_logits, label_batch

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "opt"]


def stock_last_hidden(model, ids):
    base = model.model.decoder if model.config.model_type == "opt" else model.model
    return base(ids).last_hidden_state


@pytest.mark.parametrize("arch", FAMILIES)
def test_single_sequence_is_bitwise_the_stock_forward(arch):
    model = random_model(arch, 300, {}, 0, torch.float32)
    adapter, w = adapter_for(model), CleanWeights(model)
    ids = torch.randint(3, 300, (1, 11))
    with torch.inference_mode():
        ctx = adapter.context(ids, torch.arange(11)[None])
        h = adapter.stem(ctx, w)
        for i in range(len(adapter.blocks)):
            h = adapter.block(i, h, ctx, w)
        features = adapter.final(h[0, -1:], w)
        assert torch.equal(features, stock_last_hidden(model, ids)[0, -1:])
        labels = torch.tensor([4, 250])
        stock = model(ids).logits[0, -1, labels]
        torch.testing.assert_close(adapter.head(features, labels, w)[0], stock, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", FAMILIES)
def test_packed_batch_matches_each_prompt_alone(arch):
    model = random_model(arch, 300, {}, 0, torch.float32)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 12, 1, 9, 7)]
    labels = torch.tensor([4, 250, 17])
    batch = label_batch(seqs, torch.zeros(len(seqs), dtype=torch.long), labels)
    for row_tokens in (1024, 13):  # one packed row, and several rows with padded tails
        engine = resident_engine(model, adapter_for(model), TrainableParams.from_model(model), Directions(0),
                                row_tokens=row_tokens)
        assert (batch.pack(row_tokens).input_ids.shape[0] > 1) == (row_tokens == 13)
        packed = clean_logits(engine, batch)
        with torch.inference_mode():
            alone = torch.stack([model(torch.tensor([s])).logits[0, -1, labels] for s in seqs])
        torch.testing.assert_close(packed, alone, rtol=0, atol=2e-5)




def test_the_1b_preset_is_a_billion_parameter_stock_llama():
    """`model=llama-1b`, the benchmark model built from a config, has the advertised size and runs
    through the Llama adapter (built on the meta device: no 4 GB allocation)."""
    from tests.conftest import make_config

    cfg = make_config("model=llama-1b")
    model = random_model(cfg.model.arch, 49152, dict(cfg.model.arch_config), cfg.model.init_seed,
                         torch.float32, device="meta")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 1.0e9 <= sum(p.numel() for p in model.parameters()) <= 1.1e9
    assert len(adapter_for(model).blocks) == 16
