"""A sharded safetensors checkpoint, loaded as users load one (`model=hf model.path=DIR`): with
`offload=cpu` the host holds the checkpoint's bytes once, not the master beside the pages it was read
from, and a quantized base builds with no more than the float one (benchmarks/load_peak.py, which
the GPU session runs on OPT-6.7B)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "load_peak.py"


def load_peak(*args: str) -> dict:
    r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_an_offloaded_sharded_checkpoint_builds_within_1_3x_its_bytes(tmp_path):
    """OPT with 24 blocks in four 200 MB shards of float16 (678.8 MiB). Building the run (tokenizer,
    model, host masters) raises the process's resident high-water mark by the blocks copied into
    their masters, the tokenizer (about 100 MiB) and transformers' bookkeeping: measured 1.12x here.
    Without giving the read pages back it was 1.40x (the master and the mapped pages it was copied
    from), which the 1.3x bound catches. An int8 base (LoRA) builds in less than the float run."""
    folder = tmp_path / "opt"
    written = load_peak("write", "--out", str(folder), "--size", "small", "--shard", "200MB")
    assert written["shards"] == 4
    offloaded = load_peak("measure", "--steps", "0", str(folder), "offload=cpu", "model.dtype=float16")
    assert abs(offloaded["checkpoint_mib"] - written["bytes"] / 2**20) < 0.1
    assert offloaded["host_peak_over_checkpoint"] <= 1.3, offloaded
    quantized = load_peak("measure", "--steps", "0", str(folder), "peft=lora", "model.quantize=int8",
                          "model.dtype=float16")
    assert quantized["host_peak_building_mib"] < offloaded["host_peak_building_mib"], (quantized, offloaded)
