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
    (["model.tokenizer=/no/such/tokenizer"], "model.tokenizer='/no/such/tokenizer' is neither 'smollm2' nor"),
    (["task.template='{title}: {sentence}'"], "{sentence} must be its only placeholder"),
    (["hydra.run.dirr=x"], "unknown config key 'hydra.run.dirr'"),
    (["-m", "optim.lr=1e-5,fast"], "optim.lr=fast: expected float"),
    (["-m", "model=tiny,gpt9"], "unknown model preset 'gpt9'"),
    (["model=tiny", "+model.arch_config.hidden_size=-8"], "model.arch_config={'hidden_size': -8} does not make a valid llama"),
]


@pytest.mark.parametrize("args,message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_clear_line_and_nonzero_exit(tmp_path, args, message):
    r = distzo("train", *args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("distzo: error: ") and message in lines[0], r.stderr
    assert not (tmp_path / "run").exists()  # nothing written


def test_unsupported_local_model_type_is_caught_before_loading(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    r = distzo("train", "model=hf", f"model.path={folder}", cwd=tmp_path)
    assert r.returncode == 2 and "holds a 'gpt2' model, which is not supported yet" in r.stderr


def test_a_used_run_directory_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"type": "train", "step": 1}\n')
    r = distzo("train", "model=tiny", f"hydra.run.dir={out}", cwd=tmp_path)
    assert r.returncode == 2 and "already holds a run" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]  # no .hydra/ written over it


def test_prepare_help():
    r = distzo("prepare", "--help")
    assert r.returncode == 0 and "usage: python -m distzo prepare" in r.stdout


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
