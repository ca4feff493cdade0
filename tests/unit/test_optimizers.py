"""The ZO optimizers (docs/optimizers.md), every registered one including a rule added in one file
(examples/plugins/signum.py, through DISTZO_PLUGINS): each update rule against its formula computed in
float64 by a plain loop; every kernel case bitwise its rule's torch form; momentum at 0 is sgd bitwise; FZOO's
and MEAZO's normalisations; offloaded = resident with state (every slot count, reduced precision within its
tolerance); the state in snapshots, resume and replay (MEAZO's host numbers too); configuration errors; sgd's
fingerprint."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from distzo.data.objectives import objective_sums
from distzo.engine import offload_engine, resident_engine
from distzo.engine.chunkpass import chunk_pass
from distzo.engine.optstate import state_key
from distzo.engine.pending import PendingUpdate, Target, apply_pending
from distzo.models.loading import random_model
from distzo.models.selection import adapter_for
from distzo.registry import load_plugin, registry
from distzo.zo.directions import Directions, chunks_of, param_key
from distzo.zo.estimators import SPSA, StepResult
from distzo.zo.optimizers import CURVATURE, FZOO, MEAZO, SGD, Adam, HiZOO, build_optimizer
from distzo.zo.params import TrainableParam
from tests.engine_helpers import PreDrawnDirections
from tests.unit.test_offload import batches, train_steps

SIGNUM = str(Path(__file__).resolve().parents[2] / "examples" / "plugins" / "signum.py")
signum = load_plugin(SIGNUM)  # registers optim.name=signum in this process, as DISTZO_PLUGINS does in others
PLUGIN = {"DISTZO_PLUGINS": SIGNUM}  # what makes optim.name=signum known to another process
OPTIMIZERS = dict(registry("optimizer").items())
NAMES = list(OPTIMIZERS)  # every registered optimizer, the example plugin's included
KERNEL_CASES = [n for n in NAMES if OPTIMIZERS[n].kernel is not None]
STATEFUL = [n for n in NAMES if OPTIMIZERS[n].slots]
SNAPSHOTTED = [n for n in NAMES if OPTIMIZERS[n].slots or OPTIMIZERS[n].scalars]  # a snapshot holds their state
SIGNUM_BETA = signum.Signum.Settings.beta
OWN_SETTINGS = {"hizoo": ["estimator.clean=true", "optim.alpha=1e-3"]}  # what an optimizer needs to run
# (step, coefficients, lr, weight decay) of three updates: two queries, signs of both kinds
STEPS = [(0, ((0, 0.83), (1, -1.7)), 3e-3, 0.1), (1, ((0, -0.4), (1, 2.2)), 3e-3, 0.1),
         (2, ((0, 1.1), (1, 0.05)), 2e-3, 0.1)]
# HiZOO's: one direction a step and its curvature d (one step with c = 0: H still moves)
HIZOO_STEPS = [(0, ((0, 0.83), (CURVATURE, 40.0)), 3e-3, 0.1), (1, ((0, -2.2), (CURVATURE, 15.0)), 3e-3, 0.1),
               (2, ((0, 0.0), (CURVATURE, 90.0)), 2e-3, 0.1), (3, ((0, 1.1), (CURVATURE, 0.0)), 2e-3, 0.1)]
HIZOO_ALPHA = 0.01  # H moves by ~alpha d z^2 a step: 0.1-1 here, so the state test sees it


def small_params(seed: int = 0) -> list[TrainableParam]:
    g = torch.Generator().manual_seed(seed)
    return [TrainableParam("a.weight", torch.randn(9, 13, generator=g) * 0.1, param_key("a.weight"), True),
            TrainableParam("a.bias", torch.randn(31, generator=g) * 0.1, param_key("a.bias"), False)]


def reference(name: str, params, directions: Directions) -> tuple[list[list[float]], list[list[list[float]]]]:
    """The optimizer's three updates in float64, element by element, from the z the directions
    draw (float32 values, read exactly): ZO-Bench's / torch's definitions with decoupled weight decay."""
    xs = [[float(v) for v in p.tensor.view(-1)] for p in params]
    slots = len(OPTIMIZERS[name].slots)
    state = [[[OPTIMIZERS[name].initial] * len(x) for _ in range(slots)] for x in xs]
    second_moment = 0.0  # meazo's v
    for t, (step, coefficients, lr, wd) in enumerate(steps_of(name), start=1):
        curvature = dict(coefficients).pop(CURVATURE, None)
        coefficients = tuple((k, c) for k, c in coefficients if k != CURVATURE)
        g = [c * 2 for _, c in coefficients]  # grads of a q = 2 estimate (c_k = g_k / q)
        if name == "fzoo":
            spread = math.sqrt(sum((v - sum(g) / 2) ** 2 for v in g) / 2)
            coefficients = tuple((k, c / spread) for k, c in coefficients)
        if name == "meazo":  # v <- b2 v + (1 - b2) mean g^2, bias-corrected by the t steps seen
            second_moment = 0.999 * second_moment + 0.001 * (g[0] ** 2 + g[1] ** 2) / 2
            v_hat = second_moment / (1 - 0.999 ** t)
            coefficients = tuple((k, c / (math.sqrt(v_hat) + 1e-8)) for k, c in coefficients)
        zs = [[[float(v) for v in directions.generate(p.shape, p.key, step, k).view(-1)] for k, _ in coefficients]
              for p in params]
        for x, st, z, p in zip(xs, state, zs, params):
            decay = 1 - lr * wd if p.decay else 1.0
            t = step + 1
            for i in range(len(x)):
                g = sum(c * z[j][i] for j, (_, c) in enumerate(coefficients))  # sum_k c_k z_k
                if name in ("sgd", "fzoo", "meazo"):
                    x[i] = x[i] * decay - lr * g
                elif name == "momentum":
                    st[0][i] = 0.9 * st[0][i] + lr * g
                    x[i] = x[i] * decay - st[0][i]
                elif name == "adam":
                    st[0][i] = 0.9 * st[0][i] + 0.1 * g
                    st[1][i] = 0.999 * st[1][i] + 0.001 * g * g
                    m_hat, v_hat = st[0][i] / (1 - 0.9 ** t), st[1][i] / (1 - 0.999 ** t)
                    x[i] = x[i] * decay - lr * m_hat / (math.sqrt(v_hat) + 1e-8)
                elif name == "sign":
                    x[i] = x[i] * decay - lr * ((g > 0) - (g < 0))
                elif name == "signum":
                    st[0][i] = SIGNUM_BETA * st[0][i] + (1 - SIGNUM_BETA) * g
                    x[i] = x[i] * decay - lr * ((st[0][i] > 0) - (st[0][i] < 0))
                elif name == "hizoo":  # HiZOO's code: H <- (1 - a) H + a d H z^2, then x with the new H
                    z0 = z[0][i]
                    st[0][i] = (1 - HIZOO_ALPHA) * st[0][i] + HIZOO_ALPHA * curvature * st[0][i] * z0 * z0
                    x[i] = x[i] * decay - lr * g / math.sqrt(st[0][i])
                else:
                    raise AssertionError(f"no float64 reference for optimizer {name}: add one here")
    return xs, state


def run_engine_updates(name: str, params, directions: Directions) -> tuple[list, list]:
    """The same three updates through the engine's update pass (`apply_update`), float32."""
    opt = build_optimizer_by_name(name)
    state = {p.name: tuple(torch.full_like(p.tensor, opt.initial) for _ in opt.slots) for p in params}
    for step, coefficients, lr, wd in steps_of(name):
        if name in ("fzoo", "meazo"):
            grads = tuple(c * 2 for _, c in coefficients)
            opt.advance(grads)
            coefficients = opt.coefficients(StepResult(0.0, grads, coefficients))
        u = PendingUpdate(step, coefficients, lr, wd, rule=opt.rule(step, lr, wd, coefficients))
        apply_pending(directions, [Target(p, p.tensor, state=state[p.name]) for p in params], u)
    return [p.tensor.view(-1).tolist() for p in params], [[t.view(-1).tolist() for t in state[p.name]] for p in params]


