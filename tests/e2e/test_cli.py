"""The command line as users call it: real subprocesses, real exit codes."""

import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def distzo(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "distzo", *args], capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=300)


def test_help_lists_the_commands():
    r = distzo("--help")
    assert r.returncode == 0 and "train" in r.stdout and "prepare" in r.stdout


def test_train_help_and_cfg_are_hydras():
    r = distzo("train", "--help")
    assert r.returncode == 0 and "== distzo train ==" in r.stdout
    assert "model: hf, smollm2-135m, tiny" in r.stdout and "estimator: mezo" in r.stdout
    assert "steps: 200" in r.stdout
    r = distzo("train", "--cfg", "job", "model=tiny", "steps=7")
    assert r.returncode == 0 and "steps: 7" in r.stdout and "name: tiny" in r.stdout


BAD_INPUTS = [
    (["model=nonexistent"], "unknown model preset 'nonexistent'; available: hf, smollm2-135m, tiny"),
    (["stepz=3"], "unknown config key 'stepz'"),
    (["optim.lrr=3"], "unknown config key 'optim.lrr'"),
    (["steps=abc"], "steps=abc: expected integer"),
    (["optim.lr=fast"], "optim.lr=fast: expected float"),
    (["model=hf", "model.path=/no/such/folder"], "model.path='/no/such/folder' does not exist"),
    (["model=hf"], "model=hf needs a folder"),
    (["estimator.distribution=uniform"], "estimator.distribution='uniform' is not supported"),
    (["batch_size=0"], "batch_size=0 is out of range"),
    (["estimator.eps=-1"], "estimator.eps=-1.0 is out of range"),
]


@pytest.mark.parametrize("args,message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_clear_line_and_nonzero_exit(tmp_path, args, message):
    r = distzo("train", *args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("distzo: error: ") and message in lines[0], r.stderr
    assert not (tmp_path / "run").exists()  # nothing written


def test_unknown_command():
    r = distzo("fly")
    assert r.returncode == 2 and "unknown command 'fly'" in r.stderr


def test_train_writes_the_run_directory(tmp_path):
    out = tmp_path / "run"
    r = distzo("train", "model=tiny", "task=synthetic-cue", "steps=3", "eval_every=0", f"hydra.run.dir={out}",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "metrics.jsonl").is_file() and (out / "final" / "model.safetensors").is_file()
    assert (out / "train.log").is_file() and (out / ".hydra" / "config.yaml").is_file()
    assert "Validation accuracy" in r.stdout


def test_multirun_sweeps_from_the_command_line(tmp_path):
    r = distzo("train", "-m", "model=tiny", "task=synthetic-cue", "steps=2", "eval_every=0", "save_final=false",
               "optim.lr=1e-4,1e-3", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["0", "1"]
    assert all((tmp_path / "sweep" / d / "metrics.jsonl").is_file() for d in ("0", "1"))
