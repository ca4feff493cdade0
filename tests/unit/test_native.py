"""The fused CPU kernels (distzo/native) against the torch ops they replace, bitwise; the counter
streams (Rademacher and Gaussian) against their definitions; building, loading and the ways that fails."""

from __future__ import annotations

import math
import re

import pytest
import torch

from distzo import native
from distzo.engine.chunkpass import chunk_pass
from distzo.engine.pending import PendingUpdate
from distzo.zo import streams
from distzo.zo.directions import (
    Directions,
    chunks_of,
    param_key,
    stream_rows,
)
from distzo.zo.optimizers import SGD
from distzo.zo.params import TrainableParam
from distzo.zo.streams import gaussian_pairs, stream_gaussians, stream_signs, stream_values
from tests.engine_helpers import PreDrawnDirections

MASK = (1 << 64) - 1


def splitmix_word(seed: int, j: int) -> int:
    """Word j of a chunk's stream, in Python integers: the definition, independent of torch."""
    x = (seed + (j + 1) * 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


@pytest.mark.parametrize("seed", [0, 1, 2**63 + 17, MASK])
@pytest.mark.parametrize("offset,n", [(0, 200), (5, 130), (64, 64), (127, 3), (8, 1)])
def test_stream_is_its_definition_in_torch_and_in_the_kernels(kernels, seed, offset, n):
    bits = [(splitmix_word(seed, (offset + i) >> 6) >> ((offset + i) & 63)) & 1 for i in range(n)]
    expected = torch.tensor([0.25 if b else -0.25 for b in bits])
    assert torch.equal(stream_signs(seed, offset, n, 0.25), expected)
    assert torch.equal(kernels.stream_fill(torch.empty(n), native.Stream(seed, 0.25), offset), expected)


def exact_box_muller(seed: int, offset: int, n: int) -> list[float]:
    """Elements [offset, offset + n) of the Gaussian stream's transform in float64 (math's ln, cos and
    sin), from the words in Python integers: the definition the float32 stream approximates."""
    out = []
    for e in range(offset, offset + n):
        word = splitmix_word(seed, e >> 1)
        u1, u2 = ((word >> 40) + 1) / 2**24, ((word >> 16) & 0xFFFFFF) / 2**24
        r, t = math.sqrt(-2 * math.log(u1)), math.pi * (2 * u2 - 1)
        out.append(r * (math.sin(t) if e & 1 else math.cos(t)))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2**63 + 17, MASK])
@pytest.mark.parametrize("offset,n", [(0, 200), (5, 130), (64, 64), (127, 3), (8, 1), (255, 258)])
def test_gaussian_stream_is_the_box_muller_transform_in_torch_and_in_the_kernels(kernels, seed, offset, n):
    """Torch's and the kernels' Gaussian stream are bitwise one another (from odd and even offsets,
    across the kernels' 256-element tiles) and within 1.6e-6 of the exact transform of the same words.
    The bound: |r - r_exact| <= 4.6e-7 over every u1, |cos, sin - exact| <= 1.4e-7 over every angle
    (the next test checks both over all 2^24 values), r <= 5.77, and the product's rounding (half an
    ulp, <= 2.4e-7): 4.6e-7 + 5.77 x 1.4e-7 + 2.4e-7 = 1.51e-6 < 1.6e-6 (`distzo.zo.streams`)."""
    stream = native.Stream(seed, 1.0, True)
    got = stream_gaussians(seed, offset, n)
    assert torch.equal(kernels.stream_fill(torch.empty(n), stream, offset), got)
    assert torch.equal(stream_values(stream, offset, n), got)
    exact = torch.tensor(exact_box_muller(seed, offset, n), dtype=torch.float64)
    assert (got.double() - exact).abs().max() <= 1.6e-6
    scaled = kernels.stream_fill(torch.empty(n), native.Stream(seed, 3.7e-4, True), offset)
    assert torch.equal(scaled, got * torch.tensor(3.7e-4))  # fl(z x fl32(scale)), as z.mul_(scale)


