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


class _Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **constants)` records the call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _signature(args) -> list[str]:
    """The types Triton compiles a launch's non-tensor arguments as (`mangle_type`: an int becomes i32,
    i64 or u64 by its value); a kernel is compiled once per distinct list."""
    from triton.runtime.jit import mangle_type

    return [mangle_type(a) for a in args if not isinstance(a, torch.Tensor)]


def test_the_kernels_signatures_do_not_depend_on_the_hashes(monkeypatch):
    """Triton types an int argument by its value and compiles a kernel per combination of types. The
    64-bit hashes (the step's, the parameter's, the copies') therefore reach the kernels as two 32-bit
    halves: launches for steps and parameters whose hashes fall on either side of 2^31 and 2^63 have
    one signature, so no step after the first compiles anything (an OPT-6.7B step on an H100 took
    2.75 s against 0.49 s while every other step met a new combination of i64 and u64)."""
    import distzo.native.cuda as native_cuda
    from distzo.zo import cuda_draws
    from distzo.zo.directions import ChunkRef

    chunk, draw = _Recorder(), _Recorder()
    monkeypatch.setattr(native_cuda, "_chunk_kernel", chunk)
    monkeypatch.setattr(cuda_draws, "_draw_kernel", draw)
    d = Directions(5, "gaussian", threads=1)
    d.counter_draws = True
    high = [s for s in range(64) if d.step_hash(s) >= 1 << 63][:2]
    low = [s for s in range(64) if d.step_hash(s) < 1 << 63][:2]
    keys = [param_key(f"w{i}") for i in range(64)]
    keys = [next(k for k in keys if k >= 1 << 63), next(k for k in keys if k < 1 << 63), 7]
    kernels = CudaKernels(verify=False)
    for step, previous in zip(high + low, low + high):
        for key in keys:
            p = TrainableParam("w", torch.zeros(900), key, True)
            pending = PendingUpdate(previous, ((0, 0.5), (1, -0.25)), 1e-3, 0.0, SGD().rule(previous, 1e-3, 0.0))
            launches = kernels._launches(pending, {0: [(1, torch.empty(900)), (-1, torch.empty(900))]})
            kernels._run(d, p, ChunkRef(key, 0, 0, 900, 300), p.tensor, pending, step, 1e-3, None, None, launches)
            cuda_draws.fill_span(torch.empty(900), d.key_hash(step, 0, key), 0, 300, 1.0, True)
            rows = torch.tensor([0, 2])
            cuda_draws.fill_rows(torch.empty(2, 300), d.key_hash(step, 1, key), rows, 300, 1, 1.0, True)
    for calls in (chunk.calls, draw.calls):
        signatures = {tuple(_signature(args)) for args, _ in calls}
        assert len(calls) >= 12 and len(signatures) == 1, signatures


def test_split64_round_trips():
    from distzo.zo.cuda_draws import split64

    for value in (0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15):
        hi, lo = split64(value)
        assert -2**31 <= hi < 2**31 and -2**31 <= lo < 2**31
        assert ((hi & 0xFFFFFFFF) << 32 | (lo & 0xFFFFFFFF)) == value


DRAW_CHECK = textwrap.dedent("""
    import numpy as np
    import torch
    from distzo.zo import cuda_draws
    from distzo.zo.streams import mix64, stream_signs

    def gaussian(seed, n):  # the module docstring's Box-Muller pairs of SplitMix64 words, in numpy float32
        words = [mix64((seed + j * 0x9E3779B97F4A7C15) & (2**64 - 1)) for j in range((n + 1) // 2)]
        u1 = (np.array([w >> 40 for w in words], dtype=np.float32) + np.float32(1)) * np.float32(2.0**-24)
        u2 = np.array([(w >> 16) & 0xFFFFFF for w in words], dtype=np.float32) * np.float32(2.0**-24)
        r = np.sqrt(np.float32(-2) * np.log(u1))
        t = (u2 * np.float32(2) - np.float32(1)) * np.float32(3.1415927410125732)
        return np.stack([r * np.cos(t), r * np.sin(t)], axis=1).reshape(-1)[:n]

    bad = []
    per, n = 300, 700  # chunks 4, 5 and part of 6
    for key_hash in (5, 2**31 + 9, 2**63 - 3, 2**63 + 11, 2**64 - 1):
        for g in (False, True):
            got = cuda_draws.fill_span(torch.empty(n), key_hash, 4, per, 1.0, g).numpy()
            for c in range(3):
                seed = mix64(key_hash ^ (4 + c))
                m = min(per, n - c * per)
                want = gaussian(seed, m) if g else stream_signs(seed, 0, m).numpy()
                if not np.array_equal(got[c * per:c * per + m], want):
                    bad.append((key_hash, g, c))
            # rows of a table drawn element by element (`draw`) from odd offsets: the span's values
            rows = torch.tensor([3, 0, 7, 4])  # 75-element rows, 4 to a chunk of 300
            table = cuda_draws.fill_span(torch.empty(8 * 75), key_hash, 0, per, 1.0, g).view(8, 75)
            picked = cuda_draws.fill_rows(torch.empty(4, 75), key_hash, rows, 75, 4, 1.0, g)
            if not torch.equal(picked, table[rows]):
                bad.append((key_hash, g, "rows"))
    print("mismatches", bad)
""")


def test_the_draw_kernel_is_the_counter_streams_under_the_interpreter():
    """`cuda_draws`' kernel, run by Triton's interpreter, draws the streams its docstring defines
    (Rademacher: `distzo.zo.streams`'s; Gaussian: both Box-Muller outputs of each of the same
    SplitMix64 words, in float32 numpy here as in the interpreter, whose ln, cos and sin stand in for
    the GPU's approximate instructions) for hashes on either side of 2^31 and 2^63, which the launch
    splits into halves and the kernel joins; and an embedding's rows, drawn element by element from
    odd offsets (`draw`), are the values the span draws a word per two elements (`draw_block`)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", DRAW_CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mismatches []" in r.stdout, r.stdout[-2000:]


def test_every_kernel_variant_compiles_for_an_h100_without_one():
    """benchmarks/kernel_sass.py compiles the chunk, draw and decode kernels for sm_90 with Triton's own
    ptxas (no GPU needed): each variant a step launches compiles to machine code, and the Gaussian ones use
    the approximate ln, cos and sin the stream is defined by (the interpreter runs numpy's instead,
    so only this compile sees that path before a GPU does)."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "kernel_sass.py"), "--json"], capture_output=True,
                       text=True, env=env, timeout=600, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 11 and all(row["sass"] > 0 and row["arch"] == "sm_90" for row in rows)
    for row in rows:
        want = ["cos.approx", "lg2.approx", "sin.approx"] if "gaussian" in row["variant"] else []
        assert row["approx"] == want, row


def test_a_variant_is_checked_on_a_trial_of_one_chunk():
    """The first call of a variant checks the kernel against the torch path on a clone of up to one
    chunk, not on the call's span (whose float32 scratch, up to 2^25 elements, the torch path would
    keep for the process), and then runs the call itself once, on the kernel that agreed."""
    from distzo.zo.directions import ChunkRef

    d, _, _ = _setup()
    per, chunks = 300, 4
    master = torch.linspace(-1, 1, per * chunks)
    p = TrainableParam("w", master, param_key("w"), True)
    ref = ChunkRef(p.key, 2, 2 * per, 2 * per + per * chunks, per)
    copies = {0: [(1, torch.zeros(per * chunks)), (-1, torch.zeros(per * chunks))]}
    pending = PendingUpdate(0, ((0, 1.0),), 1e-3, 0.0, SGD().rule(0, 1e-3, 0.0))
    seen = []

    def fake_run(directions, p_, ref_, master_, *rest):  # the kernel: records what it was given
        seen.append(("kernel", ref_.stop - ref_.start, master_.numel(), master_.data_ptr() == master.data_ptr()))

    def fake_torch(directions, p_, ref_, master_, u, step, eps, outs, part, state):
        seen.append(("torch", ref_.stop - ref_.start, master_.numel(), master_.data_ptr() == master.data_ptr()))

    kernels = CudaKernels()
    kernels._run = fake_run
    kernels.chunk_pass(d, p, ref, master, pending, 1, 1e-3, copies, None, None, fake_torch)
    # the trial (one chunk, cloned) both ways, then the call on the kernel
    whole = per * chunks
    assert seen == [("kernel", per, per, False), ("torch", per, per, False), ("kernel", whole, whole, True)]
    assert torch.equal(master, torch.linspace(-1, 1, per * chunks))  # the trial left the call's master alone


def test_every_spelling_of_triton_interpret_runs_the_draws_on_numpys_functions():
    """Triton reads TRITON_INTERPRET=true (or on, yes) as 1; so must the draws' switch from the GPU's
    approximate functions (libdevice calls, which the interpreter cannot run) to numpy's."""
    check = ("import torch; from distzo.zo import cuda_draws; "
             "print(cuda_draws.fill_span(torch.empty(8), 5, 0, 8, 1.0, True))")
    for value in ("1", "true"):
        r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "TRITON_INTERPRET": value})
        assert r.returncode == 0 and "tensor(" in r.stdout, (value, r.stderr[-2000:])
