"""Every estimator against a reference (issue 6).

- MeZO / n-SPSA (Rademacher, forward difference): the mean of g_k z_k over many directions points
  along the autograd gradient.
- AGZO: g_k is the directional derivative along R A^T; the mean estimate is the autograd gradient
  projected onto the activation subspace (AGZO Prop. 5.1), and lies exactly in it; at an equal
  forward budget its cosine with the true gradient beats MeZO's (AGZO §6.1, Thm. 5.6).
- P-RGE: one batched forward (stacked B, materialised or drawn on the fly) gives the losses of the
  separate evaluations; its mean estimate points along the autograd gradient of LoRA-FA's B.
- LoRA / prefix: the hooked model equals a reference built from stock pieces (merged weights; the
  prefix tokens prepended to the prompt), and training changes only the trainable tensors.

Cosine thresholds: with n directions in d dimensions the expected cosine of the mean estimate is
about sqrt(n / (n + d)) (0.87 for n = 192, d = 64..128); a random vector scores about 1/sqrt(d)
(<= 0.13), so a threshold of 0.7 cannot be passed by chance.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from distzo.data.batches import Scores
from distzo.data.objectives import cross_entropy_sums, objective_sums
from distzo.engine import resident_engine, stacked_lora_engine
from distzo.models.loading import random_model
from distzo.models.selection import adapter_for
from distzo.peft import apply_peft, attach_lora, attach_prefix
from distzo.zo.directions import Directions
from distzo.zo.estimators import AGZO, PRGE, SPSA
from distzo.zo.params import TrainableParams
from distzo.zo.subspace import ActivationCapture, SubspaceDirections, top_subspace
from tests.conftest import make_config
from tests.engine_helpers import clean_logits, label_batch, materialize, plan_logits

LABELS = torch.tensor([11, 42])


def sample_batch(n=6, seed=2):
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, 200, (int(k),), generator=gen).tolist() for k in torch.randint(3, 10, (n,), generator=gen)]
    return label_batch(seqs, torch.randint(0, 2, (n,), generator=gen), LABELS)


def tiny(dtype=torch.float64, trainable=None, seed=3):
    model = random_model("llama", 200, {}, seed, dtype)
    if trainable is not None:
        model.requires_grad_(False)
        for name in trainable:
            model.get_parameter(name).requires_grad_(True)
    return model


def autograd_gradient(model, params, b):
    """Reference: the same loss through the stock model (hooks included), differentiated by autograd."""
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(s.tokens) for s in b.sequences], batch_first=True)
    last = torch.tensor([len(s.tokens) - 1 for s in b.sequences])
    with torch.enable_grad():
        logits = model(ids).logits[torch.arange(b.size), last][:, LABELS]
        loss = F.cross_entropy(logits.double(), b.labels)
        grads = torch.autograd.grad(loss, [p.tensor for p in params])
    return torch.cat([g.reshape(-1) for g in grads]).double()


def losses(engine, b, plan, step):
    sums = cross_entropy_sums(plan_logits(engine, b, plan, step), b.labels)
    return sums[:, 0] / sums[:, 1]


def direction(directions, params, step, k):
    return torch.cat([directions.generate(p.shape, p.key, step, k).double().reshape(-1) for p in params])


def cosine(a, b):
    return float(F.cosine_similarity(a, b, dim=0))


# --- MeZO: n-SPSA with Rademacher directions and forward differences ---------------------------------------

def test_nspsa_rademacher_forward_mean_points_along_the_gradient():
    model = tiny(trainable=["model.layers.1.post_attention_layernorm.weight"])
    params = TrainableParams.from_model(model)
    directions = Directions(7, "rademacher")
    est = SPSA(eps=1e-5, q=64, difference="forward")
    engine, b = resident_engine(model, adapter_for(model), params, directions, eps=est.eps), sample_batch()
    true = autograd_gradient(model, params, b)
    total = torch.zeros_like(true)
    for step in range(3):  # 192 directions in 64 dimensions
        result = est.combine(losses(engine, b, est.plan(), step))
        for k, c in result.coefficients:
            total += c * direction(directions, params, step, k)
    assert cosine(total, true) > 0.7


# --- AGZO ----------------------------------------------------------------------------------------------------

def agzo_setup(trainable, seed=5, eps=1e-4):
    model = tiny(trainable=trainable)
    params = TrainableParams.from_model(model)
    directions = SubspaceDirections(seed)
    engine = resident_engine(model, adapter_for(model), params, directions, eps=eps)
    return model, params, directions, engine, ActivationCapture(model, params, directions, 1, 3)


def agzo_step(engine, capture, b, est, step):
    plan = est.plan()
    with capture.capture(step, b.pack(engine.row_tokens).real):
        clean = losses(engine, b, plan[:1], step)
    return est.combine(torch.cat([clean, losses(engine, b, plan[1:], step)]))


def test_power_iteration_finds_the_top_singular_subspace():
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(40, 40, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(300, 40, generator=gen, dtype=torch.float64))
    x = (v * torch.tensor([10.0, 6.0] + [1.0] * 38, dtype=torch.float64)) @ u.T  # H = x^T: [40, 300]
    a = top_subspace(x, 2, 3, torch.Generator().manual_seed(1))
    assert torch.allclose(a.T @ a, torch.eye(2, dtype=a.dtype), atol=1e-10)
    assert torch.linalg.svdvals(u[:, :2].T @ a).min() > 0.99  # spans the top two left singular vectors


def test_agzo_estimate_is_the_projected_gradient():
    """Prop. 5.1: E[g Delta] = grad_W F A A^T for a linear weight (and grad for dense parameters)."""
    linear, norm = "model.layers.1.mlp.down_proj.weight", "model.layers.1.post_attention_layernorm.weight"
    model, params, directions, engine, capture = agzo_setup([linear, norm])
    b = sample_batch()
    true = autograd_gradient(model, params, b)
    # One-sided: truncation O(eps); transformers' RMSNorm rounds to float32 even in a float64 model,
    # which limits how small eps can go (1e-7 relative loss noise / eps).
    est = AGZO(eps=1e-4, q=192)  # one step: one basis A (another step redraws the power iteration's start)
    shape = params.get(linear).shape
    result = agzo_step(engine, capture, b, est, 0)
    for k in range(2):  # g_k is the directional derivative along R_k A^T
        exact = float(direction(directions, params, 0, k) @ true)
        assert math.isclose(result.grads[k], exact, rel_tol=2e-2, abs_tol=2e-3), (k, exact)
    total = torch.zeros_like(true)
    for k, c in result.coefficients:
        total += c * direction(directions, params, 0, k)
    a = directions.bases[(params.get(linear).key, 0)].double()  # [in, 1]
    n = shape.numel()
    grad_w = true[:n].view(shape)
    projected = torch.cat([(grad_w @ a @ a.T).reshape(-1), true[n:]])
    est_w = total[:n].view(shape)
    assert (est_w - est_w @ a @ a.T).norm() < 1e-6 * est_w.norm()  # inside span(A) (z is float32)
    assert cosine(total, projected) > 0.7
    assert cosine(total, projected) > cosine(total, true)  # it estimates the projection, not grad


def test_agzo_beats_mezo_cosine_at_equal_forward_budget():
    """16 forwards a step each: AGZO one clean + 15 perturbed, MeZO 8 central pairs. All linear
    weights and norms train (embedding frozen: AGZO's tied-embedding policy). Expected cosines
    (AGZO Thm 5.4): MeZO sqrt(8 / 74k) ~ 0.01; AGZO alpha * sqrt(15 / 1k) with alpha the share of
    the gradient inside the activation subspaces."""
    model, params, directions, engine, capture = agzo_setup(None)
    model.model.embed_tokens.weight.requires_grad_(False)
    params = TrainableParams.from_model(model)
    engine = resident_engine(model, adapter_for(model), params, directions, eps=1e-4)
    capture = ActivationCapture(model, params, directions, 1, 3)
    b = sample_batch()
    true = autograd_gradient(model, params, b)
    agzo, mezo = AGZO(eps=1e-4, q=15), SPSA(eps=1e-4, q=8)
    dense = Directions(5)
    mezo_engine = resident_engine(model, adapter_for(model), params, dense, eps=1e-4)
    cos_a, cos_m = [], []
    for step in range(2):
        r = agzo_step(engine, capture, b, agzo, step)
        cos_a.append(cosine(sum(c * direction(directions, params, step, k) for k, c in r.coefficients), true))
        r = mezo.combine(losses(mezo_engine, b, mezo.plan(), step))
        cos_m.append(cosine(sum(c * direction(dense, params, step, k) for k, c in r.coefficients), true))
    assert min(cos_a) > 1.5 * max(cos_m), (cos_a, cos_m)


# --- P-RGE ---------------------------------------------------------------------------------------------------

def lora_fa_model(targets=("q_proj", "v_proj"), r=4, dtype=torch.float32, seed=3, eps=1e-2, stacked=None):
    """A tiny model with LoRA-FA (non-zero B); its engine: resident, or P-RGE's stacked engine with
    stacked="materialize" / "on_the_fly"."""
    model = tiny(dtype=dtype, seed=seed)
    model.requires_grad_(False)
    attach_lora(model, list(targets), r, 8.0, 0, train_a=False)
    with torch.no_grad():  # a non-zero B, so the low-rank term matters
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    params = TrainableParams.from_model(model)
    if stacked is None:
        return model, params, resident_engine(model, adapter_for(model), params, Directions(9), eps=eps)
    return model, params, stacked_lora_engine(model, adapter_for(model), params, Directions(9), eps=eps,
                                            materialize=stacked == "materialize")


@pytest.mark.parametrize("materialize", [True, False])
def test_prge_batched_forward_equals_separate_evaluations(materialize):
    model, params, engine = lora_fa_model()
    b = sample_batch()
    plan = PRGE(eps=1e-2, q=3).plan()
    separate = plan_logits(engine, b, plan, 4)
    stacked = stacked_lora_engine(model, adapter_for(model), params, engine.directions, eps=1e-2,
                                  materialize=materialize)
    batched = plan_logits(stacked, b, plan, 4)
    assert batched.shape == separate.shape == (6, b.size, 2)
    assert not torch.allclose(batched[0], batched[1])  # the signs really differ
    assert torch.allclose(batched, separate, rtol=1e-5, atol=1e-6)  # only GEMM shapes differ
    per_eval = cross_entropy_sums(batched, b.labels)
    ref = cross_entropy_sums(separate, b.labels)
    assert torch.allclose(per_eval, ref, rtol=1e-6, atol=1e-7)


def test_prge_on_the_fly_copies_are_bitwise_the_materialised_ones():
    model, params, engine = lora_fa_model(stacked="materialize")
    b, plan = sample_batch(), PRGE(eps=1e-2, q=2).plan()
    a = plan_logits(engine, b, plan, 1)
    on_the_fly = stacked_lora_engine(model, adapter_for(model), params, engine.directions, eps=1e-2, materialize=False)
    assert torch.equal(a, plan_logits(on_the_fly, b, plan, 1))


def test_prge_mean_estimate_points_along_the_lora_b_gradient():
    model, params, engine = lora_fa_model(targets=("v_proj",), r=2, dtype=torch.float64, eps=1e-5,
                                          stacked="materialize")
    b = sample_batch()
    true = autograd_gradient(model, params, b)  # d = 2 layers x 32 x 2 = 128
    est = PRGE(eps=1e-5, q=64)
    total = torch.zeros_like(true)
    for step in range(3):
        result = est.combine(losses(engine, b, est.plan(), step))
        assert result.coefficients[1] == (1, result.grads[1] / 64)  # B -= lr * mean_k(g_k z_k)
        for k, c in result.coefficients:
            total += c * direction(engine.directions, params, step, k)
    assert cosine(total, true) > 0.7


# --- LoRA and prefix against stock references ----------------------------------------------------------------

def test_lora_hook_equals_the_merged_stock_model():
    model, params, _ = lora_fa_model()
    ref = tiny(dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "lora_B"):
                merged = module.weight + module.lora_scale * module.lora_B @ module.lora_A
                ref.get_submodule(name).weight.copy_(merged)
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(model(ids).logits, ref(ids).logits, atol=1e-5)


PREFIX_ARCHS = ["llama", "opt", "mistral", "gpt2", "gpt_neox", "phi", "phi3", "gemma3_text", "falcon", "stablelm"]


@pytest.mark.parametrize("arch", PREFIX_ARCHS)
def test_prefix_is_the_random_tokens_prepended(arch):
    """At initialisation the prefix holds the real keys and values of m random tokens, so the
    prefixed model on a prompt equals the stock model on [those tokens, prompt] (inside a sliding
    window, where the stock model still sees the tokens), on the dedicated families and the general
    path's alike."""
    m, n = 5, 3 if arch in ("mistral", "gemma3_text") else 7  # their random configs' window: 8 tokens
    model, ref = random_model(arch, 200, {}, 0, torch.float64), random_model(arch, 200, {}, 0, torch.float64)
    model.requires_grad_(False)
    attach_prefix(model, m, init_seed=4)
    tokens = torch.randint(0, 200, (1, m), generator=torch.Generator().manual_seed(4))
    prompt = torch.randint(0, 200, (1, n), generator=torch.Generator().manual_seed(1))
    got = model(prompt, position_ids=torch.arange(n)[None]).logits
    full = torch.cat([tokens, prompt], dim=1)
    # rotary: the prefix sits at positions -m..-1; learned positions (OPT, GPT-2): at 0..m-1, and
    # the prompt keeps its own positions from 0 in both models
    rotary = any(name.endswith("rotary_emb") for name, _ in ref.named_modules())
    first = torch.arange(-m, 0) if rotary else torch.arange(m)
    want = ref(full, position_ids=torch.cat([first, torch.arange(n)])[None]).logits[:, m:]
    assert torch.allclose(got, want, atol=1e-8)


@pytest.mark.parametrize("arch", ["gpt2", "gemma3_text", "falcon"])
def test_the_general_path_runs_prefix_tuning_as_the_stock_forward(arch):
    """Prefix hooks sit on the stock attention modules, so the general path's staged forward (which
    calls those modules) scores as the hooked stock model does, and training moves only the prefix."""
    cfg = make_config("model=tiny", "peft=prefix", f"model.arch={arch}")
    model = random_model(arch, 300, {}, 0, torch.float32)
    apply_peft(model, cfg.peft)
    params = TrainableParams.from_model(model)
    engine = resident_engine(model, adapter_for(model), params, Directions(1), eps=1e-2)
    seqs = [[5, 6, 7], [8, 9, 10, 11]]
    b = label_batch(seqs, [0, 1], LABELS)
    with torch.inference_mode():
        stock = torch.stack([model(torch.tensor([s]), position_ids=torch.arange(len(s))[None]).logits[0, -1, LABELS]
                             for s in seqs])
    torch.testing.assert_close(clean_logits(engine, b), stock, rtol=0, atol=1e-5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    est = SPSA(1e-2, 1)
    for step in range(2):
        engine.apply(step, est.combine(losses(engine, b, est.plan(), step)).coefficients, 1.0, 0.0)
    materialize(engine)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}
    assert changed == {p.name for p in params} and all("prefix_" in n for n in changed)


@pytest.mark.parametrize("method,estimator", [("lora", "mezo"), ("lora_fa", "prge"), ("prefix", "agzo")])
def test_peft_training_changes_only_trainable_parameters(method, estimator):
    cfg = make_config("model=tiny", f"peft={method}", f"estimator={estimator}")
    model = random_model("llama", 300, {}, 0, torch.float32)
    apply_peft(model, cfg.peft)
    params = TrainableParams.from_model(model)
    trainable = {p.name for p in params}
    expected = {"lora": ("lora_A", "lora_B"), "lora_fa": ("lora_B",), "prefix": ("prefix_keys", "prefix_values")}
    assert trainable and all(n.endswith(expected[method]) for n in trainable)
    directions = SubspaceDirections(1) if estimator == "agzo" else Directions(1)
    kind = stacked_lora_engine if estimator == "prge" else resident_engine
    engine = kind(model, adapter_for(model), params, directions, eps=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    b = label_batch([[5, 6, 7], [8, 9, 10, 11]], [0, 1], LABELS)
    est = {"mezo": SPSA(1e-2, 2), "prge": PRGE(1e-2, 2), "agzo": AGZO(1e-2, 2)}[estimator]
    for step in range(2):
        values = losses(engine, b, est.plan(), step)
        engine.apply(step, est.combine(values).coefficients, 1.0, 0.0)
    materialize(engine)
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == trainable


# --- the non-differentiable objective ------------------------------------------------------------------------

def test_minus_accuracy_objective():
    logits = torch.tensor([[[2.0, 1.0], [0.0, 3.0], [1.0, 0.5]], [[0.0, 1.0], [0.0, 3.0], [1.0, 0.5]]])
    labels = torch.tensor([0, 1, 1])
    # argmax per example: evaluation 0 predicts [0, 1, 0] (2 right), evaluation 1 [1, 1, 0] (1 right)
    b = label_batch([[1], [2], [3]], labels, LABELS)
    for e, want in enumerate([[-2.0, 3.0], [-1.0, 3.0]]):
        scores = Scores(torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), logits[e])
        assert objective_sums(scores, b, "accuracy").tolist() == want
        loss = objective_sums(scores, b, "loss")
        assert loss.dtype == torch.float64 and loss[1].item() == 3.0
        assert loss[0].item() == pytest.approx(F.cross_entropy(logits[e], labels, reduction="sum").item(), rel=1e-6)


def test_minus_accuracy_objective_counts_any_gold_answer():
    """With `extra["gold"]` (several right candidates, as ReCoRD's) a prediction is right when it is
    any of them; `labels` (one right candidate each) is then not what accuracy compares with."""
    logits = torch.tensor([[[2.0, 1.0], [0.0, 3.0], [1.0, 0.5]], [[0.0, 1.0], [0.0, 3.0], [1.0, 0.5]]])
    b = label_batch([[1], [2], [3]], [0, 1, 1], LABELS)
    b.extra["gold"] = [[1], [0], [0, 1]]
    # evaluation 0 predicts [0, 1, 0]: only example 2 is right; evaluation 1 predicts [1, 1, 0]: examples 0 and 2
    for e, want in enumerate([[-1.0, 3.0], [-2.0, 3.0]]):
        scores = Scores(torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), logits[e])
        assert objective_sums(scores, b, "accuracy").tolist() == want


# --- incompatible options fail up front ----------------------------------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    (["estimator=prge"], "estimator=prge perturbs LoRA-FA's B matrices only; add peft=lora_fa"),
    (["estimator=agzo", "estimator.difference=central"], "estimator=agzo is one-sided"),
    (["estimator=agzo", "offload=cpu"], "estimator=agzo is not supported with offloading yet"),
    (["peft=lora", "offload=cpu", "offload.transfer_dtype=bfloat16"], "the frozen base streams as stored"),
    (["objective=f1"], "objective=f1 scores generated answers; task mr-polarity is classification"),
])
def test_incompatible_options_are_refused(overrides, message):
    from distzo.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        make_config("model=tiny", *overrides)
    assert message in str(err.value)