@pytest.mark.parametrize("gaussian", [True, False])
def test_the_torch_definition_in_blocks_and_into_a_given_tensor_is_the_kernels_stream(kernels, monkeypatch, gaussian):
    """The torch path writes into a given tensor (the engine's scratch buffer) when asked, and draws a
    Gaussian range in cache-sized blocks of words: the same bits as the kernels, whatever the blocks'
    boundaries (two blocks and part of a third; then blocks of 7 words from odd and even offsets), in
    place, and rounded once into a narrower `out` (as a copy would). A tensor of another shape is refused."""
    stream = native.Stream(2**63 + 5, 0.3, gaussian)
    n = 4 * streams._WORDS_PER_BLOCK + 1001  # Gaussian: two elements a word, so two blocks and part of a third
    want = kernels.stream_fill(torch.empty(n), stream, 3)
    assert torch.equal(stream_values(stream, 3, n), want)
    out = torch.full((n,), float("nan"))
    assert stream_values(stream, 3, n, out=out) is out and torch.equal(out, want)
    narrow = stream_values(stream, 3, n, out=torch.empty(n, dtype=torch.bfloat16))
    assert torch.equal(narrow, want.bfloat16())
    monkeypatch.setattr(streams, "_WORDS_PER_BLOCK", 7)
    for lo, hi in ((0, 1), (1, 14), (13, 29), (14, 42), (101, 1000)):
        assert torch.equal(stream_values(stream, 3 + lo, hi - lo), want[lo:hi])
        assert torch.equal(stream_values(stream, 3 + lo, hi - lo, out=torch.empty(hi - lo)), want[lo:hi])
    with pytest.raises(ValueError, match="needs 10 elements in one dimension"):
        stream_values(stream, 0, 10, out=torch.empty(2, 5))


def test_the_gaussian_transform_is_within_its_bound_at_every_u1_and_every_angle():
    """The parts of the 1.6e-6 bound, exhaustively: every u1 (2^24 words at angle index 0, where t = -pi
    and the even output is exactly -r) gives r within 4.6e-7 of sqrt(-2 ln u1); every angle (2^24 words
    at u1 = 2^-24, r the largest) gives cos t and sin t within 1.4e-7 of the exact ones, the products'
    rounding included."""
    index = torch.arange(1 << 24, dtype=torch.int64)
    even, odd = gaussian_pairs(index << 40)  # u1 = (index + 1) / 2^24, angle index 0
    r = torch.sqrt(-2 * torch.log((index + 1).double() / 2**24))
    assert (-even.double() - r).abs().max() <= 4.6e-7 and bool((odd == 0).all())
    even, odd = gaussian_pairs(index << 16)  # u1 = 2^-24, every angle index
    r_max = -float(gaussian_pairs(torch.tensor([0]))[0])
    t = math.pi * (index.double() / 2**23 - 1)
    assert (even.double() / r_max - torch.cos(t)).abs().max() <= 1.4e-7
    assert (odd.double() / r_max - torch.sin(t)).abs().max() <= 1.4e-7


def test_the_gaussian_stream_is_standard_normal_and_reaches_its_extremes():
    """2^22 values: mean, variance and kurtosis of N(0, 1) to their sampling error (about 5 standard
    errors: 0.0025, 0.0035, 0.012); and the words at u1's ends: u1 = 2^-24 gives r = sqrt(48 ln 2) =
    5.768 (the largest |z|), u1 = 1 gives r = 0, exactly (a word whose top 24 bits are all set)."""
    z = stream_gaussians(12345, 0, 1 << 22).double()
    assert abs(z.mean()) < 0.0025 and abs(z.var() - 1) < 0.0035
    assert abs((z**4).mean() / z.var() ** 2 - 3) < 0.012
    lowest, highest = torch.tensor([0]), torch.tensor([-1])  # words 0 and 2^64 - 1 (int64 bit patterns)
    assert abs(gaussian_pairs(lowest)[0].item() + math.sqrt(48 * math.log(2))) < 1e-6  # cos(-pi) = -1
    assert gaussian_pairs(highest)[0].item() == 0 and gaussian_pairs(highest)[1].item() == 0


