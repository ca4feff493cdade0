"""benchmarks/gpu_check.sh's plumbing, on a CPU (a GPU session has 15 minutes and cannot afford a
broken script): a stage runs under its limit and is summarised, its output packed into $OUT as the
device tool returns it, an unknown stage is named, and a stage that cannot start before the deadline
is skipped, not started."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def gpu_check(tmp_path: Path, stages: str, deadline_s: int) -> tuple[subprocess.CompletedProcess, Path, Path]:
    out, device_out = tmp_path / "g", tmp_path / "OUT"
    device_out.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # the script's pytest is its own
    # One pytest worker: four, each importing torch and transformers, could outrun the smoke stage's 90 s
    # on a 2-core machine that runs the suite's other worker beside them.
    # CARRIED: not this checkout's .gpu/, whose wheels benchmarks/gpu_prepare.sh chose for the GPU image
    env.update(PYTHON=sys.executable, STAGES=stages, DEADLINE_S=str(deadline_s), OUT=str(device_out),
               GPU_TEST_WORKERS="1", CARRIED=str(tmp_path))
    r = subprocess.run(["bash", "benchmarks/gpu_check.sh", str(out)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    return r, out, device_out


def test_a_stage_runs_is_summarised_and_packed_into_out(tmp_path):
    r, out, device_out = gpu_check(tmp_path, "smoke nonesuch", 200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (out / "stages.log").read_text()
    assert "== smoke: limit 90 s" in log and "== smoke: exit 0 after" in log and "== done after" in log
    assert "unknown stage nonesuch" in r.stdout
    # without CUDA every test of tests/gpu skips; the smoke stage selects the kernels' tests
    assert "17 skipped" in (out / "smoke.log").read_text()
    assert "[gw" in r.stdout  # pytest-xdist's per-test lines reach the summary (distzo's [hh:mm:ss] lines do not)
    with tarfile.open(device_out / "gpu.tgz") as pack:
        names = {Path(n).name for n in pack.getnames()}
    assert {"stages.log", "smoke.log", "machine.txt"} <= names
    assert not (device_out / "gpu.tgz.part").exists()


def test_a_stage_that_cannot_start_before_the_deadline_is_skipped(tmp_path):
    r, out, _ = gpu_check(tmp_path, "tests", 40)  # under 30 s left once the grace for the kill is kept
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (out / "stages.log").read_text()
    assert "== tests: skipped" in log and not (out / "tests.log").exists()
