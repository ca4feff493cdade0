"""`python -m distzo bench`: the JSON it writes holds every figure docs/performance.md lists, with
figures that are consistent with each other (not timings against thresholds: those are benchmarks)."""

from __future__ import annotations

import json
from statistics import median

import pytest

from tests.distributed.launch import run_forked

TINY = ["model=tiny", "task=synthetic-cue", "bench.warmup=1", "bench.steps=2"]


@pytest.mark.parametrize("nproc,mesh", [(1, "1x1"), (2, "2x1")])
def test_bench_writes_every_figure(tmp_path, nproc, mesh):
    r = run_forked(nproc, ["bench", *TINY, f"mesh={mesh}", f"hydra.run.dir={tmp_path / 'b'}"], cwd=tmp_path,
                   timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert out["mesh"] == mesh and out["timed_steps"] == 2
    assert out["step_time_s"] > 0 and out["forward_time_s"] > 0 and out["tokens_per_s"] > 0
    assert out["overhead_ratio"] > 0
    rounds = out["rounds"]  # every ratio is the median of the rounds' ratios, taken in this one run
    assert len(rounds) == 2
    # rounded to 3 decimals
    assert out["overhead_ratio"] == pytest.approx(median(r["step_s"] / r["forward_s"] for r in rounds), abs=1e-3)
    assert out["step_time_s"] == pytest.approx(median(r["pace_s"] for r in rounds), abs=1e-4)  # rounded to 0.1 ms
    assert set(out["breakdown_s"]) == {"noise", "perturb", "update", "wait", "comm", "transfer", "forward"}
    assert all(v >= 0 for v in out["breakdown_s"].values())
    assert out["breakdown_s"]["noise"] > 0  # Gaussian z drawn on CPU: its share of the work items is measured
    # the phases are parts of the step
    assert sum(out["breakdown_s"].values()) <= out["step_time_s"] * 1.5
    peaks = out["peak_memory_bytes"]
    assert peaks["training"] > 0 and peaks["inference"] > 0
    assert out["memory_ratio"] == pytest.approx(peaks["training"] / peaks["inference"], abs=1e-3)
    if nproc == 1:  # the MeZO reference runs on one process only, in the same invocation
        ref = out["mezo_reference"]
        assert ref["distzo_over_reference"] == pytest.approx(median(r["step_s"] / r["reference_s"] for r in rounds),
                                                             abs=1e-3)
        # the same figure inverted (not a median of inverses, which differs for an even number of rounds)
        assert ref["speedup"] == pytest.approx(1 / median(r["step_s"] / r["reference_s"] for r in rounds), abs=1e-3)
        assert "distzo bench:" in r.stdout
        assert "single_rank" not in out
    else:
        assert "mezo_reference" not in out
        # rank 0 alone, timed in the same rounds (bench.single_rank=auto: CPU, one machine)
        one = out["single_rank"]
        assert one["step_time_s"] > 0 and one["tokens_per_s"] > 0
        assert one["throughput_ratio"] == pytest.approx(median(r["single_rank_s"] / r["pace_s"] for r in rounds),
                                                        abs=1e-3)
        assert "one rank alone" in r.stdout


def test_bench_with_idle_ranks_on_a_sliced_offload_mesh(tmp_path):
    """4x1 with MeZO's two evaluations: two ranks are dealt none, yet offloaded blocks reach every rank
    through the node's all-gathers, so they must walk the blocks with their peers in every phase (a
    rank that skipped its forwards once left its peers waiting on a collective until the timeout)."""
    r = run_forked(4, ["bench", *TINY, "mesh=4x1", "offload=cpu", "dist_timeout_s=60", "bench.single_rank=false",
                       f"hydra.run.dir={tmp_path / 'b'}"], cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert out["mesh"] == "4x1" and out["offload"] == "cpu" and out["step_time_s"] > 0
