"""The resident engine: perturbations are exact working copies, the master changes only by the update."""

import pytest
import torch

from distzo.engine import resident_engine
from distzo.models.loading import random_model
from distzo.models.selection import adapter_for
from distzo.zo.directions import Directions
from distzo.zo.estimators import CLEAN, Probe
from distzo.zo.params import TrainableParams
from tests.engine_helpers import clean_logits, label_batch, materialize, plan_logits

EPS = 1e-3


def build(arch="llama", seed=0, threads=None, dtype=torch.float32, vocab=400, distribution="gaussian", kernels=None):
    model = random_model(arch, vocab, {}, 0, dtype)
    params = TrainableParams.from_model(model)
    directions = Directions(seed, distribution, threads=threads, kernels=kernels)
    return model, params, resident_engine(model, adapter_for(model), params, directions, eps=EPS)


LABELS = torch.tensor([5, 77])


def sample_batch(n=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, 400, (int(torch.randint(2, 14, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]
    return label_batch(seqs, torch.randint(0, 2, (n,), generator=gen), LABELS)


PLAN = [Probe(0, +1), Probe(0, -1), Probe(1, +1), Probe(CLEAN, 0), Probe(1, -1)]


# gpt2, phi (a head with a bias) and gemma3_text (a scaled embedding) run on the general path.
GENERAL = ["gpt2", "phi", "gemma3_text"]


@pytest.mark.parametrize("arch", ["llama", "opt", "qwen2", *GENERAL])
def test_evaluation_leaves_master_weights_bitwise_unchanged(arch):
    model, _, engine = build(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan_logits(engine, sample_batch(), PLAN, step=3)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def materialised(arch, directions, step, ev):
    """The reference for evaluation `ev`: a fresh copy of the model with theta +- eps*z written into
    its weights (tied weights once), as an engine to run clean."""
    _, ref_params, ref_engine = build(arch)
    if ev.perturbed:
        with torch.no_grad():
            for p in ref_params:
                scaled = directions.generate(p.shape, p.key, step, ev.query).mul_(EPS)
                p.tensor.copy_(p.tensor + scaled if ev.sign > 0 else p.tensor - scaled)
    return ref_engine


@pytest.mark.parametrize("arch", ["llama", "opt", "qwen2", *GENERAL])
def test_perturbed_evaluation_is_the_model_at_theta_plus_eps_z(arch):
    """Reference: materialise theta +- eps*z in a copy (tied weights once) and run it clean."""
    model, params, engine = build(arch)
    batch, step = sample_batch(), 4
    got = plan_logits(engine, batch, PLAN, step)
    for i, ev in enumerate(PLAN):
        ref = clean_logits(materialised(arch, engine.directions, step, ev), batch)
        assert torch.equal(got[i], ref), f"evaluation {ev} differs"


def token_batch(n=4, seed=1):
    """Sequences scored on every next token against the whole vocabulary (no candidates): the head
    reads the whole table, as language modelling and SFT do."""
    from distzo.data.batches import Batch, TokenSequence

    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for unit in range(n):
        tokens = torch.randint(3, 400, (int(torch.randint(4, 12, (1,), generator=gen)),), generator=gen).tolist()
        positions = tuple(range(len(tokens) - 1))
        seqs.append(TokenSequence(tuple(tokens), scored=positions, targets=tuple(tokens[1:]),
                                  units=(unit,) * len(positions)))
    return Batch(seqs, list(range(n)), list(range(n)), torch.zeros(n, dtype=torch.long), readout="tokens")


@pytest.mark.parametrize("arch", ["llama", "opt", "phi"])
def test_a_full_vocabulary_head_is_the_model_at_theta_plus_eps_z(arch):
    """The whole table as the head (OPT's tied embedding, Phi's head with a bias): each evaluation's
    token loss equals the materialised model's, bitwise (the table's working copy is written by the
    chunk pass, the same values the reference adds)."""
    model, params, engine = build(arch)
    batch, step = token_batch(), 4
    scores = engine.run_probes(batch, PLAN, step)
    for i, ev in enumerate(PLAN):
        with materialised(arch, engine.directions, step, ev).materialized() as weights:
            ref = weights.score(batch)
        assert torch.equal(scores[i].nll, ref.nll) and torch.equal(scores[i].count, ref.count), f"evaluation {ev}"
    assert not torch.equal(scores[0].nll, scores[1].nll)  # the perturbation reached the loss


def expected_update(engine, params, step, coeffs, lr, wd, no_decay):
    """theta * (1 - lr wd) - sum_k (lr c_k) z_k, with z drawn whole per parameter (not per chunk)."""
    out = {}
    with torch.no_grad():
        for p in params:
            w = p.tensor.clone()
            if p.name not in no_decay:
                w.mul_(1 - lr * wd)
            for k, c in coeffs:
                w.sub_(engine.directions.generate(p.shape, p.key, step, k).mul_(lr * c))
            out[p.name] = w
    return out


def test_update_is_the_formula_chunked_and_thread_count_invariant():
    # vocab 20,000 x 64: the embedding spans two chunks, so chunk offsets are exercised
    model1, params1, engine1 = build(threads=1, vocab=20_000)
    _, params2, engine2 = build(threads=2, vocab=20_000)
    from distzo.zo.directions import chunks_of

    assert len(chunks_of(0, params1.get("model.embed_tokens.weight").shape)) == 2
    no_decay = {n for n, _ in model1.named_parameters() if "norm" in n}  # Llama has no biases
    coeffs, lr, wd, step = [(0, 0.7), (1, -1.3)], 1e-2, 0.1, 9
    expected = expected_update(engine1, params1, step, coeffs, lr, wd, no_decay)
    norm_before = params1.get("model.norm.weight").tensor.clone()
    assert not torch.equal(expected["model.norm.weight"], norm_before)  # the update does move it
    engine1.apply(step, coeffs, lr, wd)
    engine2.apply(step, coeffs, lr, wd)
    assert engine1.pending is not None and engine2.pending is not None
    assert torch.equal(params1.get("model.norm.weight").tensor, norm_before)  # deferred: unchanged until then
    materialize(engine1)
    materialize(engine2)
    for p1, p2 in zip(params1, params2):
        assert torch.equal(p1.tensor, expected[p1.name]), p1.name
        assert torch.equal(p1.tensor, p2.tensor), p1.name


def test_tied_head_is_updated_once():
    model, params, engine = build()
    expected = expected_update(engine, params, 0, [(0, 1.0)], 1e-2, 0.0, set())["model.embed_tokens.weight"]
    engine.apply(0, [(0, 1.0)], 1e-2, 0.0)
    materialize(engine)
    # applying the update under both names would move the shared tensor twice
    assert torch.equal(model.lm_head.weight, expected)


def test_fused_deferred_update_equals_update_then_perturb():
    """The next step's perturbation applies the pending update chunk by chunk (fused); the result must be
    the update applied on its own, then the perturbation."""
    model_a, _, fused = build()
    model_b, _, plain = build()
    batch, coeffs = sample_batch(), [(0, 0.9), (1, -0.4)]
    fused.apply(0, coeffs, 1e-2, 0.1)
    plain.apply(0, coeffs, 1e-2, 0.1)
    materialize(plain)  # update first, on its own
    assert fused.pending is not None and plain.pending is None
    got = plan_logits(fused, batch, PLAN, step=1)  # update fused into this perturbation
    assert fused.pending is None
    assert torch.equal(got, plan_logits(plain, batch, PLAN, step=1))
    a, b = model_a.state_dict(), model_b.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_workspace_is_reused_across_steps():
    _, _, engine = build()
    plan_logits(engine, sample_batch(), PLAN, step=0)
    sizes = {k: v.data_ptr() for k, v in engine.workspace._buffers.items()}
    # one working buffer per perturbed evaluation of the plan (an empty dict would pass the check below)
    assert set(sizes) == {(f"work{i}", torch.float32) for i, ev in enumerate(PLAN) if ev.perturbed}
    plan_logits(engine, sample_batch(seed=1), PLAN, step=1)
    assert sizes == {k: v.data_ptr() for k, v in engine.workspace._buffers.items()}


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_copies_built_one_block_ahead_change_nothing(arch):
    """engine.copy_stream's look-ahead (on a CPU its two buffer slots run in order, no second stream):
    each block's pending update and copies are built one block ahead into alternating slots, and the
    logits and weights over steps with updates (weight decay too), then a flush, are bitwise the
    one-stream walk's. A slot written before its last reader finished would change the logits; four
    blocks, so each slot is reused within a walk."""
    runs = []
    for ahead in (False, True):
        model = random_model(arch, 400, {"num_hidden_layers": 4}, 0, torch.float32)
        params = TrainableParams.from_model(model)
        engine = resident_engine(model, adapter_for(model), params, Directions(0, "gaussian"), eps=EPS,
                                 copy_stream=ahead)
        logits = []
        for step, coeffs in enumerate([[(0, 0.9), (1, -0.4)], [(0, -2.0), (1, 0.3)], [(0, 0.5), (1, 0.1)]]):
            logits.append(plan_logits(engine, sample_batch(seed=step), PLAN, step=step))
            engine.apply(step, coeffs, 1e-2, 0.1)
        materialize(engine)
        runs.append((logits, model.state_dict(), engine))
    (logits_a, state_a, _), (logits_b, state_b, engine) = runs
    assert all(torch.equal(a, b) for a, b in zip(logits_a, logits_b))
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    # the blocks' copies went to the two slots (the outer stage's to its own buffers)
    names = {name for name, _ in engine.workspace._buffers}
    assert {"ahead0-0", "ahead1-0"} <= names and "work0" in names


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_the_fused_kernels_change_nothing(arch, distribution, monkeypatch):
    """Steps with updates fused into the next perturbation (and weight decay), then a flush: the
    fused CPU kernels give bitwise the logits and weights of torch ops."""
    from distzo import native

    fused = native.load("true")
    calls = []
    original = fused.chunk
    monkeypatch.setattr(fused, "chunk", lambda *a, **kw: (calls.append(1), original(*a, **kw))[1])
    runs = []
    for kernels in (None, fused):
        model, _, engine = build(arch, distribution=distribution, kernels=kernels)
        logits = []
        for step, coeffs in enumerate([[(0, 0.9), (1, -0.4)], [(0, -2.0), (1, 0.3)]]):
            logits.append(plan_logits(engine, sample_batch(seed=step), PLAN, step=step))
            engine.apply(step, coeffs, 1e-2, 0.1)
        materialize(engine)
        runs.append((logits, model.state_dict()))
    assert calls  # the second run's perturbations and updates went through the kernels
    (logits_a, state_a), (logits_b, state_b) = runs
    assert all(torch.equal(a, b) for a, b in zip(logits_a, logits_b))
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
