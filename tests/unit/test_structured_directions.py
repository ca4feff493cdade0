"""The structured directions of LOZO, SubZero and Sparse MeZO against their definitions
(distzo/zo/lowrank.py, distzo/zo/estimators/sparse_mezo.py): the low-rank z of a matrix is its factors'
product (float64 reference, float32 rounding), the same bits whichever rows are asked for, lazy
where it should be; SubZero's subspaces are orthonormal and its z has a dense Gaussian's scale; each
projected gradient is the directional derivative of the autograd gradient along the direction the
engine perturbs; LOZO-M's update is its momentum recursion; Sparse MeZO's mask leaves large weights
alone, reads the weights before the update, and the fused kernel applies it as torch ops do."""

from __future__ import annotations

import math

import pytest
import torch

from distzo import native
from distzo.engine import resident_engine
from distzo.models.loading import random_model
from distzo.models.selection import adapter_for
from distzo.zo.directions import Directions, chunks_of
from distzo.zo.estimators.lozo import LOZO
from distzo.zo.estimators.sparse_mezo import SparseMeZO, magnitude_quantile
from distzo.zo.estimators.subzero import SubZero
from distzo.zo.lowrank import UPDATE_QUERY
from distzo.zo.params import TrainableParams
from tests.unit.test_estimator import autograd_gradient, batch, spsa_grads


def tiny(dtype=torch.float64, seed=3):
    model = random_model("llama", 200, {}, seed, dtype)
    return model, TrainableParams.from_model(model)


def matrices(params):
    return [p for p in params if len(p.shape) >= 2]


@pytest.mark.parametrize("estimator", [LOZO(rank=3, lazy_interval=4), SubZero(rank=3, subspace_interval=4)])
def test_a_matrix_direction_is_the_product_of_its_factors(estimator):
    _, params = tiny(torch.float32)
    d = estimator.directions(7, "gaussian", "cpu", params)
    for p in matrices(params):
        a, b = (f.double() for f in d.factors(p.key, 5, 1))
        z = d.generate(p.shape, p.key, 5, 1).double().view(p.shape[0], -1)
        assert a.shape == (p.shape[0], 3) and b.shape == (z.shape[1], 3)
        assert torch.allclose(z, a @ b.T, rtol=1e-5, atol=1e-6 * float((a @ b.T).abs().max()))
        rows = torch.tensor([0, 3, 1, p.shape[0] - 1])  # an embedding lookup's rows: the chunk pass's bits
        assert torch.equal(d.rows(p.shape, p.key, 5, 1, rows), z.float()[rows])
    plain = Directions(7)
    for p in (p for p in params if len(p.shape) < 2):  # vectors keep MeZO's dense z
        assert torch.equal(d.generate(p.shape, p.key, 5, 1), plain.generate(p.shape, p.key, 5, 1))


def test_lozo_redraws_u_every_step_and_v_every_window():
    _, params = tiny(torch.float32)
    d = LOZO(rank=2, lazy_interval=4).directions(7, "gaussian", "cpu", params)
    key = matrices(params)[0].key
    assert torch.equal(d.right(key, 1), d.factors(key, 4, 0)[1]) and torch.equal(d.factors(key, 7, 0)[1],
                                                                                   d.factors(key, 4, 1)[1])
    assert not torch.equal(d.factors(key, 3, 0)[1], d.factors(key, 4, 0)[1])  # a new window
    assert not torch.equal(d.factors(key, 4, 0)[0], d.factors(key, 5, 0)[0])  # a new step
    assert not torch.equal(d.factors(key, 4, 0)[0], d.factors(key, 4, 1)[0])  # another query


@pytest.mark.parametrize("estimator,variance", [(LOZO(rank=2, lazy_interval=1), 2.0),
                                                (SubZero(rank=4, subspace_interval=1), 1.0)])