def build_optimizer_by_name(name: str):
    if name == "hizoo":
        return HiZOO(HiZOO.Settings(name="hizoo", alpha=HIZOO_ALPHA))
    return OPTIMIZERS[name]()


def steps_of(name: str):
    return HIZOO_STEPS if name == "hizoo" else STEPS


@pytest.mark.parametrize("native_kernels", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_each_update_is_its_formula_in_float64(name, native_kernels, kernels):
    """Three steps of two queries with weight decay (the bias exempt): weights and state within
    float32 rounding of the float64 loop (relative 1e-5 of what the updates moved; measured: a few
    1e-7). Sign's and Signum's updates are lr times +-1, so their weights agree to rounding exactly as
    well. With the kernels loaded, a rule with a kernel case runs in it, one without on torch ops."""
    directions = Directions(5, "gaussian", threads=1, kernels=kernels if native_kernels else None)
    start = small_params()
    want_x, want_state = reference(name, small_params(), directions)
    got_x, got_state = run_engine_updates(name, small_params(), directions)
    for x0, w, g in zip(start, want_x, got_x):
        moved = max(abs(a - b) for a, b in zip(w, x0.tensor.view(-1).tolist()))
        assert moved > 1e-3
        assert max(abs(a - b) for a, b in zip(w, g)) < 1e-5 * moved + 1e-7
    for ws, gs in zip(want_state, got_state):
        for w, g in zip(ws, gs):
            scale = max(abs(v) for v in w)
            assert scale > 0 and max(abs(a - b) for a, b in zip(w, g)) < 1e-5 * scale


RULE_CASES = {  # terms, decay, queries written, part of the chunk
    "one term, one query": (((0, 0.83),), 0.0, (0,), None),
    "two terms, decay, two queries": (((0, -1.7), (1, 0.4)), 0.1, (0, 1), None),
    "three terms, no copies": (((0, 0.5), (1, -0.25), (2, 1.5)), 0.01, (), None),
    "no terms (zero coefficients)": (((0, 0.0),), 0.2, (0,), None),
    "a slice inside the chunk": (((0, 0.9), (1, -0.3)), 0.05, (1,), (37, 4099)),
}


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
@pytest.mark.parametrize("name", KERNEL_CASES)
@pytest.mark.parametrize("case", list(RULE_CASES))
def test_every_kernel_case_is_bitwise_its_rules_torch_form(kernels, name, distribution, case, monkeypatch):
    """Each registered optimizer with a case in the fused CPU kernel: the pass (update with state,
    then the copies) in the kernel equals the torch form (`Optimizer.update`) bitwise, over whole
    chunks and slices, with and without copies and terms (HiZOO: its one term, its copies shaped by
    the Hessian)."""
    terms, wd, queries, part = RULE_CASES[case]
    calls = []
    original = kernels.chunk
    monkeypatch.setattr(kernels, "chunk", lambda *a, **kw: (calls.append(a[1]), original(*a, **kw))[1])
    opt = build_optimizer_by_name(name)
    shaper = opt if opt.shapes_directions else None  # HiZOO: its copies read the Hessian
    if name == "hizoo":  # one direction a step, and its curvature
        terms = (*terms[:opt.max_terms], (CURVATURE, 25.0))
    numel = 5003
    results = []
    for k in (None, kernels):
        d = Directions(11, distribution, threads=1, kernels=k)
        g = torch.Generator().manual_seed(1)
        p = TrainableParam("layer.weight", torch.randn(numel, generator=g), param_key("layer.weight"), True)
        ref = chunks_of(p.key, p.shape)[0]
        lo, hi = part or (0, numel)
        state = [torch.randn(hi - lo, generator=g).abs() for _ in opt.slots]
        copies = {q: [(+1, torch.empty(hi - lo)), (-1, torch.empty(hi - lo))] for q in queries}
        for step in (4, 5):  # twice: the state of one pass feeds the next
            u = PendingUpdate(step, terms, 3e-3, wd, rule=opt.rule(step, 3e-3, wd, terms))
            chunk_pass(d, p, ref, p.tensor[lo:hi], u, step=step + 1, eps=1e-3, copies=copies, part=part, state=state,
                       shaper=shaper)
        results.append([p.tensor, *state, *(out for outs in copies.values() for _, out in outs)])
    assert OPTIMIZERS[name].kernel in calls  # the second run really ran in the rule's kernel case
    for torch_ops, fused in zip(*results):
        assert torch.equal(torch_ops, fused)


def test_a_rule_step_with_more_pre_drawn_copies_than_slots_spans_two_calls(kernels, monkeypatch):
    """The rule's call holds every term; copies whose pre-drawn z (a low-rank rule's) no longer fits in
    the value slots follow in a call that writes copies only (sgd's case with nothing to apply),
    reading the updated master: the one call of counter streams, bitwise."""
    calls = []
    original = kernels.chunk
    monkeypatch.setattr(kernels, "chunk", lambda *a, **kw: (calls.append(a[1]), original(*a, **kw))[1])
    results = []
    for cls in (PreDrawnDirections, Directions):
        d = cls(2, "gaussian", threads=1, kernels=kernels)
        p = TrainableParam("w", torch.randn(3000, generator=torch.Generator().manual_seed(0)), param_key("w"), True)
        u = PendingUpdate(1, ((0, 1.0), (1, 2.0)), 1e-3, 0.0, rule=Adam().rule(1, 1e-3, 0.0))
        state = [torch.zeros(3000), torch.zeros(3000)]
        copies = {0: [(1, torch.empty(3000))], 1: [(-1, torch.empty(3000))], 2: [(1, torch.empty(3000))]}
        chunk_pass(d, p, chunks_of(p.key, p.shape)[0], p.tensor, u, step=2, eps=1e-3, state=state, copies=copies)
        results.append([p.tensor, *state, *(out for outs in copies.values() for _, out in outs)])
    assert calls == [Adam.kernel, SGD.kernel, Adam.kernel]
    assert all(torch.equal(a, b) for a, b in zip(*results))


def tiny_run(tmp_path, name, *overrides):
    import distzo

    cfg = distzo.compose("model=tiny", "task=synthetic-cue", "steps=4", "eval_every=0", "task.val_size=8",
                         "task.test_size=8", "batch_size=8", "optim.lr=1e-3", "checkpoint.every=2",
                         "threads=1", "log_every=1000", *overrides)
    return distzo.train(cfg, tmp_path / name)


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
def test_momentum_at_zero_is_sgd_bitwise(tmp_path, distribution):
    """mu = 0 leaves the momentum buffer holding only this step's terms and x receiving exactly sgd's
    operations: the weights are sgd's, bitwise (q = 2, weight decay, the fused pass and the outer stage)."""
    from safetensors.torch import load_file

    common = ["estimator.q=2", f"estimator.distribution={distribution}", "optim.weight_decay=0.1"]
    tiny_run(tmp_path, "sgd", *common)
    tiny_run(tmp_path, "momentum", *common, "optim.name=momentum", "optim.momentum.mu=0")
    a = load_file(tmp_path / "sgd" / "final" / "model.safetensors")
    b = load_file(tmp_path / "momentum" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = load_file(tmp_path / "momentum" / "checkpoints" / "step-00000004" / "optimizer.safetensors")
    assert state and all(k.startswith("momentum/") for k in state)


def test_fzoo_divides_by_the_spread_of_the_one_sided_losses():
    est = SPSA(eps=1e-3, q=4, difference="forward")
    losses = torch.tensor([0.70, 0.7021, 0.6990, 0.7003, 0.7040], dtype=torch.float64)
    coefficients = FZOO().coefficients(est.combine(losses))
    perturbed = losses[1:]
    spread = float(perturbed.std(unbiased=False))  # FZOO's sigma: the losses' population std
    want = [float(lk - losses[0]) / (4 * spread) for lk in perturbed]  # (l_k - l_0) / (N sigma)
    assert [k for k, _ in coefficients] == [0, 1, 2, 3]
    assert all(abs(c - w) < 1e-9 * abs(w) for (_, c), w in zip(coefficients, want))
    tied = FZOO().coefficients(est.combine(torch.full((5,), 0.7, dtype=torch.float64)))
    assert tied == ((0, 0.0), (1, 0.0), (2, 0.0), (3, 0.0))  # no spread: no step


def test_meazo_divides_by_the_running_root_mean_square_of_the_projected_gradients():
    """v <- b2 v + (1 - b2) mean_k g_k^2 over the steps advanced, bias-corrected by their count;
    the coefficients divided by sqrt(v_hat) + eps. Its first step moves each direction by lr / q
    (its coefficient c_k / |g| = +-1 / q for q = 1 up to eps); the numbers survive a snapshot's round
    trip. (A skipped step advances nothing: test_a_non_finite_step_does_not_advance_meazo.)"""
    est = SPSA(eps=1e-3, q=2)
    opt = MEAZO(MEAZO.Settings(name="meazo", beta2=0.9, eps=1e-8))
    losses = [(0.70, 0.68, 0.71, 0.72), (0.69, 0.695, 0.70, 0.69), (0.71, 0.70, 0.69, 0.70)]
    v = 0.0
    for t, ls in enumerate(losses, start=1):
        result = est.combine(torch.tensor(ls, dtype=torch.float64))
        opt.advance(result.grads)
        got = opt.coefficients(result)
        v = 0.9 * v + 0.1 * sum(g * g for g in result.grads) / 2
        s = 1 / (math.sqrt(v / (1 - 0.9 ** t)) + 1e-8)
        assert [k for k, _ in got] == [0, 1]
        assert all(abs(c - w * s) < 1e-12 * abs(w * s) for (_, c), (_, w) in zip(got, result.coefficients))
    assert opt.scalar == pytest.approx({"second_moment": v, "steps": 3.0}, rel=1e-15)
    again = MEAZO(MEAZO.Settings(name="meazo", beta2=0.9, eps=1e-8))
    again.load_scalar_state(opt.scalar_state())
    assert again.scalar == opt.scalar
    one = MEAZO()
    first = SPSA(eps=1e-3, q=1).combine(torch.tensor([0.70, 0.68], dtype=torch.float64))
    one.advance(first.grads)
    assert one.coefficients(first)[0][1] == pytest.approx(1.0, rel=1e-6)  # g / |g|
    with pytest.raises(ValueError, match="keeps the scalars"):
        again.load_scalar_state({"second_moment": torch.zeros(1)})


def test_meazo_resumes_from_its_snapshot_and_the_logged_steps_bitwise(tmp_path):
    """MEAZO's numbers travel in the snapshot (optimizer.safetensors, `scalars/`), and resume advances
    them through each logged step it re-applies: resumed from its step-2 snapshot with steps 3-5
    logged after it, and from no snapshot at all (run.json, steps 1-5 re-applied from zeros), a run
    ends with the uninterrupted run's weights and numbers, bitwise. (Were the re-applied steps not to
    advance them, step 6's coefficient would differ, and the weights.)"""
    import shutil

    from safetensors.torch import load_file

    from distzo.state.snapshots import read_optimizer_state
    from distzo.telemetry.jsonl import read_jsonl

    settings = ["optim.name=meazo", "optim.beta2=0.9", "optim.lr=3e-3", "steps=6", "checkpoint.keep=3",
                "estimator.q=2", "optim.weight_decay=0.1"]
    tiny_run(tmp_path, "run", *settings)
    run = tmp_path / "run"
    want = read_optimizer_state(run / "checkpoints" / "step-00000006")
    assert set(want) == {"scalars/second_moment", "scalars/steps"} and float(want["scalars/steps"]) == 6.0
    sixth = [r for r in read_jsonl(run / "trajectory.jsonl") if r["step"] == 6]
    for case, dropped in (("after-2", ("step-00000004", "step-00000006")),
                          ("none", ("step-00000002", "step-00000004", "step-00000006"))):
        cut = tmp_path / case
        shutil.copytree(run, cut)
        for name in dropped:
            shutil.rmtree(cut / "checkpoints" / name)
        shutil.rmtree(cut / "final")
        records = [r for r in read_jsonl(run / "trajectory.jsonl") if r["step"] <= 5]
        (cut / "trajectory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        tiny_run(tmp_path, case, *settings, "resume=auto")
        a, b = load_file(run / "final" / "model.safetensors"), load_file(cut / "final" / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), case
        assert [r for r in read_jsonl(cut / "trajectory.jsonl") if r["step"] == 6] == sixth, case
        got = read_optimizer_state(cut / "checkpoints" / "step-00000006")
        assert all(torch.equal(want[k], got[k]) for k in want), case


def test_a_non_finite_step_does_not_advance_meazo(tmp_path, monkeypatch):
    """A step whose losses are not finite applies nothing and advances nothing: after four steps, the
    second one's losses poisoned, MEAZO's numbers are its recursion over the three steps applied
    (their projected gradients) alone, with t = 3."""
    import distzo

    cfg = distzo.compose("model=tiny", "task=synthetic-cue", "steps=4", "eval_every=0", "task.val_size=8",
                         "task.test_size=8", "batch_size=8", "threads=1", "log_every=1000", "checkpoint.every=0",
                         "optim.name=meazo", "optim.beta2=0.9", "optim.lr=1e-3")
    with distzo.Trainer(cfg, tmp_path / "run") as trainer:
        task, real = trainer.task, trainer.task.objective_sums

        def poisoned(*args, **kwargs):
            sums = real(*args, **kwargs)
            return sums * float("nan") if trainer.step_count == 1 else sums

        monkeypatch.setattr(task, "objective_sums", poisoned)
        records = [trainer.step() for _ in range(4)]
        numbers = dict(trainer.components.optimizer.scalar)
    assert [r.skipped for r in records] == [False, True, False, False]
    v = 0.0
    for r in records:
        if not r.skipped:
            v = 0.9 * v + 0.1 * sum(g * g for g in r.projected_grads) / len(r.projected_grads)
    assert numbers["steps"] == 3.0 and numbers["second_moment"] == pytest.approx(v, rel=1e-12)


def test_every_optimizer_is_documented_and_the_registry_is_the_one_list():
    """optim.name is checked against the registry (no list of its own elsewhere); docs/optimizers.md
    has a section for every built-in optimizer."""
    from pathlib import Path

    import distzo

    text = (Path(__file__).resolve().parents[2] / "docs" / "optimizers.md").read_text()
    for name in (n for n in NAMES if n != "signum"):
        assert f"`{name}`" in text, name
    with pytest.raises(distzo.ConfigError, match=r"use one of: sgd, momentum, adam, sign, fzoo, hizoo, meazo, signum"):
        distzo.compose("optim.name=adamw")


def test_sgd_keeps_its_resume_fingerprint():
    """Runs from before optimizers had names resume: sgd's fingerprint leaves the new keys out
    (values recorded at the commit before them); the other optimizers' include their own keys only."""
    import distzo
    from distzo.config.compose import typed
    from distzo.state.resume import config_fingerprint

    def fingerprint(*overrides):
        return config_fingerprint(typed(distzo.compose(*overrides, validate=False)))

    assert fingerprint() == "b2b1e3f36e13a274"
    assert fingerprint("optim.name=sgd", "optim.adam.beta2=0.5") == "b2b1e3f36e13a274"
    adam = fingerprint("optim.name=adam")
    assert adam != "b2b1e3f36e13a274"
    assert fingerprint("optim.name=adam", "optim.momentum.mu=0.1") == adam
    assert fingerprint("optim.name=adam", "optim.adam.beta2=0.99") != adam


@pytest.mark.parametrize("overrides,message", [
    (["optim.name=adamw"], "optim.name=adamw is not an optimizer; use one of: sgd, momentum, adam, sign, fzoo, hizoo, "
                           "meazo"),
    (["optim=meazo", "optim.beta2=1"], "optim.beta2=1.0 is out of range; it must be >= 0 and < 1"),
    (["optim.name=momentum", "optim.momentum.mu=1"], "optim.mu=1.0 is out of range; it must be >= 0 and < 1"),
    (["optim.name=adam", "optim.adam.beta1=1"], "optim.beta1=1.0 is out of range; it must be >= 0 and < 1"),
    (["optim=adam", "optim.beta1=1"], "optim.beta1=1.0 is out of range; it must be >= 0 and < 1"),
    (["optim.name=fzoo"], "add estimator.difference=forward estimator.q=8"),
    (["optim.name=fzoo", "estimator.difference=forward"], "use estimator.q >= 2 (FZOO uses 8)"),
    (["optim.name=fzoo", "estimator=prge", "peft=lora_fa"], "use estimator=mezo estimator.difference=forward"),
    (["optim.name=hizoo"], "optim.name=hizoo reads the curvature of three losses a step, L(x), L(x + eps z) and "
                           "L(x - eps z): add estimator.clean=true"),
    (["optim.name=hizoo", "estimator.clean=true", "estimator.q=2"], "use estimator.q=1"),
    (["optim.name=hizoo", "estimator=lozo"], "use estimator=mezo estimator.clean=true"),
    (["optim.name=hizoo", "optim.alpha=1"], "optim.alpha=1.0 is out of range; it must be >= 0 and < 1"),
    (["estimator.clean=true", "estimator.difference=forward"], "forward differences have one already: drop "
                                                               "estimator.clean"),
])
def test_configuration_errors(overrides, message):
    import distzo

    with pytest.raises(distzo.ConfigError, match=re.escape(message)):
        distzo.compose("model=tiny", *overrides)


def engine_pair(name: str, offload: bool, slots: int = 3, transfer_dtype=None, kernels=None):
    model = random_model("llama", 400, {"num_hidden_layers": 4}, 0, torch.float32)
    from distzo.zo.params import TrainableParams

    params = TrainableParams.from_model(model)
    kwargs = dict(eps=1e-3, optimizer=build_optimizer_by_name(name))
    directions = Directions(11, kernels=kernels)
    if offload:
        return model, offload_engine(model, adapter_for(model), params, directions, slots=slots,
                                    transfer_dtype=transfer_dtype, **kwargs)
    return model, resident_engine(model, adapter_for(model), params, directions, **kwargs)


def train(eng, steps=5, lr=1e-3):
    """Steps of SPSA q=2 with weight decay 0.1 (test_offload's loop); HiZOO's: q=1 with the clean
    probe its curvature needs. The steps' projected gradients."""
    est = SPSA(eps=1e-3, q=1, clean=True) if eng.optimizer.shapes_directions else None
    return train_steps(eng, steps=steps, lr=lr, est=est)


@pytest.mark.parametrize("name", STATEFUL)
@pytest.mark.parametrize("slots", [1, 3])
def test_offloaded_state_is_streamed_and_bitwise_resident(name, slots):
    """The blocks' state lives beside their host masters and moves with them; weights and state
    equal the resident engine's bitwise (1 slot: every block uploaded each step; 3 slots: blocks
    stay in their slots, their state too)."""
    res_model, res = engine_pair(name, offload=False)
    off_model, off = engine_pair(name, offload=True, slots=slots)
    before = off.transfer_stats()
    assert train(res) == train(off)
    with res.materialized(), off.materialized():
        r, o = res.optimizer_state(), off.optimizer_state()
        assert r.keys() == o.keys() and len(r) == len(list(res.params)) * len(res.optimizer.slots)
        assert all(torch.equal(r[k], o[k]) for k in r)
        assert any(bool((v != res.optimizer.initial).any()) for v in r.values())  # the state moved
    rs, os_ = res_model.state_dict(), off_model.state_dict()
    assert all(torch.equal(rs[k], os_[k]) for k in rs)
    state_bytes = sum(t.numel() * 4 for b in off.store.host_blocks for t in b.state)
    moved = off.transfer_stats()["h2d_bytes"] - before["h2d_bytes"]
    assert state_bytes > 0 and moved >= 4 * state_bytes  # the state went up with the blocks, every step
    assert off.optimizer_state_bytes()["copy"] == res.optimizer_state_bytes()["copy"] == (
        4 * len(res.optimizer.slots) * res.params.numel())


def test_reduced_precision_transfer_keeps_the_state_at_full_precision():
    """bf16 transfer rounds the weights a block computes on, not its optimizer state, which travels
    at float32 both ways. Momentum (linear in the estimate) then tracks the resident run as sgd
    does (tests/unit/test_offload.py's 2% of what training moved). Adam's normalised step does not
    shrink with the estimate, so a projected gradient whose sign the rounding flips moves whole
    elements by lr: docs/optimizers.md says so, and this test keeps to momentum."""
    res_model, res = engine_pair("momentum", offload=False)
    off_model, off = engine_pair("momentum", offload=True, slots=2, transfer_dtype=torch.bfloat16)
    init = {k: v.clone() for k, v in res_model.state_dict().items()}
    train(res)
    train(off)
    assert all(t.dtype == torch.float32 for b in off.store.host_blocks for t in b.state)
    assert all(t.dtype == torch.float32 for ts in off.store.streamer.state_slots for t in ts)
    with res.materialized(), off.materialized():
        r, o = res.optimizer_state(), off.optimizer_state()
        scale = max(float(v.abs().max()) for v in r.values())
        gap = max(float((r[k] - o[k]).abs().max()) for k in r)
    assert 0 < gap < 0.02 * scale
    rs, os_ = res_model.state_dict(), off_model.state_dict()
    moved = max(float((rs[k] - init[k]).abs().max()) for k in rs)
    assert moved > 1e-3 and max(float((rs[k] - os_[k]).abs().max()) for k in rs) < 0.02 * moved


def test_loaded_state_continues_bitwise(tmp_path):
    """A snapshot's state loaded into a fresh engine (resident, and offloaded with one slot)
    continues exactly as the engine that wrote it."""
    for offload in (False, True):
        _, a = engine_pair("adam", offload=offload, slots=1)
        train(a, steps=3)
        with a.materialized():
            weights = {p.name: p.tensor.clone() for p in a.params}
            state = {k: v.clone() for k, v in a.optimizer_state().items()}
        model_b, b = engine_pair("adam", offload=offload, slots=1)
        b.params.load(weights)
        b.load_optimizer_state(state)
        rest = list(batches(5))[3:]

        def more(eng, rest=rest):
            est = SPSA(eps=1e-3, q=2)
            for step, batch in zip((3, 4), rest):
                scores = eng.run_probes(batch, est.plan(), step)
                sums = torch.stack([objective_sums(scores[i], batch) for i in range(len(est.plan()))])
                eng.apply(step, est.combine(sums[:, 0] / sums[:, 1]).coefficients, 1e-3, 0.1)
            with eng.materialized():
                return {p.name: p.tensor.clone() for p in eng.params}, dict(eng.optimizer_state())

        wa, sa = more(a)
        wb, sb = more(b)
        assert all(torch.equal(wa[k], wb[k]) for k in wa) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", SNAPSHOTTED)
def test_replay_rebuilds_weights_from_a_snapshot_and_from_the_trajectory_alone(tmp_path, name):
    """The state is written in snapshots and rebuilt by replay: from the step-2 snapshot (its
    weights and state), and from the initial weights with zero state (--from-step 0), bitwise."""
    from safetensors.torch import load_file

    from distzo.run.replay import replay
    from distzo.state.snapshots import read_optimizer_state

    tiny_run(tmp_path, "run", f"optim.name={name}", "optim.lr=1e-4", *OWN_SETTINGS.get(name, []))
    run_dir = tmp_path / "run"
    final = load_file(run_dir / "final" / "model.safetensors")
    saved = read_optimizer_state(run_dir / "checkpoints" / "step-00000002")
    assert saved and all(k.split("/")[0] in (*build_optimizer_by_name(name).slots, "scalars") for k in saved)
    for from_step in (2, 0):
        out = replay(run_dir, from_step=from_step, out=tmp_path / f"replayed-{from_step}.safetensors")
        got = load_file(out)
        assert got and all(torch.equal(got[k], final[k]) for k in got if k in final)
        assert sum(k in final for k in got) >= len(final) - 1  # a tied head is saved once


def test_build_optimizer_reads_the_config():
    import distzo

    assert isinstance(build_optimizer(distzo.compose(validate=False).optim), SGD)
    adam = build_optimizer(distzo.compose("optim.name=adam", "optim.adam.beta2=0.99", validate=False).optim)
    assert isinstance(adam, Adam) and adam.beta2 == 0.99 and state_key("exp_avg", "w") == "exp_avg/w"


def test_your_own_optimizer_by_name_on_the_command_line(tmp_path):
    """DISTZO_PLUGINS names a module that registers an optimizer; every rank of a 2x1 job imports it,
    so optim.name=signum is checked, trained and logged as a built-in one is (docs/optimizers.md)."""
    import json

    from tests.distributed.launch import run_forked

    r = run_forked(2, ["train", "model=tiny", "task=synthetic-cue", "mesh=2x1", "optim.name=signum", "optim.lr=1e-3",
                       "steps=3", "eval_every=0", "task.val_size=8", "task.test_size=8", "checkpoint.every=3",
                       f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=300, env=PLUGIN)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["optimizer"] == "signum" and summary["optimizer_state_bytes"] > 0
    assert len(set(summary["replica_checksums"])) == 1
    state = read_state(tmp_path / "run" / "checkpoints" / "step-00000003")
    assert state and all(k.startswith("momentum/") for k in state)
    r = run_forked(1, ["train", "model=tiny", "optim.name=signum"], cwd=tmp_path, timeout=300)  # without the plugin
    assert r.returncode == 2 and "optim.name=signum is not an optimizer" in r.stderr


def read_state(snapshot):
    from distzo.state.snapshots import read_optimizer_state

    return read_optimizer_state(snapshot)


def test_hizoo_at_alpha_zero_is_sgd_with_a_clean_probe_bitwise(tmp_path):
    """alpha = 0 keeps HiZOO's Hessian at 1: its probes add eps z / sqrt(1) and its update subtracts
    z (lr c) / sqrt(1), the same roundings as sgd's eps z and (lr c) z (sgd through the fused CPU
    kernel, HiZOO on torch ops), so the weights are sgd's on the same three-probe plan, bitwise (weight
    decay, the outer stage's rows and its copies included); the Hessian in the snapshot is all ones."""
    from safetensors.torch import load_file

    common = ["estimator.clean=true", "optim.weight_decay=0.1"]
    tiny_run(tmp_path, "sgd", *common)
    tiny_run(tmp_path, "hizoo", *common, "optim.name=hizoo", "optim.alpha=0")
    a = load_file(tmp_path / "sgd" / "final" / "model.safetensors")
    b = load_file(tmp_path / "hizoo" / "final" / "model.safetensors")
    earlier = load_file(tmp_path / "sgd" / "checkpoints" / "step-00000002" / "weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], earlier[k]) for k in a if k in earlier)  # the last two steps moved them
    state = load_file(tmp_path / "hizoo" / "checkpoints" / "step-00000004" / "optimizer.safetensors")
    assert state and all(k.startswith("hessian/") and bool((v == 1).all()) for k, v in state.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_hizoo_probes_read_eps_z_over_the_square_root_of_the_updated_hessian(dtype):
    """A HiZOO chunk pass applies the update to x and H, then writes x' +- (eps z) / sqrt(H') with the
    updated x' and H' (in float32, rounded once to a narrower master): against that formula written
    out, bitwise. Rows read by an index (an embedding's) get the same values as the whole copy."""
    from distzo.engine.weights import StageNoise, Workspace
    from distzo.zo.estimators import Probe

    opt = build_optimizer_by_name("hizoo")
    d = Directions(7, "gaussian", threads=1)
    g = torch.Generator().manual_seed(3)
    p = TrainableParam("embed.weight", (torch.randn(40, 64, generator=g) * 0.1).to(dtype), param_key("embed.weight"),
                       True)
    h = torch.rand(40, 64, generator=g) + 0.5
    step, coefficients = 4, ((0, 0.7), (CURVATURE, 30.0))
    x_ref, h_ref = p.tensor.float().clone(), h.clone()
    z_update = d.generate(p.shape, p.key, step - 1, 0)
    HiZOO.update(opt, x_ref, [h_ref], [(z_update, False)], 1 - 1e-3 * 0.1, opt.rule(step - 1, 1e-3, 0.1,
                                                                                      coefficients).constants)
    x_ref = x_ref.to(dtype)
    shaped = (d.generate(p.shape, p.key, step, 0) * 1e-3 / h_ref.double().sqrt().float()).to(dtype)
    u = PendingUpdate(step - 1, coefficients, 1e-3, 0.1, rule=opt.rule(step - 1, 1e-3, 0.1, coefficients))
    plan = [Probe(0, +1), Probe(0, -1)]
    noise = StageNoise(d, Workspace(torch.device("cpu")), step, 1e-3, plan, shaper=opt, state_of=lambda q: (h,))
    noise.prepare([p], lambda q: q.tensor, u)
    plus, minus = noise.copies([p], 0, lambda q: q.tensor)[p.name], noise.copies([p], 1, lambda q: q.tensor)[p.name]
    assert torch.equal(p.tensor, x_ref) and torch.equal(h, h_ref)
    assert torch.equal(plus, x_ref + shaped) and torch.equal(minus, x_ref - shaped)
    index = torch.tensor([[5, 17, 5], [39, 0, 17]])
    unique, inverse, z_rows = noise.rows(p, 0, index)
    assert torch.equal((p.tensor[unique] + z_rows)[inverse], plus[index])


@pytest.mark.parametrize("offload,native_kernels", [(False, False), (False, True), (True, False), (True, True)])
def test_a_hizoo_probe_is_the_model_at_the_hessian_shaped_perturbation(offload, native_kernels, kernels):
    """Through the engine (its stage loop, the outer stage's rows and copies, an offloaded block's
    state uploaded with no update pending; torch ops, and the fused kernel's pass that writes copies
    only): after three HiZOO steps, a + probe's scores are the clean scores of the model set to
    x + (eps z) / sqrt(H), built here from the materialised weights, the Hessian and the directions,
    bitwise (the same operations on the same shapes)."""
    from distzo.zo.estimators import Probe

    _, eng = engine_pair("hizoo", offload=offload, slots=1, kernels=kernels if native_kernels else None)
    train(eng, steps=3)
    batch = next(batches(1))
    with eng.materialized():  # no update pending below: the probe reads x and H as they are
        x = {p.name: p.tensor.clone() for p in eng.params}
        hessian = eng.optimizer_state()
    assert any(bool((h != 1).any()) for h in hessian.values())
    probe = eng.run_probes(batch, [Probe(0, +1)], 3)[0]
    eng.flush()
    with torch.no_grad():
        for p in eng.params:
            z = eng.directions.generate(p.shape, p.key, 3, 0)
            p.tensor.copy_(x[p.name] + (z * 1e-3) / hessian[state_key("hessian", p.name)].double().sqrt().float())
    # (offloaded, the parameters are views of the host masters, and one slot for four blocks means every
    # block is uploaded again for the clean forward)
    with eng.materialized() as weights:
        clean = weights.score(batch)
    assert torch.equal(probe.logits, clean.logits)
