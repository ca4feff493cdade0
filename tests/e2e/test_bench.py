"""`python -m distzo bench`: the JSON it writes holds every figure docs/performance.md lists, with
figures that are consistent with each other (not timings against thresholds: those are benchmarks)."""

from __future__ import annotations

import json
from statistics import median

import pytest

from tests.distributed.launch import run_forked

TINY = ["model=tiny", "task=synthetic-cue", "bench.warmup=1", "bench.steps=2"]


@pytest.mark.parametrize("nproc,mesh,native", [(1, "1x1", "auto"), (2, "2x1", "false")])
def test_bench_writes_every_figure(tmp_path, nproc, mesh, native):
    args = ["bench", *TINY, f"mesh={mesh}", f"engine.native={native}", f"hydra.run.dir={tmp_path / 'b'}"]
    r = run_forked(nproc, args, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert out["mesh"] == mesh and out["timed_steps"] == 2
    assert out["step_time_s"] > 0 and out["forward_time_s"] > 0 and out["tokens_per_s"] > 0
    assert out["overhead_ratio"] > 0
    rounds = out["rounds"]  # every ratio is the median of the rounds' ratios, taken in this one run
    assert len(rounds) == 2 and all(r["untimed_step_s"] > 0 for r in rounds)
    # rounded to 3 decimals
    assert out["overhead_ratio"] == pytest.approx(median(r["step_s"] / r["forward_s"] for r in rounds), abs=1e-3)
    assert out["step_time_s"] == pytest.approx(median(r["pace_s"] for r in rounds), abs=1e-4)  # rounded to 0.1 ms
    assert set(out["breakdown_s"]) == {"noise", "perturb", "update", "wait", "comm", "transfer", "forward"}
    assert all(v >= 0 for v in out["breakdown_s"].values())
    if native == "false":  # torch ops draw z into memory: the draws' share of the work items is measured
        assert out["breakdown_s"]["noise"] > 0
    else:  # the fused kernels generate z inside the pass that writes the copies: all of it is perturb
        assert out["breakdown_s"]["noise"] == 0 and out["breakdown_s"]["perturb"] > 0
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


# DistZO2's Table 1 workload in miniature: batch 4 of 2,048-token sequences on OPT's architecture.
OPT_2048 = ["model=tiny-opt", "+model.arch_config.max_position_embeddings=2048", "task=lm-2048", "batch_size=4"]


def test_the_table_harness_runs_a_tiny_opt_at_2048_tokens(tmp_path):
    """benchmarks/distzo2_table.py, which the GPU session runs, on OPT's architecture at 2,048 tokens:
    a resident row (with MeZO's Algorithm 1 on the token loss) and an offloaded row, both profiled,
    each its own bench invocation; the figures the table reads agree with each other and the table
    prints the goal's checks. 40 texts rather than the preset's 256 (16 validation, 16 test, 8 to
    train on): the rows read 5 batches of one, and each text costs the start its tokenization."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "distzo2_table.py"
    r = subprocess.run([sys.executable, str(script), "run", "--out", str(tmp_path), "--sizes", "tiny", "--device",
                        "cpu", "--dtype", "float32", "--batch-size", "1", "--warmup", "1", "--profile", "--",
                        "bench.steps=1", "bench.peak_tflops=1",
                        "task.num_examples=40"], capture_output=True, text=True, timeout=600,
                       cwd=script.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "table.jsonl").read_text().splitlines()]
    assert [(row["mode"], "bench" in row) for row in rows] == [("resident", True), ("offload", True)], rows
    resident, offload = (json.loads((tmp_path / f"bench-opt-tiny-{m}-float32.json").read_text())
                         for m in ("resident", "offload"))
    step = resident["rounds"][0]["pace_s"]
    assert resident["tokens_per_s"] == pytest.approx(2048 / step, rel=1e-3)  # one sequence of exactly 2,048 tokens
    mfu = resident["mfu"]
    params = 3_344_000  # tiny-opt with 2,048 learned positions (2,050 rows: OPT's offset of 2)
    assert mfu["parameters"] == params and mfu["precision"] == "fp32" and mfu["card"] is None
    assert mfu["flops_per_step"] == 2 * params * 2048 * 2  # MeZO: two forward passes a step
    assert mfu["value"] == pytest.approx(mfu["flops_per_step"] / step / 1e12, abs=1e-4)  # bench.peak_tflops=1
    host = resident["host_memory_bytes"]
    assert host["load_peak"] > 0 and host["training_peak"] > 0 and host["training_now"] <= host["training_peak"]
    ref = resident["mezo_reference"]  # Algorithm 1 on transformers' token loss, timed in the same round
    assert ref["distzo_over_reference"] == pytest.approx(resident["rounds"][0]["step_s"] /
                                                         resident["rounds"][0]["reference_s"], abs=1e-3)
    prof = resident["profile"]
    assert prof["seconds_per_step"] == pytest.approx(sum(prof["by_kind_s"].values()), abs=5e-4)
    assert prof["by_kind_s"]["matmul"] > 0 and prof["by_kind_s"]["attention"] > 0
    assert (tmp_path / "runs" / "opt-tiny-resident-float32" / "profile.txt").read_text().count("aten::") > 5
    assert offload["offload"] == "cpu" and "mezo_reference" not in offload and offload["profile"]["steps"] == 2
    assert offload["mfu"]["parameters"] == params  # the streamed blocks still count
    ratio = offload["tokens_per_s"] / resident["tokens_per_s"]
    assert f"offloaded {ratio:.3f}x resident tokens/s" in r.stdout and "| OPT-TINY | float32 | resident |" in r.stdout


def test_the_reference_scores_the_same_token_loss_as_distzo(tmp_path):
    """MeZO's Algorithm 1 in bench must time the objective distzo trains on: transformers' token loss
    on the right-padded batch equals distzo's clean loss of the step's batch. Both are the mean of
    8,188 float32 token log-likelihoods of the same model; the forwards differ in kernel order only
    (the adapter's blocks, the head in chunks), a few ulps per logit, so a relative 1e-5 is ample."""
    import distzo
    from distzo.config.compose import typed
    from distzo.parallel.mesh import Mesh
    from distzo.run.bench import reference_loss, reference_supported
    from distzo.run.components import build_components
    from distzo.zo.estimators import CLEAN, Probe

    cfg = typed(distzo.compose(*OPT_2048))
    c = build_components(cfg, Mesh.single(), 0)
    try:
        assert reference_supported(c)
        batch = c.task.train_batch(c.sampler.indices(3))
        assert [len(s.tokens) for s in batch.sequences] == [2048] * 4
        scores = c.engine.run_probes(batch, [Probe(CLEAN, 0)], 3)[0]
        total, count = c.task.objective_sums(scores, batch, "loss").tolist()
        assert count == 4 * 2047
        assert reference_loss(c, 3)() == pytest.approx(total / count, rel=1e-5)
    finally:
        c.close()


def test_idle_gaps_name_the_kernels_around_each_gap_and_the_host_work_in_it():
    """bench's `idle_gaps` finds the gaps in the union of the device's intervals (a copy on another
    stream covering a kernel's gap closes it), longest first, and charges each gap's time to the
    main thread's innermost operators (a parent's time less its children's) and to `python` where no
    operator runs; another thread's operators are not the step's host work."""
    from types import SimpleNamespace as NS

    import torch

    from distzo.run.bench import idle_gaps

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = lambda name, start, end, kind, thread=1: NS(name=name, device_type=kind, thread=thread,  # noqa: E731
                                                    time_range=NS(start=start, end=end))
    events = [ev("gemm", 0, 100, cuda), ev("copy", 90, 150, cuda), ev("chunk", 200, 300, cuda),  # gap 150-200
              ev("softmax", 305, 400, cuda), ev("gemm", 1000, 1100, cuda),  # 5 us (too short), 400-1000
              ev("aten::item", 140, 170, cpu), ev("cudaStreamSynchronize", 145, 165, cpu),
              ev("aten::unique", 420, 700, cpu), ev("aten::sort", 450, 550, cpu), ev("cudaLaunchKernel", 990, 995, cpu),
              ev("other thread", 400, 1000, cpu, thread=2), ev("cudaLaunchKernel", 996, 997, cpu),
              ev("cudaLaunchKernel", 998, 999, cpu)]
    g = idle_gaps(events, steps=2)
    assert g["per_step"] == 1.0 and g["seconds_per_step"] == pytest.approx((50 + 600) / 1e6 / 2)
    first, second = g["longest"]
    assert (first["us"], first["after"], first["before"]) == (600, "softmax", "gemm")
    assert dict(first["host"]) == {"python": 600 - 280 - 7, "aten::unique": 180, "aten::sort": 100,
                                   "cudaLaunchKernel": 7}
    assert (second["us"], second["after"], second["before"]) == (50, "copy", "chunk")
    assert dict(second["host"]) == {"python": 30, "cudaStreamSynchronize": 15, "aten::item": 5}


def test_the_device_idle_time_counts_overlapping_kernels_once():
    """bench's `device_idle_s` is the wall time less the union of the device's intervals: kernels on
    several streams that overlap (an offloaded step's uploads beside its compute) count once, and the
    gaps between them are idle."""
    from distzo.run.bench import _union_length

    assert _union_length([]) == 0
    assert _union_length([(0, 10), (2, 5), (8, 12), (20, 25)]) == 17  # [0, 12) and [20, 25)
    assert _union_length([(5, 6), (0, 1), (1, 2)]) == 3  # touching and out of order