def test_every_vector_width_draws_the_same_gaussian_bits(tmp_path):
    """kernels.c compiles the Gaussian tile for AVX-512, AVX2 and the x86-64 baseline and runs the widest
    the CPU has; each width, built alone (-DDISTZO_NO_CLONES -march=...), draws the torch definition's
    bits. Every width this CPU runs is checked (the suite's machines run all three; a CPU without
    AVX-512 or AVX2 checks fewer, and there the self-check at load vouches for the one chosen)."""
    import platform
    import subprocess

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the clones are x86-64 only")
    flags = set(open("/proc/cpuinfo").read().split())
    v3 = {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"} <= flags  # what GCC's x86-64-v3 assumes
    v4 = v3 and {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags
    widths = ["x86-64"] + ["x86-64-v3"] * v3 + ["x86-64-v4"] * v4
    want = stream_values(native.Stream(77, 0.3, True), 5, 70001)
    for march in widths:
        lib = tmp_path / f"kernels-{march}.so"
        command = [native.compiler(), "-x", "c++", "-shared", "-fPIC", *native.FLAGS, f"-march={march}",
                   "-DDISTZO_NO_CLONES", str(native.SOURCE), "-o", str(lib)]
        build = subprocess.run(command, capture_output=True, text=True)
        assert build.returncode == 0, build.stderr[-2000:]
        got = native.Kernels(lib).stream_fill(torch.empty(70001), native.Stream(77, 0.3, True), 5)
        assert torch.equal(got, want), march


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
def test_any_range_of_a_chunk_is_the_slice_of_the_whole(kernels, distribution):
    for d in (Directions(3, distribution), Directions(3, distribution, kernels=kernels)):
        ref = chunks_of(param_key("w"), (1000, 37))[0]
        whole = d.fill_chunk(torch.empty(ref.stop), 2, 1, ref)
        stream = d.stream(2, 1, ref)
        for lo, hi in ((0, 1), (1, 100), (63, 65), (255, 513), (777, ref.stop)):
            assert torch.equal(d.fill_stream(torch.empty(hi - lo), stream, lo), whole[lo:hi])


@pytest.mark.parametrize("gaussian", [False, True])
def test_rows_of_a_stream(kernels, gaussian):
    seeds, offsets = [3, MASK, 2**63], [0, 71, 1000]
    as_int64 = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in seeds])
    rows = stream_rows(as_int64, torch.tensor(offsets), 50, 0.5, gaussian)
    for r, (s, o) in enumerate(zip(seeds, offsets)):
        assert torch.equal(rows[r], stream_values(native.Stream(s, 0.5, gaussian), o, 50))
    assert torch.equal(kernels.stream_rows(torch.empty(3, 50), seeds, offsets, 0.5, gaussian), rows)
    shape, key = (9000, 130), param_key("table")  # Directions.rows: only the rows asked for
    index = torch.tensor([8999, 0, 4500, 17, 8064])
    distribution = "gaussian" if gaussian else "rademacher"
    for d in (Directions(4, distribution), Directions(4, distribution, kernels=kernels)):
        assert torch.equal(d.rows(shape, key, 2, 3, index), d.generate(shape, key, 2, 3)[index])


def _param(numel: int, decay: bool, seed: int) -> TrainableParam:
    g = torch.Generator().manual_seed(seed)
    return TrainableParam("layer.weight", torch.randn(numel, generator=g), param_key("layer.weight"), decay)


CASES = {  # name: (update coefficients, weight decay, queries written, part of the chunk)
    "spsa": (((0, 0.83),), 0.0, (0,), None),
    "negative coefficient, decay": (((0, -1.7),), 0.1, (0,), None),
    "three terms, two queries": (((0, 0.5), (1, -0.25), (2, 1.5)), 0.01, (0, 1), None),
    "update only": (((0, 2.0),), 0.3, (), None),
    "decay only": (((0, 0.0),), 0.3, (), None),
    "copies only": (None, 0.0, (0, 3), None),
    "a slice inside the chunk": (((0, 0.9), (1, -0.3)), 0.05, (), (37, 4099)),
    "a slice with copies": (((0, 0.9),), 0.0, (1,), (8, 4096)),
}


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_pass_is_bitwise_the_torch_ops(kernels, distribution, case, monkeypatch):
    coefficients, wd, queries, part = CASES[case]
    calls = []
    original = kernels.chunk
    monkeypatch.setattr(kernels, "chunk", lambda *a, **kw: (calls.append(1), original(*a, **kw))[1])
    numel = 5003  # not a multiple of 8 or 64: exercises the kernels' ragged ends
    pending = None if coefficients is None else PendingUpdate(6, coefficients, 3e-3, wd, SGD().rule(6, 3e-3, wd))
    results = []
    for k in (None, kernels):
        d = Directions(11, distribution, threads=1, kernels=k)
        p = _param(numel, decay=True, seed=1)
        ref = chunks_of(p.key, p.shape)[0]
        lo, hi = part or (0, numel)
        master = p.tensor[lo:hi]
        copies = {q: [(+1, torch.empty(hi - lo)), (-1, torch.empty(hi - lo))] for q in queries}
        chunk_pass(d, p, ref, master, pending, step=7, eps=1e-3, copies=copies, part=part)
        results.append([p.tensor] + [out for outs in copies.values() for _, out in outs])
    assert calls  # the second pass really ran in the kernels (else this compares torch with itself)
    for torch_ops, fused in zip(*results):
        assert torch.equal(torch_ops, fused)
    master, *outs = results[1]
    before = _param(numel, True, 1).tensor
    assert torch.equal(master, before) == (pending is None)  # the update changed the master (only it)
    assert all(not torch.equal(out, master[lo:hi]) for out in outs)  # every copy is perturbed


