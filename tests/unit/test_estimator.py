"""SPSA against autograd: each g_k is the directional derivative z_k . grad L, and the average of
g_k z_k over many directions points along the true gradient (MeZO, Definition 1)."""

import math

import torch
from torch.nn import functional as F

from distzo.data.objectives import cross_entropy_sums
from distzo.engine import resident_engine
from distzo.models.loading import random_model
from distzo.models.selection import adapter_for
from distzo.zo.directions import Directions
from distzo.zo.estimators import SPSA, Probe
from distzo.zo.params import TrainableParams
from tests.engine_helpers import label_batch, plan_logits

LABELS = torch.tensor([11, 42])


def setup_model(trainable=None, eps=1e-3):
    model = random_model("llama", 200, {}, 3, torch.float64)
    if trainable is not None:
        model.requires_grad_(False)
        for name in trainable:
            model.get_parameter(name).requires_grad_(True)
    params = TrainableParams.from_model(model)
    return model, params, resident_engine(model, adapter_for(model), params, Directions(5), eps=eps)


def batch():
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (4, 9, 6, 3, 8, 5)]
    return label_batch(seqs, [0, 1, 1, 0, 1, 0], LABELS)


def autograd_gradient(model, params, b):
    """Reference: the same loss through the stock model, differentiated by autograd."""
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(s.tokens) for s in b.sequences], batch_first=True)
    last = torch.tensor([len(s.tokens) - 1 for s in b.sequences])
    logits = model(ids).logits[torch.arange(b.size), last][:, LABELS]
    loss = F.cross_entropy(logits, b.labels)
    grads = torch.autograd.grad(loss, [p.tensor for p in params])
    return torch.cat([g.reshape(-1) for g in grads])


def spsa_grads(engine, estimator, b, step):
    assert engine.eps == estimator.eps
    logits = plan_logits(engine, b, estimator.plan(), step)
    sums = cross_entropy_sums(logits, b.labels)
    return estimator.combine(sums[:, 0] / sums[:, 1])


def direction(engine, params, step, k):
    return torch.cat([engine.directions.generate(p.shape, p.key, step, k).double().reshape(-1) for p in params])


def test_projected_gradient_is_the_directional_derivative():
    model, params, engine = setup_model(eps=1e-5)
    b = batch()
    true = autograd_gradient(model, params, b)
    # Central difference: truncation error shrinks as eps^2 (1e-2 at eps=1e-3, 1e-4 at 1e-4, 2e-6 at
    # 1e-5); below 1e-5 rounding dominates (transformers' RMSNorm computes in float32 even here).
    # Errors are measured against |grad|, the spread of z . grad over z (E[(z . grad)^2] = |grad|^2): a
    # z . grad that happens to be near 0 has no smaller error. A wrong z, sign or scale is O(|grad|) off;
    # the central difference's error here is at most 1e-4 |grad| (measured), the forward one's O(eps).
    scale = float(true.norm())
    result = spsa_grads(engine, SPSA(eps=1e-5, q=4), b, step=0)
    for k, g in enumerate(result.grads):
        exact = float(direction(engine, params, 0, k) @ true)
        assert abs(g - exact) <= 1e-3 * scale, (k, g, exact, scale)
    fwd = spsa_grads(engine, SPSA(eps=1e-5, q=2, difference="forward"), b, step=0)
    for k, g in enumerate(fwd.grads):
        exact = float(direction(engine, params, 0, k) @ true)
        assert abs(g - exact) <= 2e-2 * scale, (k, g, exact, scale)


def test_mean_estimate_converges_to_the_autograd_gradient():
    trainable = ["model.norm.weight", "model.layers.1.post_attention_layernorm.weight"]
    model, params, engine = setup_model(trainable, eps=1e-4)
    b = batch()
    true = autograd_gradient(model, params, b)
    d = true.numel()
    estimator = SPSA(eps=1e-4, q=128)
    total, n, cosines = torch.zeros_like(true), 0, {}
    for step in range(8):  # 1024 directions, 128 per call
        result = spsa_grads(engine, estimator, b, step)
        for k, g in enumerate(result.grads):
            total += g * direction(engine, params, step, k)
            n += 1
            if n in (8, 64, 1024):
                cosines[n] = float(F.cosine_similarity(total, true, dim=0))
    assert cosines[8] < cosines[64] < cosines[1024]
    # For Gaussian z the expected cosine is about sqrt(n / (n + d + 1)).
    assert cosines[1024] > 0.85 and abs(cosines[1024] - math.sqrt(1024 / (1024 + d + 1))) < 0.06


def test_spsa_arithmetic():
    est = SPSA(eps=0.5, q=2)
    assert est.plan() == [Probe(0, 1), Probe(0, -1), Probe(1, 1), Probe(1, -1)]
    r = est.combine(torch.tensor([3.0, 1.0, 2.0, 2.5]))
    assert r.grads == (2.0, -0.5) and r.coefficients == ((0, 1.0), (1, -0.25)) and r.loss == 2.125
    fwd = SPSA(eps=0.5, q=1, difference="forward")
    assert fwd.plan()[0].perturbed is False
    assert fwd.combine(torch.tensor([1.0, 2.0])).grads == (2.0,)
