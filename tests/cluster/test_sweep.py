"""`python -m distzo sweep`: expansion, the table's arithmetic, failures, and a real local sweep."""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys

import pytest

from distzo.run.sweep import SweepError, expand, split_overrides
from distzo.telemetry.jsonl import read_jsonl
from tests.cluster.common import FAST
from tests.distributed.launch import run_forked


def test_expand_is_the_cartesian_product_first_key_outermost():
    combos = expand(["mesh=1x2,2x1", "steps=3", "optim.lr=0.001,0.01"])
    assert [swept for _, swept in combos] == [["mesh=1x2", "optim.lr=0.001"], ["mesh=1x2", "optim.lr=0.01"],
                                              ["mesh=2x1", "optim.lr=0.001"], ["mesh=2x1", "optim.lr=0.01"]]
    assert combos[1][0] == ["mesh=1x2", "steps=3", "optim.lr=0.01"]
    with pytest.raises(SweepError, match="nothing to sweep"):
        expand(["mesh=1x2", "steps=3"])


def test_the_sweeps_own_overrides_stay_with_the_sweep():
    runs, own = split_overrides(["mesh=1x2,2x1", "sweep.launcher=slurm", "hydra.sweep.dir=/x", "hydra.job.name=a"])
    assert runs == ["mesh=1x2,2x1", "hydra.job.name=a"] and own == ["sweep.launcher=slurm", "hydra.sweep.dir=/x"]
    with pytest.raises(SweepError, match="set hydra.sweep.dir"):
        split_overrides(["mesh=1x2,2x1", "hydra.run.dir=/x"])


def test_a_failing_run_is_a_row_and_the_sweep_exits_1(tmp_path, monkeypatch, capsys):
    """The launcher replaced by a stand-in: seed=0 'trains' (writes metrics.jsonl), seed=1 fails."""
    import distzo.run.sweep.execution
    from distzo.cli.main import main

    fake = ("import json, pathlib, sys\n"
            "d = pathlib.Path(sys.argv[1]); seed = sys.argv[2]\n"
            "if seed == 'seed=1':\n    print('distzo: error: boom', file=sys.stderr); sys.exit(2)\n"
            "lines = [{'type': 'train', 'step': 1, 'tokens': 100, 'step_time_s': 0.5, 'peak_mem_bytes': 7},\n"
            "         {'type': 'train', 'step': 2, 'tokens': 300, 'step_time_s': 1.5, 'peak_mem_bytes': 9},\n"
            "         {'type': 'eval', 'step': 2, 'split': 'validation', 'accuracy': 0.75, 'loss': 0.5},\n"
            "         {'type': 'summary', 'steps': 2, 'peak_mem_bytes': 8}]\n"
            "(d / 'metrics.jsonl').write_text(''.join(json.dumps(x) + '\\n' for x in lines))\n")
    monkeypatch.setattr(distzo.run.sweep.execution, "local_command",
                        lambda job: [sys.executable, "-c", fake, str(job.run_dir), job.swept[0]])
    out = tmp_path / "sweep"
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", "seed=0,1", f"hydra.sweep.dir={out}"])
    assert exit_.value.code == 1
    printed = capsys.readouterr().out
    assert "2/2 seed=1: failed (exit 2) in" in printed and "distzo: error: boom" in printed
    assert "1/2 runs ok" in printed
    ok, failed = json.loads((out / "sweep.json").read_text())["runs"]
    assert (ok["status"], ok["tokens_per_s"], ok["step_time_s"], ok["peak_mem_bytes"]) == ("ok", 200.0, 1.0, 9)
    assert (ok["val_accuracy"], ok["steps"]) == (0.75, 2)
    assert failed["status"] == "failed (exit 2)" and failed["exit_code"] == 2 and failed["tokens_per_s"] is None
    assert "| 1 | seed=1 | 1x1 | - |" in (out / "sweep.md").read_text()
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def recomputed(metrics):
    """The table's definitions, written out again from metrics.jsonl."""
    records = read_jsonl(metrics)
    train = [r for r in records if r["type"] == "train"]
    val = [r for r in records if r["type"] == "eval" and r["split"] == "validation"][-1]
    return {"tokens_per_s": sum(r["tokens"] for r in train) / sum(r["step_time_s"] for r in train),
            "step_time_s": statistics.median(r["step_time_s"] for r in train),
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in records if "peak_mem_bytes" in r),
            "val_accuracy": val["accuracy"], "val_loss": val["loss"], "steps": train[-1]["step"]}


def test_local_sweep_of_two_layouts(tmp_path):
    """Two layouts, one of them two processes (torchrun's): each is fresh interpreters, about 7 s of CPU
    apiece, and the sweep's bookkeeping is the same for two rows as for more. The sweep's own process
    is forked from the suite's preloaded server."""
    out = tmp_path / "sweep"
    r = run_forked(1, ["sweep", "mesh=1x2,1x1", *FAST, "save_final=false", "sweep.progress_every_s=5",
                       f"hydra.sweep.dir={out}"], cwd=tmp_path, timeout=400)  # the sweep's own process, forked
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[sweep] 1/2 mesh=1x2: 2 process(es)" in r.stdout and "2/2 runs ok" in r.stdout
    with open(out / "sweep.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [row["mesh"] for row in rows] == ["1x2", "1x1"]
    for n, row in enumerate(rows):
        assert row["status"] == "ok" and row["exit_code"] == "0" and row["run_dir"] == str(out / str(n))
        for key, value in recomputed(out / str(n) / "metrics.jsonl").items():
            assert math.isclose(float(row[key]), value, rel_tol=1e-12), (n, key, row[key], value)
    table = (out / "sweep.md").read_text()
    assert table in r.stdout and table.count("| ok |") == 2
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "sweep.json").read_text())["runs"][1]["label"] == "mesh=1x1"
