"""The CUDA paths, run where a GPU is: offloaded = resident bitwise with the slot ring exercised
(streams, events, pinned host masters), every estimator and trainable set for a few steps, the
decoding objective, and bench on the 1B preset. Skipped with one reason on machines without CUDA
(the CPU suite covers the same logic there)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from distzo.train import train
from tests.conftest import make_config
from tests.distributed.launch import run_forked

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here: tests/gpu runs on a machine with a GPU")

FAST = ("device=cuda", "task=synthetic-cue", "eval_every=3", "log_every=1000", "task.val_size=32",
        "task.test_size=32", "checkpoint.every=0", "seed=4", "batch_size=8", "optim.lr=1e-3")


@pytest.mark.parametrize("model", ["tiny", "tiny-opt", "tiny-qwen"])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_offloaded_equals_resident_on_cuda(tmp_path, model, slots):
    """Blocks uploaded on the upload stream, written back on the offload stream, ordered by events:
    the same weights and evaluations as resident training, bitwise (same kernels, same shapes)."""
    res = train(make_config(*FAST, f"model={model}", "steps=6"), tmp_path / "r")
    off = train(make_config(*FAST, f"model={model}", "steps=6", "offload=cpu", f"offload.slots={slots}"), tmp_path / "o")
    a, b = load_file(tmp_path / "r" / "final" / "model.safetensors"), load_file(tmp_path / "o" / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert res["validation_accuracy_after"] == off["validation_accuracy_after"]


@pytest.mark.parametrize("run", [
    ["estimator=mezo"], ["estimator=mezo", "estimator.distribution=rademacher", "estimator.q=2"],
    ["estimator=prge", "peft=lora_fa", "estimator.q=2", "optim.lr=0.5"], ["estimator=agzo"],
    ["peft=lora", "optim.lr=1e-2"], ["peft=prefix", "estimator.eps=1e-1", "optim.lr=1e-2"],
    ["offload=cpu", "offload.transfer_dtype=bfloat16"],
])
def test_every_estimator_and_trainable_set_trains_on_cuda(tmp_path, run):
    summary = train(make_config(*FAST, "model=tiny", "steps=4", *run), tmp_path / "run")
    assert summary["steps"] == 4 and 0 <= summary["test_accuracy"] <= 1


def test_sliced_offload_on_two_ranks_of_one_gpu_equals_one_process(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("sliced offloading over NCCL needs two GPUs")
    ref = tmp_path / "ref"
    train(make_config(*FAST, "model=tiny", "steps=4"), ref)
    r = run_forked(2, ["train", *FAST, "model=tiny", "steps=4", "mesh=2x1", "offload=cpu", f"hydra.run.dir={tmp_path / 's'}"],
                   cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = load_file(ref / "final" / "model.safetensors"), load_file(tmp_path / "s" / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bench_on_the_1b_preset(tmp_path):
    r = run_forked(1, ["bench", "model=llama-1b", "device=cuda", "bench.warmup=1", "bench.steps=2",
                       f"hydra.run.dir={tmp_path / 'b'}"], cwd=tmp_path, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert out["device"] == "cuda" and out["step_time_s"] > 0
