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
    """The engine folds eps (and |lr c_k|) into the draw; that must be bitwise z.mul_(scale), on the
    torch path and the kernels' alike (tests/unit/test_native.py checks that the two draw the same)."""
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


def test_a_run_drawn_by_the_earlier_cpu_gaussian_scheme_continues_from_its_snapshot(tmp_path, caplog):
    """Before directions version 6 the CPU drew Gaussian z with torch's normal_, and runs recorded the
    generator "cpu". This distzo cannot re-apply the steps such a run logged after its snapshot (their z
    is not the z it draws): `resume=auto` continues from the snapshot, with a warning that names both
    generators, and `replay` refuses, naming them too."""
    import json
    import shutil

    import distzo
    from distzo.run.replay import ReplayError
    from distzo.telemetry.jsonl import read_jsonl

    def run(*overrides):
        cfg = distzo.compose("model=tiny", "task=synthetic-cue", "steps=5", "eval_every=0", "task.val_size=8",
                             "task.test_size=8", "batch_size=8", "optim.lr=1e-3", "checkpoint.every=2",
                             "threads=1", "log_every=1000", *overrides)
        return distzo.train(cfg, tmp_path / "run")

    run()
    old = tmp_path / "run"
    shutil.rmtree(old / "checkpoints" / "step-00000005")  # the newest snapshot is step 4's, step 5 logged after it
    shutil.rmtree(old / "final")
    for recorded in [old / "run.json", *old.glob("checkpoints/*/state.json")]:
        state = json.loads(recorded.read_text())
        assert state["gaussian_generator"] == "cpu:gaussian-pairs-series"  # this distzo's, recorded
        recorded.write_text(json.dumps({**state, "gaussian_generator": "cpu", "directions_version": 5}))
    records = list(read_jsonl(old / "trajectory.jsonl"))
    assert {r.pop("drawn_by") for r in records} == {"cpu:gaussian-pairs-series"}  # not logged then
    (old / "trajectory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ReplayError, match=r"drew step 5's Gaussian directions by cpu, and this machine draws by "
                                          r"cpu:gaussian-pairs-series \(the CPU's Gaussian scheme changed"):
        distzo.replay(old, step=5)
    with caplog.at_level("WARNING", logger="distzo"):
        run("steps=6", "resume=auto")
    assert ("cannot be re-applied from step 5 on (step 5's Gaussian directions were drawn by cpu, this run draws "
            "by cpu:gaussian-pairs-series); continuing from step 4") in caplog.text
    assert json.loads((old / "summary.json").read_text())["resumed_from_step"] == 4  # step 5 not re-applied
    assert [r["step"] for r in read_jsonl(old / "trajectory.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_a_run_continued_on_another_machine_re_applies_exactly_the_steps_drawn_as_this_process_draws(tmp_path,
                                                                                                   caplog):
    """Each trajectory record names the generator that drew its Gaussian directions. A session on
    another machine (here: records and a snapshot marked as drawn by a GPU) may have continued the
    run: resume=auto re-applies the logged steps up to the first drawn by another generator and
    continues from there, whatever the snapshot records; so steps this process draws are re-applied
    after another machine's snapshot, and the run ends as the uninterrupted one, bitwise. replay
    refuses a foreign step, naming it."""
    import json
    import shutil

    from safetensors.torch import load_file

    import distzo
    from distzo.run.replay import ReplayError
    from distzo.telemetry.jsonl import read_jsonl

    gpu = "cuda:gaussian-pairs:sm_90"

    def run(where, *overrides):
        cfg = distzo.compose("model=tiny", "task=synthetic-cue", "steps=8", "eval_every=0", "task.val_size=8",
                             "task.test_size=8", "batch_size=8", "optim.lr=1e-3", "checkpoint.every=4",
                             "threads=1", "log_every=1000", *overrides)
        return distzo.train(cfg, where)

    def final(where):
        return load_file(where / "final" / "model.safetensors")

    whole = tmp_path / "whole"
    run(whole)
    assert {r["drawn_by"] for r in read_jsonl(whole / "trajectory.jsonl")} == {"cpu:gaussian-pairs-series"}

    def killed_at_7(name, marked_steps, snapshot_by=None):
        """The run as killed after step 7: step 8's record, snapshot and final weights gone."""
        where = tmp_path / name
        shutil.copytree(whole, where)
        shutil.rmtree(where / "checkpoints" / "step-00000008")
        shutil.rmtree(where / "final")
        (where / "summary.json").unlink()
        records = [dict(r, drawn_by=gpu) if r["step"] in marked_steps else r
                   for r in read_jsonl(where / "trajectory.jsonl") if r["step"] <= 7]
        (where / "trajectory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        if snapshot_by:
            state_file = where / "checkpoints" / "step-00000004" / "state.json"
            state_file.write_text(json.dumps(dict(json.loads(state_file.read_text()), gaussian_generator=snapshot_by)))
        return where

    # Steps 6 and 7 drawn on the GPU: step 5 is re-applied, 6 and 7 run again here.
    gpu_tail = killed_at_7("gpu-tail", {6, 7})
    with pytest.raises(ReplayError, match=r"drew step 6's Gaussian directions on cuda; replay with --device cuda"):
        distzo.replay(gpu_tail, step=7)
    with caplog.at_level("WARNING", logger="distzo"):
        run(gpu_tail, "resume=auto")
    assert (f"cannot be re-applied from step 6 on (step 6's Gaussian directions were drawn by {gpu}, this run "
            "draws by cpu:gaussian-pairs-series); continuing from step 5") in caplog.text
    assert json.loads((gpu_tail / "summary.json").read_text())["resumed_from_step"] == 5
    # Step 4's snapshot written on the GPU, steps 5 to 7 drawn here: all three are re-applied.
    gpu_snapshot = killed_at_7("gpu-snapshot", set(), snapshot_by=gpu)
    run(gpu_snapshot, "resume=auto")
    assert json.loads((gpu_snapshot / "summary.json").read_text())["resumed_from_step"] == 7
    for resumed in (gpu_tail, gpu_snapshot):
        assert [r["step"] for r in read_jsonl(resumed / "trajectory.jsonl")] == list(range(1, 9))
        assert all(torch.equal(v, final(whole)[k]) for k, v in final(resumed).items())
    # Records from before they named their generator: a snapshot between the start and the target,
    # written on a GPU, says that session drew the steps before it; replay refuses them.
    old = tmp_path / "old"
    shutil.copytree(whole, old)
    unnamed = [{k: v for k, v in r.items() if k != "drawn_by"} for r in read_jsonl(old / "trajectory.jsonl")]
    (old / "trajectory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in unnamed))
    assert distzo.replay(old, step=8, from_step=0, out=tmp_path / "all.safetensors").is_file()  # all drawn here
    state_file = old / "checkpoints" / "step-00000004" / "state.json"
    state_file.write_text(json.dumps(dict(json.loads(state_file.read_text()), gaussian_generator=gpu)))
    with pytest.raises(ReplayError, match=r"drew step 1's Gaussian directions on cuda; replay with --device cuda"):
        distzo.replay(old, step=8, from_step=0, out=tmp_path / "refused.safetensors")
