"""The second pretrained family, really loaded: Gemma 3 270M from its wheels, on the general path."""

import pytest
import torch

from distzo.data.batches import Batch, TokenSequence
from distzo.engine import resident_engine
from distzo.models import adapter_for, load_model
from distzo.zo.directions import Directions
from distzo.zo.params import TrainableParams
from tests.conftest import make_config

pytestmark = pytest.mark.slow


def test_gemma3_270m_loss_on_a_sentence_is_the_stock_forwards():
    """The completion loss of a fixed sentence through distzo (general path, scored rows of the head)
    against the stock forward's loss with the prompt tokens labelled -100. transformers computes its
    loss from float32 logits over the full 262,144-word vocabulary, distzo from the scored rows only:
    float32 rounding, 1e-5 relative (observed ~1e-7); a wrong position, mask or scale is off by O(1).
    The model is the pretrained one: it finds the sentence's end easy (a random model of this vocabulary
    would pay ln 262144 = 12.5 nats per token)."""
    cfg = make_config("model=gemma3-270m")
    model, tokenizer = load_model(cfg.model)
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.num_hidden_layers == 18
    assert 268_000_000 < sum(p.numel() for p in model.parameters()) < 268_200_000
    adapter = adapter_for(model)
    assert adapter.family == "general" and len(adapter.blocks) == 18
    ids = tokenizer("The capital of France is Paris, and the capital of Italy is Rome.").input_ids
    assert ids[0] == tokenizer.bos_token_id
    cut = len(ids) - 4
    seq = TokenSequence(tuple(ids), scored=tuple(range(cut - 1, len(ids) - 1)), targets=tuple(ids[cut:]),
                   units=(0,) * (len(ids) - cut))
    batch = Batch([seq], [0], [0], torch.zeros(1, dtype=torch.long), readout="tokens")
    engine = resident_engine(model, adapter, TrainableParams.from_model(model), Directions(0))
    with engine.materialized() as weights:
        scores = weights.score(batch)
    ours = float(scores.nll[0]) / int(scores.count[0])
    labels = torch.tensor([[-100] * cut + ids[cut:]])
    with torch.inference_mode():
        stock = float(model(torch.tensor([ids]), labels=labels).loss)
    assert ours == pytest.approx(stock, rel=1e-5)
    assert stock < 4.0, stock
