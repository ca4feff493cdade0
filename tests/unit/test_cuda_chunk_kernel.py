"""The CUDA chunk pass's Triton kernel (distzo/native/cuda.py) against the torch ops it replaces.

The same Triton source that runs on a GPU runs here under Triton's interpreter on CPU tensors, with
directions that draw by `cuda_draws` (the counter streams of CUDA) as on a GPU. The interpreter does
each operation in numpy, rounded once, which is what the kernel is compiled to do on a GPU
(`cuda_draws.UNFUSED`: no fused multiply-adds), so equality here checks the kernel's arithmetic and
order, bitwise. tests/gpu checks the compiled kernel, and every process checks each variant's first
call against torch ops on its own GPU (the fallback is tested here too)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from distzo.engine.pending import PendingUpdate
from distzo.native.cuda import CudaKernels
from distzo.zo.directions import Directions, param_key
from distzo.zo.optimizers import SGD, Momentum
from distzo.zo.params import TrainableParam

KERNEL_CHECK = textwrap.dedent("""
    import torch
    from distzo.engine.chunkpass import _torch_ops, chunk_pass
    from distzo.engine.pending import PendingUpdate
    from distzo.native.cuda import CudaKernels
    from distzo.zo.directions import ChunkRef, Directions, param_key
    from distzo.zo.optimizers import SGD
    from distzo.zo.params import TrainableParam

    CASES = {  # name: (update coefficients, weight decay, {query: signs}, part of the span)
        "spsa": (((0, 0.83),), 0.0, {0: (1, -1)}, None),
        "negative coefficient, decay": (((0, -1.7),), 0.1, {0: (1, -1)}, None),
        "three terms, two queries": (((0, 0.5), (1, -0.25), (2, 1.5)), 0.01, {0: (1, -1), 1: (1,)}, None),
        "update only": (((0, 2.0),), 0.3, {}, None),
        "copies only": (None, 0.0, {0: (1, -1), 3: (-1,)}, None),
        "two copies of one sign": (((1, 0.7),), 0.0, {2: (1, 1, -1)}, None),
        "a slice across chunks": (((0, 0.9), (1, -0.3)), 0.05, {1: (1, -1)}, (37, 1801)),
    }
    PER_CHUNK, CHUNKS = 700, 3  # a span of three chunks, the last one short; 700 is not a multiple of 64
    NUMEL = PER_CHUNK * CHUNKS - 211
    bad, ran = [], 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for distribution in ("gaussian", "rademacher"):
            for name, (coefficients, wd, queries, part) in CASES.items():
                lr = 3e-3 if dtype == torch.float32 else 0.05  # big enough to move a half-precision weight
                rule = SGD().rule(6, lr, wd)
                pending = None if coefficients is None else PendingUpdate(6, coefficients, lr, wd, rule)
                results = []
                for fused in (False, True):
                    d = Directions(11, distribution, threads=1)
                    d.counter_draws = True  # draw by cuda_draws (the interpreter runs it on CPU tensors)
                    kernels = CudaKernels(verify=False)
                    d.kernels = kernels if fused else None
                    g = torch.Generator().manual_seed(1)
                    tensor = (torch.randn(NUMEL, generator=g) * 0.5).to(dtype)
                    p = TrainableParam("layer.weight", tensor, param_key("layer.weight"), True)
                    ref = ChunkRef(p.key, 5, 0, NUMEL, PER_CHUNK)  # chunks 5, 6 and 7 of the parameter
                    lo, hi = part or (0, NUMEL)
                    master = tensor[lo:hi]
                    copies = {q: [(s, torch.full((hi - lo,), float("nan"), dtype=dtype)) for s in signs]
                              for q, signs in queries.items()}
                    if fused:
                        assert kernels.handles(d, p, master, pending, copies, ())
                        calls = []
                        kernels._run = (lambda run: lambda *a: (calls.append(1), run(*a)))(kernels._run)
                    chunk_pass(d, p, ref, master, pending, step=7, eps=1e-3, copies=copies, part=part)
                    if fused:
                        ran += bool(calls)
                    results.append([tensor] + [o for outs in copies.values() for _, o in outs])
                for a, b in zip(*results):
                    if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                        bad.append((str(dtype), distribution, name, int((a != b).sum())))
                master, *outs = results[1]
                before = (torch.randn(NUMEL, generator=torch.Generator().manual_seed(1)) * 0.5).to(dtype)
                moved = not torch.equal(master, before)
                window = master[slice(*(part or (0, NUMEL)))]
                if moved != (pending is not None) or any(torch.equal(o, window) for o in outs):
                    bad.append((str(dtype), distribution, name, "update or copies did nothing"))
    print("ran", ran, "mismatches", bad)

    # A variant whose kernel disagrees with torch ops on its first call runs on torch ops from then on.
    d = Directions(3, "gaussian", threads=1)
    d.counter_draws = True
    kernels = CudaKernels()
    d.kernels = kernels
    run = kernels._run
    def wrong(directions, p, ref, master, *rest):
        run(directions, p, ref, master, *rest)
        master.add_(1.0)
    kernels._run = wrong
    outcome = []
    for attempt in range(2):
        tensor = torch.linspace(-1, 1, 900)
        p = TrainableParam("w", tensor, param_key("w"), False)
        pending = PendingUpdate(0, ((0, 1.0),), 1e-2, 0.0, SGD().rule(0, 1e-2, 0.0))
        chunk_pass(d, p, ChunkRef(p.key, 0, 0, 900, 900), tensor, pending, 1, 1e-3, {0: [(1, torch.empty(900))]})
        want = torch.linspace(-1, 1, 900)
        plain = Directions(3, "gaussian", threads=1)
        plain.counter_draws = True
        _torch_ops(plain, TrainableParam("w", want, p.key, False), ChunkRef(p.key, 0, 0, 900, 900), want, pending,
                   1, 1e-3, {}, None, ())
        outcome.append(torch.equal(tensor, want))
    print("fallback", outcome, list(kernels._checked.values()))

    # A kernel that cannot compile or launch: the same, with the reason in the warning.
    def broken(*args):
        raise RuntimeError("no such kernel")
    kernels = CudaKernels()
    kernels._run = broken
    d.kernels = kernels
    tensor = torch.linspace(-1, 1, 900)
    p = TrainableParam("w", tensor, param_key("w"), False)
    chunk_pass(d, p, ChunkRef(p.key, 0, 0, 900, 900), tensor, pending, 1, 1e-3, {0: [(1, torch.empty(900))]})
    print("broken", torch.equal(tensor, want), list(kernels._checked.values()))
