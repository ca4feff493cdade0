"""The embedded default, really loaded: SmolLM2-135M-Instruct from the wheel on the movie-review task."""

import pytest
import torch

from distzo.data.tasks import ClassificationTask
from distzo.engine import ResidentEngine
from distzo.models import adapter_for, load_model
from distzo.objectives import accuracy_counts
from distzo.zo.directions import Directions
from distzo.zo.estimators import SPSA
from distzo.zo.params import TrainableParams
from tests.conftest import make_config
from tests.engine_helpers import materialize, plan_logits

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_run():
    cfg = make_config("task.val_size=96")
    model, tokenizer = load_model(cfg.model)
    task = ClassificationTask(cfg.task, tokenizer)
    params = TrainableParams.from_model(model)
    return model, task, params, ResidentEngine(model, adapter_for(model), params, Directions(0), eps=1e-3)


def test_it_is_the_pretrained_smollm2(default_run):
    model, _, params, _ = default_run
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert params.numel() == 134_515_008 and params.get("lm_head.weight") is params.get("model.embed_tokens.weight")


def test_zero_shot_accuracy_is_near_chance_with_this_prompt(default_run):
    _, task, _, engine = default_run
    correct = seen = 0
    for batch in task.batches("validation", 32):
        with engine.materialized() as weights:
            c, n = accuracy_counts(weights.score(batch), batch)
        correct, seen = correct + c, seen + n
    assert seen == 96 and 0.35 <= correct / seen <= 0.7


def test_a_zo_step_changes_only_through_the_update(default_run):
    model, task, params, engine = default_run
    est = SPSA(eps=1e-3)
    batch = task.batch("train", range(8))
    before = params.get("model.layers.0.mlp.down_proj.weight").tensor.clone()
    logits = plan_logits(engine, batch, est.plan(), 0)
    assert torch.isfinite(logits).all() and not torch.equal(logits[0], logits[1])
    assert torch.equal(before, params.get("model.layers.0.mlp.down_proj.weight").tensor)
    engine.apply(0, [(0, 1.0)], 1e-6, 0.0)
    assert torch.equal(before, params.get("model.layers.0.mlp.down_proj.weight").tensor)  # deferred (I5)
    materialize(engine)
    assert not torch.equal(before, params.get("model.layers.0.mlp.down_proj.weight").tensor)
