"""The fused CPU kernels (distzo/native) against the torch ops they replace, bitwise; the Rademacher
counter stream against its definition; building, loading and the ways that fails."""

from __future__ import annotations

import pytest
import torch

from distzo import native
from distzo.engine.chunkpass import chunk_pass
from distzo.engine.pending import PendingUpdate
from distzo.zo.directions import (
    Directions,
    chunks_of,
    param_key,
    stream_rows,
    stream_signs,
)
from distzo.zo.optimizers import SGD
from distzo.zo.params import TrainableParam

MASK = (1 << 64) - 1


@pytest.fixture(scope="module")
def kernels():
    k = native.load("true")  # the suite's machines have a C compiler: the kernels must build here
    assert k is not None
    return k


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
    assert torch.equal(kernels.rademacher_fill(torch.empty(n), native.Stream(seed, 0.25), offset), expected)


def test_any_range_of_a_rademacher_chunk_is_the_slice_of_the_whole(kernels):
    for d in (Directions(3, "rademacher"), Directions(3, "rademacher", kernels=kernels)):
        ref = chunks_of(param_key("w"), (1000, 37))[0]
        whole = d.fill_chunk(torch.empty(ref.stop), 2, 1, ref)
        stream = d.stream(2, 1, ref)
        for lo, hi in ((0, 1), (1, 100), (63, 65), (777, ref.stop)):
            assert torch.equal(d.fill_stream(torch.empty(hi - lo), stream, lo), whole[lo:hi])


def test_rows_of_a_stream(kernels):
    seeds, offsets = [3, MASK, 2**63], [0, 70, 1000]
    as_int64 = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in seeds])
    rows = stream_rows(as_int64, torch.tensor(offsets), 50, 0.5)
    for r, (s, o) in enumerate(zip(seeds, offsets)):
        assert torch.equal(rows[r], stream_signs(s, o, 50, 0.5))
    assert torch.equal(kernels.rademacher_rows(torch.empty(3, 50), seeds, offsets, 0.5), rows)
    shape, key = (9000, 130), param_key("table")  # Directions.rows: only the rows asked for
    index = torch.tensor([8999, 0, 4500, 17, 8064])
    for d in (Directions(4, "rademacher"), Directions(4, "rademacher", kernels=kernels)):
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


def test_a_gaussian_step_with_many_terms_spans_several_calls(kernels, monkeypatch):
    """More drawn values than VALUE_SLOTS: the pass is split into calls, terms before copies."""
    calls = []
    original = kernels.chunk

    def counting(master, rule, constants, state=(), offset=0, decay=None, terms=(), queries=(), outs=()):
        calls.append((len(terms), len(queries), len(outs), decay is not None))
        return original(master, rule, constants, state, offset, decay, terms, queries, outs)

    monkeypatch.setattr(kernels, "chunk", counting)
    d = Directions(2, "gaussian", threads=1, kernels=kernels)
    p = _param(3000, True, 0)
    chunk_pass(d, p, chunks_of(p.key, p.shape)[0], p.tensor,
               PendingUpdate(1, ((0, 1.0), (1, 2.0), (2, -1.0)), 1e-3, 0.1, SGD().rule(1, 1e-3, 0.1)),
               step=2, eps=1e-3, copies={0: [(1, torch.empty(3000))], 1: [(-1, torch.empty(3000))]})
    assert calls == [(2, 0, 0, True), (1, 1, 1, False), (0, 1, 1, False)]


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


def test_a_library_that_disagrees_with_torch_is_refused(fresh, monkeypatch, tmp_path):
    """The self-check at load: a library whose stream differs (here: signs flipped) must not be used."""
    tampered = tmp_path / "kernels.c"
    tampered.write_text(native.SOURCE.read_text().replace("? 1.0f : -1.0f", "? -1.0f : 1.0f"))
    monkeypatch.setattr(native, "SOURCE", tampered)
    with pytest.raises(native.NativeUnavailable, match="disagrees with the torch reference"):
        native.load("true")
    assert native.load("auto") is None