""")


def test_the_kernel_is_bitwise_the_torch_ops_under_the_interpreter():
    """float32, float16 and bfloat16 masters; Gaussian and Rademacher z; sgd's update with decay and
    several terms of either sign, copies of several queries (two of one sign: a launch of their own),
    copies alone, the update alone, and a rank's slice that starts and ends inside chunks of a
    three-chunk span: the kernel's master and copies equal the torch path's, bit for bit, and the
    update and the copies really changed something. A kernel that disagrees on a variant's first call,
    or fails to compile or launch, leaves that call's torch result and the variant on torch ops."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ran 42 mismatches []" in r.stdout, r.stdout[-2000:]
    assert "fallback [True, True] [False]" in r.stdout, r.stdout[-2000:]
    assert "broken True [False]" in r.stdout, r.stdout[-2000:]
    assert "it failed (RuntimeError: no such kernel)" in r.stderr, r.stderr[-2000:]


def _setup(distribution: str = "gaussian"):
    d = Directions(1, distribution, threads=1)
    d.counter_draws = True
    t = torch.zeros(64)
    return d, TrainableParam("w", t, param_key("w"), True), t


def test_what_the_kernel_leaves_to_torch_ops():
    """The kernel takes sgd's rule (or none) on the plain counter stream, without state or a mask,
    on contiguous tensors of one supported dtype; everything else stays on torch ops."""
    k = CudaKernels()
    d, p, t = _setup()
    sgd = PendingUpdate(0, ((0, 1.0),), 1e-3, 0.0, SGD().rule(0, 1e-3, 0.0))
    assert k.handles(d, p, t, sgd, {0: [(1, torch.empty(64))]}, ())
    assert k.handles(d, p, t, None, {0: [(1, torch.empty(64))]}, ())
    momentum = PendingUpdate(0, ((0, 1.0),), 1e-3, 0.0, Momentum().rule(0, 1e-3, 0.0))
    assert not k.handles(d, p, t, momentum, {}, (torch.zeros(64),))
    assert not k.handles(d, p, t, sgd, {0: [(1, torch.empty(64, dtype=torch.float16))]}, ())  # another dtype
    assert not k.handles(d, p, t, sgd, {0: [(1, torch.empty(128)[::2])]}, ())  # not contiguous
    d.magnitude_threshold = lambda key: 0.5  # Sparse MeZO's mask
    assert not k.handles(d, p, t, sgd, {}, ())
    plain_cpu = Directions(1, "gaussian", threads=1)  # CPU draws: the C kernels' business
    assert not k.handles(plain_cpu, p, t, sgd, {}, ())
    int_master = torch.zeros(64, dtype=torch.int32)
    assert not k.handles(_setup()[0], TrainableParam("w", int_master, 1, True), int_master, None, {}, ())


def test_low_rank_and_subspace_directions_stay_on_torch_ops():
    from distzo.zo.subspace import SubspaceDirections

    k = CudaKernels()
    d = SubspaceDirections(1, "gaussian", "cpu")
    d.counter_draws = True
    _, p, t = _setup()
    assert not k.handles(d, p, t, None, {}, ())