def test_a_step_with_more_pre_drawn_terms_than_slots_spans_several_calls(kernels, monkeypatch):
    """More drawn values than VALUE_SLOTS: the pass is split into calls, terms before copies, and the
    result is the one call's (counter streams need no slot)."""
    calls = []
    original = kernels.chunk

    def counting(master, rule, constants, state=(), offset=0, decay=None, terms=(), queries=(), outs=()):
        calls.append((len(terms), len(queries), len(outs), decay is not None))
        return original(master, rule, constants, state, offset, decay, terms, queries, outs)

    monkeypatch.setattr(kernels, "chunk", counting)
    results = []
    for cls in (PreDrawnDirections, Directions):
        d = cls(2, "gaussian", threads=1, kernels=kernels)
        p = _param(3000, True, 0)
        copies = {0: [(1, torch.empty(3000))], 1: [(-1, torch.empty(3000))]}
        chunk_pass(d, p, chunks_of(p.key, p.shape)[0], p.tensor,
                   PendingUpdate(1, ((0, 1.0), (1, 2.0), (2, -1.0)), 1e-3, 0.1, SGD().rule(1, 1e-3, 0.1)),
                   step=2, eps=1e-3, copies=copies)
        results.append([p.tensor, copies[0][0][1], copies[1][0][1]])
    assert calls == [(2, 0, 0, True), (1, 1, 1, False), (0, 1, 1, False), (3, 2, 2, True)]
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_subspace_chunks_are_not_streams():
    from distzo.zo.subspace import SubspaceDirections

    d = SubspaceDirections(0, "rademacher")
    ref = chunks_of(param_key("proj.weight"), (8, 16))[0]
    assert d.stream(3, 0, ref) is not None
    d.set_basis(ref.key, 3, torch.eye(16)[:, :1])
    assert d.stream(3, 0, ref) is None  # AGZO's R A^T, drawn into memory


