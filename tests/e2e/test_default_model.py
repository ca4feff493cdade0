"""The embedded default, really loaded: SmolLM2-135M-Instruct from the wheel on the movie-review task."""

import pytest
import torch

from distzo.data.objectives import accuracy_counts
from distzo.data.tasks import PromptTask
from distzo.engine import resident_engine
from distzo.models import adapter_for, load_model
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
    task = PromptTask(cfg.task, tokenizer)
    params = TrainableParams.from_model(model)
    return model, task, params, resident_engine(model, adapter_for(model), params, Directions(0), eps=1e-3)


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


def test_multiple_choice_scores_of_the_real_model_are_its_stock_forwards(default_run):
    """mr-endings through the real tokenizer and model: each ending's mean token log-likelihood with
    the four endings packed as branches after the shared prompt equals the stock forward of prompt +
    ending alone (float32: packed rows run other matmul shapes; agreement to 1e-4 in a log-likelihood
    of order 1-10, where a wrong position or mask would be off by O(1))."""
    model, _, _, engine = default_run
    cfg = make_config("task=mr-endings", "task.val_size=4", "task.test_size=4")
    task = PromptTask(cfg.task, engine_tokenizer())
    batch = task.batch("validation", range(4))
    with engine.materialized() as weights:
        scores = weights.score(batch)
    unit = 0
    for i in range(4):
        prompt = task._prompts["validation"][i]
        for cand in task._candidates["validation"][i]:
            with torch.inference_mode():
                logp = model(torch.tensor([prompt + cand])).logits[0].float().log_softmax(-1)
            want = -logp[torch.arange(len(prompt) - 1, len(prompt) + len(cand) - 1), torch.tensor(cand)].sum()
            assert abs(float(scores.nll[unit]) - float(want)) < 1e-4 * max(1.0, float(want)), (i, unit)
            unit += 1
    assert unit == batch.units == 16


def engine_tokenizer():
    from distzo.models import load_tokenizer

    return load_tokenizer("smollm2")