def test_each_element_of_z_has_the_scale_the_papers_give(estimator, variance):
    """LOZO (its code, no 1/r): E z_ij^2 = r. SubZero: s = sqrt(m n) / r makes E|z|^2 = m n, a dense
    Gaussian's; with U and V orthonormal the mean of z^2 over the matrix is exactly |Z|_F^2 / r^2.
    Over 200 steps (factors renewed each step) the mean is within 4 standard errors of the steps'
    means (the standard error estimated from them) of its expectation."""
    model = random_model("llama", 64, {"hidden_size": 64, "intermediate_size": 64}, 0, torch.float32)
    params = TrainableParams.from_model(model)
    p = next(p for p in matrices(params) if tuple(p.shape) == (64, 64))
    d = estimator.directions(11, "gaussian", "cpu", params)
    means = torch.stack([d.generate(p.shape, p.key, t, 0).double().pow(2).mean() for t in range(200)])
    se = float(means.std()) / math.sqrt(means.numel())
    assert abs(float(means.mean()) - variance) < 4 * se, (float(means.mean()), se)
    if isinstance(estimator, SubZero):
        for t in range(3):
            core = d.left(p.key, t, 0).double()  # s U Z: |s U Z|_F^2 = s^2 |Z|_F^2
            z_sq = float(core.pow(2).sum()) / (64 * 64 / 16)  # |Z|_F^2 = |s U Z|_F^2 / s^2
            assert math.isclose(float(means[t]), z_sq / 16, rel_tol=1e-5)
        u = d._orthonormal(64, 0, p.key, 1)
        assert torch.allclose(u.T @ u, torch.eye(4, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("estimator", [LOZO(eps=1e-4, q=3, rank=2), SubZero(eps=1e-4, q=3, rank=2),
                                       SparseMeZO(eps=1e-4, q=3, sparsity=0.5)])
def test_projected_gradient_is_the_directional_derivative_along_the_perturbed_direction(estimator):
    """As tests/unit/test_estimator.py does for MeZO: g_k equals z_k . grad L, z_k being what the
    engine perturbs: the factors' product, or MeZO's z where |theta| <= h (Sparse MeZO's mask). The
    central difference at eps 1e-4 in float64 is off by rounding of the losses (transformers' RMSNorm
    computes in float32) over eps, about 1e-4 whatever g is (measured: 8e-5 to 5e-4 for SubZero): each
    g_k within 1e-3 of the largest |z_k . grad L|; a wrong direction, sign or scale is O(1) off."""
    model, params = tiny()
    d = estimator.directions(5, "gaussian", "cpu", params)
    engine = resident_engine(model, adapter_for(model), params, d, eps=estimator.eps)
    b = batch()
    true = autograd_gradient(model, params, b)
    result = spsa_grads(engine, estimator, b, step=0)
    exact = []
    for k in range(estimator.q):
        z = []
        for p in params:
            zk = d.generate(p.shape, p.key, 0, k).double()
            h = d.magnitude_threshold(p.key)
            z.append((zk if h is None else torch.where(p.tensor.abs() <= h, zk, 0.0)).reshape(-1))
        exact.append(float(torch.cat(z) @ true))
    scale = max(abs(e) for e in exact)
    for k, (g, e) in enumerate(zip(result.grads, exact)):
        assert abs(g - e) <= 1e-3 * scale, (k, g, e)


def test_lozo_m_moves_the_weights_along_its_momentum_of_the_factors():
    """Five updates with two queries and V renewed every two steps, through the engine's pending
    updates: the weights are theta_0 - lr sum_t M_t V^T (vectors: - lr sum_t mom_t), M_0 = sum_k c_k U_k,
    M_t = beta M_{t-1} (V_old^T V_new / n where V changes) + (1 - beta) sum_k c_k U_k, computed here in
    float64 from the directions' factors: equal to 1e-5 of how far the weights moved (float32 updates)."""
    model, params = tiny(torch.float32)
    start = {p.name: p.tensor.detach().double().clone() for p in params}
    est = LOZO(rank=2, lazy_interval=2, factor_momentum=0.7)
    d = est.directions(9, "gaussian", "cpu", params)
    engine = resident_engine(model, adapter_for(model), params, d, eps=1e-3)
    steps = [(t, ((0, 0.3 * (t + 1)), (1, -0.2 + 0.1 * t))) for t in range(5)]
    lr, beta = 1e-2, 0.7
    for t, coefficients in steps:
        engine.apply(t, coefficients, lr, 0.0)
    with engine.materialized() as weights:
        got = {p.name: p.tensor.detach().double() for p in weights.params}
    for p in params:
        want, m = start[p.name].clone(), None
        for t, coefficients in steps:
            if len(p.shape) >= 2:
                est_t = sum(c * d.left(p.key, t, k).double() for k, c in coefficients)
                if m is not None and (t - 1) // 2 != t // 2:
                    m = m @ (d.right(p.key, (t - 1) // 2).double().T @ d.right(p.key, t // 2).double()
                             / p.tensor[0].numel())
                m = est_t if m is None else beta * m + (1 - beta) * est_t
                want -= lr * (m @ d.right(p.key, t // 2).double().T).view(p.shape)
            else:
                est_t = sum(c * Directions(9).generate(p.shape, p.key, t, k).double() for k, c in coefficients)
                m = est_t if m is None else beta * m + (1 - beta) * est_t
                want -= lr * m
        moved = float((want - start[p.name]).abs().max())
        assert moved > 0 and float((got[p.name] - want).abs().max()) <= 1e-5 * moved, p.name
    assert set(d.state()) == {f"lozo_momentum/{p.name}" for p in params} | {"lozo_momentum_step"}
    fresh = est.directions(9, "gaussian", "cpu", params)
    fresh.load_state(d.state())
    key = matrices(params)[0].key
    assert torch.equal(fresh.factors(key, 4, UPDATE_QUERY)[0], d.factors(key, 4, UPDATE_QUERY)[0])


def test_magnitude_quantile_is_an_exact_selection():
    x = torch.randn(10_001, generator=torch.Generator().manual_seed(0))
    h = magnitude_quantile(x, 0.2)
    assert int((x.abs() <= h).sum()) == math.ceil(0.2 * x.numel()) and h in x.abs().tolist()


@pytest.mark.parametrize("kernels", [False, True])
def test_sparse_mezo_moves_only_the_small_weights_and_reads_them_before_the_update(kernels):
    """Three updates through the engine (the fused kernel or torch ops): an element moves only if
    |theta| <= h before the update that moves it, by exactly lr c z there; elements above their
    tensor's threshold (80% of each) never move. The fused kernel and torch ops agree bitwise,
    weights and working copies."""
    model, params = tiny(torch.float32)
    start = {p.name: p.tensor.detach().clone() for p in params}
    d = SparseMeZO(sparsity=0.8).directions(4, "gaussian", "cpu", params,
                                            kernels=native.load("true") if kernels else None)
    engine = resident_engine(model, adapter_for(model), params, d, eps=1e-3)
    for t in range(3):
        engine.apply(t, ((0, 50.0 * (t + 1)),), 1e-3, 0.0)
    with engine.materialized() as weights:
        moved = {p.name: ~torch.eq(p.tensor, start[p.name]) for p in weights.params}
    for p in params:
        h = d.magnitude_threshold(p.key)
        small = start[p.name].abs() <= h
        assert bool(moved[p.name][~small].any()) is False  # large weights stay (and so do the masks' edges)
        assert bool(moved[p.name][small].any())
    reference = SparseMeZO(sparsity=0.8).directions(4, "gaussian", "cpu", tiny(torch.float32)[1],
                                                    kernels=None if kernels else native.load("true"))
    model2, params2 = tiny(torch.float32)
    other = resident_engine(model2, adapter_for(model2), params2, reference, eps=1e-3)
    for t in range(3):
        other.apply(t, ((0, 50.0 * (t + 1)),), 1e-3, 0.0)
    with other.materialized() as w2, engine.materialized() as w1:
        assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(w1.params, w2.params))


def test_sparse_thresholds_refresh_and_ride_in_the_state():
    _, params = tiny(torch.float32)
    d = SparseMeZO(sparsity=0.5, mask_interval=3).directions(4, "gaussian", "cpu", params)
    assert not d.refreshes_at(0) and d.refreshes_at(3) and not d.refreshes_at(4)
    for p in params:
        p.tensor.data.mul_(2)
    before = dict(d.thresholds)
    d.refresh(3, params)
    assert all(math.isclose(d.thresholds[k], 2 * before[k], rel_tol=1e-6) for k in before)
    fresh = SparseMeZO(sparsity=0.5, mask_interval=3).directions(4, "gaussian", "cpu", params)
    fresh.load_state(d.state())
    assert fresh.thresholds == d.thresholds and set(d.state()) == d.state_keys()
    assert SparseMeZO().directions(4, "gaussian", "cpu", params).state() == {}  # the initial weights give them


def test_chunks_of_a_matrix_are_whole_rows():
    """The low-rank fill relies on it: every chunk of a matrix starts and ends on a row boundary."""
    _, params = tiny(torch.float32)
    for p in matrices(params):
        n = p.tensor[0].numel()
        assert all(r.start % n == 0 and r.stop % n == 0 for r in chunks_of(p.key, p.shape))
