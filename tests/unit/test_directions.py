"""Counter-based directions: z depends only on its coordinates, never on how it is generated."""

import pytest
import torch

from distzo.zo.directions import (
    CHUNK_NUMEL,
    Directions,
    chunk_numel,
    chunks_of,
    param_key,
)


def test_z_is_a_pure_function_of_its_coordinates():
    a, b = Directions(7), Directions(7, threads=1)
    shape, key = (3000, 700), param_key("layer.weight")
    z = a.generate(shape, key, step=5, query=1)
    assert torch.equal(z, b.generate(shape, key, step=5, query=1))  # thread count is irrelevant
    for other in (Directions(8).generate(shape, key, 5, 1), a.generate(shape, key, 6, 1),
                  a.generate(shape, key, 5, 2), a.generate(shape, param_key("other"), 5, 1)):
        assert not torch.equal(z, other)


def test_chunks_are_whole_rows_and_generate_independently():
    d = Directions(3)
    shape, key = (5000, 300), param_key("emb")
    assert chunk_numel(shape) % 300 == 0 and chunk_numel(shape) <= CHUNK_NUMEL
    full = d.generate(shape, key, 1, 0).view(-1)
    refs = chunks_of(key, shape)
    assert len(refs) > 1
    for ref in reversed(refs):  # any order, one chunk at a time
        piece = torch.empty(ref.stop - ref.start)
        assert torch.equal(d.fill_chunk(piece, 1, 0, ref), full[ref.start:ref.stop])


def test_rows_match_the_full_tensor():
    d = Directions(11)
    shape, key = (9000, 130), param_key("table")
    rows = torch.tensor([8999, 0, 4500, 17, 17, 8064])
    assert torch.equal(d.rows(shape, key, 2, 3, rows), d.generate(shape, key, 2, 3)[rows])


def test_one_dimensional_parameters():
    d = Directions(1)
    z = d.generate((3 * CHUNK_NUMEL // 2,), param_key("bias"), 0, 0)
    assert len(chunks_of(0, z.shape)) == 2 and torch.isfinite(z).all()


def test_distributions():
    g = Directions(0).generate((1 << 21,), 1, 0, 0)
    assert abs(g.mean()) < 0.01 and abs(g.var() - 1) < 0.01
    r = Directions(0, "rademacher").generate((1 << 20,), 1, 0, 0)
    assert set(r.unique().tolist()) == {-1.0, 1.0} and abs(r.mean()) < 0.01


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
@pytest.mark.parametrize("numel", [5, 17, 65536 + 5, 1 << 20])
def test_a_scaled_draw_is_the_draw_times_the_scale(distribution, numel):
    """The engine folds eps (and |lr c_k|) into the draw; that must be bitwise z.mul_(scale), with the
    installed torch (its vectorised Box-Muller, and its per-element path under 16 elements)."""
    d = Directions(11, distribution)
    ref = chunks_of(param_key("w"), (numel,))[0]
    for scale in (3.7e-4, 1.0, 0.0):
        whole = d.fill_chunk(torch.empty(numel), 5, 1, ref).mul_(scale)
        assert torch.equal(d.fill_chunk(torch.empty(numel), 5, 1, ref, scale), whole)
    with pytest.raises(ValueError):
        d.fill_chunk(torch.empty(numel), 5, 1, ref, -1.0)


def test_scratch_buffers_are_private_to_a_stream(monkeypatch):
    """On CUDA the sliced update (upload stream) and the perturbation (compute stream) draw z into
    scratch buffers concurrently; each stream gets its own. Simulated here by the stream key."""
    from distzo.zo.workers import ChunkWorkers

    workers = ChunkWorkers(torch.device("cpu"), threads=1)
    current = {"stream": None}
    monkeypatch.setattr(workers, "stream_key", lambda: current["stream"])
    on_cpu = workers.scratch(10)
    current["stream"] = 7
    upload = workers.scratch(10)
    current["stream"] = 8
    compute = workers.scratch(10)
    assert len({b.data_ptr() for b in (on_cpu, upload, compute)}) == 3
    current["stream"] = 7
    assert workers.scratch(10).data_ptr() == upload.data_ptr()  # reused within its stream


@pytest.mark.parametrize("window", [None, (0, 1), (5000, 9000), (1023, 1025), (0, 19200)])
def test_spans_of_whole_chunks_cover_exactly_the_wanted_elements(monkeypatch, window):
    """CUDA work units (`counter_draws`): spans of consecutive whole chunks of at most SPAN_NUMEL
    elements, whose wanted parts tile [lo, hi) with no gap or overlap; the CPU's are the chunks."""
    import distzo.zo.directions as directions

    shape, key = (300, 64), 11
    lo, hi = window or (0, 300 * 64)
    d = Directions(0)
    cpu = d.units(key, shape, lo, hi)
    assert [u[0] for u in cpu] == [r for r in chunks_of(key, shape) if r.start < hi and r.stop > lo]
    monkeypatch.setattr(directions, "SPAN_NUMEL", 3 * chunk_numel(shape))
    d.counter_draws = True
    covered = []
    for ref, part in d.units(key, shape, lo, hi):
        per = chunk_numel(shape)
        assert ref.per_chunk == per and ref.start == ref.index * per and ref.stop - ref.start <= 3 * per
        assert ref.stop % per == 0 or ref.stop == 300 * 64  # whole chunks (the last may be short)
        a, b = (ref.start, ref.stop) if part is None else (ref.start + part[0], ref.start + part[1])
        covered += range(a, b)
    assert covered == list(range(lo, hi))