def test_kernels_refuse_tensors_they_would_misread(kernels):
    sgd = (SGD.kernel, ())
    with pytest.raises(ValueError, match="contiguous float32"):
        kernels.chunk(torch.zeros(10, dtype=torch.float64), *sgd)
    with pytest.raises(ValueError, match="contiguous float32"):
        kernels.chunk(torch.zeros(10, 2)[:, 0], *sgd)
    with pytest.raises(ValueError, match=">= 15 elements"):  # pre-drawn values shorter than offset + n
        kernels.chunk(torch.zeros(10), *sgd, offset=5, terms=[(torch.zeros(12), True)])
    with pytest.raises(ValueError, match="expected 10 elements"):
        kernels.chunk(torch.zeros(10), *sgd, queries=[native.Stream(1, 1.0)], outs=[(torch.zeros(11), 0, 1)])
    with pytest.raises(ValueError, match="rule 2 with 1 constants and 0 state tensors"):  # adam's needs 7 and 2
        kernels.chunk(torch.zeros(10), 2, (0.5,))
    with pytest.raises(ValueError, match="rule 9 with"):  # no such case
        kernels.chunk(torch.zeros(10), 9, ())


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache and no library loaded yet in this process."""
    monkeypatch.setenv("DISTZO_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_warned", [])
    return tmp_path


def test_built_once_into_the_cache(fresh):
    k = native.load("auto")
    assert k is not None and k.path.parent == native.build_dir() and k.path.is_relative_to(fresh / "native")
    assert [f.name for f in k.path.parent.iterdir() if f.suffix == ".so"] == [k.path.name] == ["distzo_kernels.so"]
    native._loaded.clear()  # a second load in a fresh process finds the cached library and builds nothing
    assert native.load("true").path == k.path
    assert native.load("false") is None and native.load("false", "cuda") is None
    # CUDA's fused pass is the Triton chunk kernel (distzo.native.cuda), compiled by Triton, not here
    assert isinstance(native.load("auto", "cuda"), native.CudaKernels)
    assert isinstance(native.load("true", "cuda"), native.CudaKernels)


def test_cuda_without_triton(monkeypatch):
    """No Triton (a CPU-only torch on a CUDA box, say): auto runs torch ops, true says why it cannot."""
    monkeypatch.setattr(native.cuda, "triton", None)
    assert native.load("auto", "cuda") is None
    with pytest.raises(native.NativeUnavailable, match="engine.native=true on CUDA needs Triton"):
        native.load("true", "cuda")


def test_no_compiler(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/no/cc")
    assert native.load("auto") is None
    assert "the step runs on torch ops (same results, slower)" in caplog.text
    with pytest.raises(native.NativeUnavailable, match=r"engine.native=true, but .* with /no/cc failed: .*not found"):
        native.load("true")


def test_a_compile_error_is_reported(fresh, monkeypatch, tmp_path):
    broken = tmp_path / "kernels.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    with pytest.raises(native.NativeUnavailable, match="building kernels.c with .* failed: .*error: "):
        native.load("true")


def test_a_missing_header_names_the_error_not_the_last_line(fresh, monkeypatch, tmp_path):
    """gcc ends a missing-header failure with "compilation terminated."; the message must carry the
    line that says which header."""
    broken = tmp_path / "kernels.c"
    broken.write_text("#include <no_such_header_distzo.h>\n" + native.SOURCE.read_text())
    monkeypatch.setattr(native, "SOURCE", broken)
    with pytest.raises(native.NativeUnavailable, match="failed: .*no_such_header_distzo.h"):
        native.load("true")


def test_a_compiler_command_line_is_refused_with_the_fix(fresh, monkeypatch):
    """torch's extension builder quotes $CXX as one program name, so CXX="ccache g++" cannot work:
    the message says so (and auto falls back) instead of ninja's "not found"."""
    monkeypatch.setenv("CXX", "env c++")
    assert native.load("auto") is None
    with pytest.raises(native.NativeUnavailable, match="CXX='env c..' is a command line.*single program"):
        native.load("true")


def test_an_unusable_cache_falls_back_or_says_which_key_to_set(fresh, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DISTZO_CACHE", str(blocker / "cache"))  # below a regular file: mkdir fails
    assert native.load("auto") is None
    with pytest.raises(native.NativeUnavailable, match="kernel cache is unusable .*set DISTZO_CACHE"):
        native.load("true")


def test_a_cache_that_is_a_file_is_named_in_one_line(monkeypatch, tmp_path):
    """distzo's cache (distzo.cache) holds the converted models as well as the kernels: a converted
    model's lock is where a model load meets a cache it cannot use, and says which setting to fix."""
    from distzo.cache import CacheError, file_lock

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    where = re.escape(str(blocker))
    monkeypatch.setenv("DISTZO_CACHE", str(blocker))
    with pytest.raises(CacheError, match=rf"^DISTZO_CACHE={where} is not a directory; set DISTZO_CACHE to a "
                                         r"directory \(distzo creates it if missing\)$"):
        with file_lock(blocker / "models" / "x.lock"):
            pass
    monkeypatch.setenv("DISTZO_CACHE", str(blocker / "below"))
    with pytest.raises(CacheError, match=rf"^DISTZO_CACHE={where}/below cannot be used \(Not a directory: "
                                         rf"{where}/below/models\); set DISTZO_CACHE to a writable directory$"):
        with file_lock(blocker / "below" / "models" / "x.lock"):
            pass
    assert blocker.read_text() == ""


@pytest.mark.parametrize("change", [("? 1.0f : -1.0f", "? -1.0f : 1.0f"),  # Rademacher signs flipped
                                    ("#define ANGLE_STEP 0x1.921fb6p-22f", "#define ANGLE_STEP 0x1.921fb8p-22f")])
def test_a_library_that_disagrees_with_torch_is_refused(fresh, monkeypatch, tmp_path, change):
    """The self-check at load: a library whose streams differ (Rademacher signs flipped; the Gaussian
    angle's step one unit in its last place off, which moves many z by an ulp) is not used."""
    source = native.SOURCE.read_text()
    assert change[0] in source
    tampered = tmp_path / "kernels.c"
    tampered.write_text(source.replace(*change))
    monkeypatch.setattr(native, "SOURCE", tampered)
    with pytest.raises(native.NativeUnavailable, match="disagrees with the torch reference"):
        native.load("true")
    assert native.load("auto") is None
