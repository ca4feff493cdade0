"""The command line as users call it: `python -m distzo ARGS`'s exit codes, output and files.

`distzo()` runs the command in a process forked from the suite's preloaded server
(tests/distributed/launch.py): the same `main(argv)` with its own stdout, stderr and exit status,
without paying torch's and transformers' imports per command. `python_m_distzo()` starts the real
interpreter, as a shell would (the main run's test; tests/cluster and test_wheel.py start many
more)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.launch import run_forked

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def distzo(*args, cwd=None) -> subprocess.CompletedProcess:
    return run_forked(1, list(args), cwd=cwd, timeout=300)


def python_m_distzo(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distzo", *args], capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=300)


def test_help_lists_the_commands():
    r = distzo("--help")
    assert r.returncode == 0 and "train" in r.stdout and "prepare" in r.stdout


def test_train_help_and_cfg_are_hydras():
    r = distzo("train", "--help")
    assert r.returncode == 0 and "== distzo train ==" in r.stdout
    presets = sorted(f.stem for f in (Path(__file__).parents[2] / "conf" / "model").glob("*.yaml"))
    assert "tiny" in presets and f"model: {', '.join(presets)}" in r.stdout
    assert "estimator: agzo, lozo, mezo, prge, sparse_mezo, subzero" in r.stdout
    assert "steps: 200" in r.stdout
    r = distzo("train", "--cfg", "job", "model=tiny", "steps=7")
    assert r.returncode == 0 and "steps: 7" in r.stdout and "name: tiny" in r.stdout
    r = distzo("train", "model=tiny", "--info")  # --info alone is Hydra's `all`, whatever follows it in argv
    assert r.returncode == 0 and "Installed Hydra Plugins" in r.stdout and "Defaults List" in r.stdout, r.stderr


# docs/errors.md lists every mistake and tests/e2e/test_errors.py runs each row; these check that
# configuration mistakes are caught before Hydra creates anything.
@pytest.mark.parametrize("args", [["model=nonexistent"], ["steps=abc"], ["model=hf", "model.path=/no/such"],
                                  ["optim.lrr=3"], ["-m", "optim.lr=1e-5,fast"]])
def test_bad_configuration_writes_nothing(tmp_path, args):
    r = distzo("train", *args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 2 and len([x for x in r.stderr.splitlines() if x.strip()]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run directory, no outputs/, no multirun/


@pytest.mark.parametrize("command,written", [("train", "metrics.jsonl"), ("bench", "bench.json"),
                                             ("eval", "eval.json")])
def test_a_used_run_directory_is_refused_before_anything_is_written(tmp_path, command, written):
    """A training run's metrics, or the result a benchmark or an evaluation wrote (which resume=auto
    does not continue, so it is refused with it too), is never written over."""
    out = tmp_path / "run"
    out.mkdir()
    (out / written).write_text('{"type": "train", "step": 1}\n')
    r = distzo(command, "model=tiny", f"hydra.run.dir={out}", cwd=tmp_path)
    assert r.returncode == 2 and f"already holds a run ({written})" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == [written]  # no .hydra/ written over it
    if written != "metrics.jsonl":
        r = distzo(command, "model=tiny", f"hydra.run.dir={out}", "resume=auto", cwd=tmp_path)
        assert r.returncode == 2 and f"already holds a run ({written}); choose another hydra.run.dir" in r.stderr
        assert sorted(p.name for p in out.iterdir()) == [written]


def test_prepare_help():
    r = distzo("prepare", "--help")
    assert r.returncode == 0 and "usage: python -m distzo prepare" in r.stdout


def test_train_writes_the_run_directory(tmp_path):
    out = tmp_path / "run"
    r = python_m_distzo("train", "model=tiny", "task=synthetic-cue", "steps=3", "eval_every=0",
                        f"hydra.run.dir={out}", cwd=tmp_path)
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
    again = distzo("train", "-m", "model=tiny", "task=synthetic-cue", "steps=2", "eval_every=0", "save_final=false",
                   "optim.lr=1e-4,1e-3", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert again.returncode == 1  # each job refuses its used directory, naming the sweep's setting
    lines = [x for x in again.stderr.splitlines() if x.startswith("distzo: error:")]
    assert len(lines) == 2 and all("already holds a run (metrics.jsonl); choose another hydra.sweep.dir" in x
                                   for x in lines), again.stderr[-2000:]


def test_a_failed_job_of_a_sweep_leaves_the_others_to_run(tmp_path):
    """Hydra's convention: a job that fails is recorded as failed and the sweep goes on (the basic
    sweeper runs the rest, then reports the first failure, exit status 1; Optuna's counts it against
    max_failure_rate). Job 0's losses overflow float16 weights (its one line on stderr); job 1 runs."""
    sweep = tmp_path / "sweep"
    r = distzo("train", "-m", "model=tiny", "model.dtype=float16", "task=synthetic-cue", "steps=4", "eval_every=0",
               "save_final=false", "checkpoint.every=0", "task.val_size=16", "task.test_size=16",
               "optim.lr=1e8,1e-3", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert r.returncode == 1
    lines = [x for x in r.stderr.splitlines() if x.startswith("distzo: error:")]
    assert len(lines) == 1 and "non-finite losses" in lines[0], r.stderr[-3000:]
    assert not (sweep / "0" / "summary.json").exists() and (sweep / "1" / "summary.json").is_file()


def test_a_relative_data_path_is_found_from_a_job_that_changes_directory(tmp_path):
    """hydra.job.chdir=true runs the job in its output directory; task.path=reviews.jsonl, relative to
    where the command ran, still names that file (made absolute before Hydra composes, so the saved
    configuration holds it as well)."""
    import json

    rows = [{"text": f"movie {i} was", "label": i % 2} for i in range(40)]
    (tmp_path / "reviews.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = distzo("train", "model=tiny", "task=custom", "task.path=reviews.jsonl", "steps=1", "eval_every=0",
               "save_final=false", "checkpoint.every=0", "task.val_size=8", "task.test_size=8",
               "hydra.job.chdir=true", "hydra.run.dir=run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    saved = (tmp_path / "run" / ".hydra" / "config.yaml").read_text()
    assert f"path: {tmp_path / 'reviews.jsonl'}" in saved


def test_a_run_without_hydra_flags_is_hydras_run_of_the_checked_configuration(tmp_path):
    """A run without Hydra flags runs Hydra's job on the configuration the command composed and checked
    (distzo.cli.hydra_app.run_single) instead of handing the command line to hydra.main, which would
    compose it twice more. hydra.main's run is the reference (an explicit hydra.mode=RUN takes that
    path): the same .hydra/ files (but for the run directory, and the order of the hydra overrides),
    the same log lines, and the callbacks of hydra.callbacks called at the same events; a job that
    raises gets Hydra's report of it and exit status 1 on both."""
    import re

    import yaml

    def run(name, *extra, env=None):
        events = tmp_path / f"{name}.events"
        r = run_forked(1, ["train", "model=tiny", "task=synthetic-cue", "steps=2", "eval_every=0", "save_final=false",
                           "+hydra.callbacks.record._target_=tests.plugins.hydra_events.RecordEvents",
                           f"+hydra.callbacks.record.path={events}", f"hydra.run.dir={tmp_path / name}", *extra],
                       cwd=tmp_path, timeout=300, env=env)
        return r, events.read_text().splitlines()

    def hydra_files(name):
        files = {f: yaml.safe_load((tmp_path / name / ".hydra" / f).read_text())
                 for f in ("config.yaml", "hydra.yaml", "overrides.yaml")}
        h = files["hydra.yaml"]["hydra"]
        h["run"]["dir"] = h["runtime"]["output_dir"] = None
        h["callbacks"]["record"]["path"] = None
        h["overrides"]["hydra"] = sorted(o for o in h["overrides"]["hydra"]
                                         if not o.startswith(("hydra.run.dir=", "+hydra.callbacks.record.path=")))
        return files

    def log_lines(name):  # without the time stamps, durations and the run directory
        text = (tmp_path / name / "train.log").read_text().replace(str(tmp_path / name), "RUN")
        return [re.sub(r"[\d.]+ ?s\b", "T", line.split("]", 1)[1])
                for line in text.splitlines() if line.startswith("[")]

    plain, events = run("plain")
    reference, reference_events = run("reference", "hydra.mode=RUN")
    assert plain.returncode == reference.returncode == 0, plain.stderr[-2000:] + reference.stderr[-2000:]
    assert hydra_files("plain") == hydra_files("reference")
    assert hydra_files("plain")["hydra.yaml"]["hydra"]["mode"] == "RUN"
    assert log_lines("plain") == log_lines("reference") and len(log_lines("plain")) > 5
    assert events == reference_events
    assert [e.split()[0] for e in events] == ["on_run_start", "on_job_start", "on_job_end", "on_run_end"], events
    assert "status=COMPLETED" in events[2]
    # a job that raises (here an optimizer plugin's bug): Hydra's report of it, exit status 1
    (tmp_path / "broken.py").write_text(BROKEN_OPTIMIZER)
    failed = {}
    for name, extra in (("plain-fails", ()), ("reference-fails", ("hydra.mode=RUN",))):
        r, events = run(name, "optim=broken", *extra, env={"DISTZO_PLUGINS": str(tmp_path / "broken.py")})
        assert r.returncode == 1 and "RuntimeError: the broken optimizer's bug" in r.stderr, r.stderr[-2000:]
        assert "Error executing job with overrides" in r.stderr and "HYDRA_FULL_ERROR=1" in r.stderr
        failed[name] = [e.split()[:2] for e in events]
    assert failed["plain-fails"] == failed["reference-fails"]
    assert [e[0] for e in failed["plain-fails"]] == ["on_run_start", "on_job_start", "on_job_end", "on_run_end"]
    assert failed["plain-fails"][2][1] == "status=FAILED"


def test_a_hydra_without_the_run_steps_runs_every_command_line_through_hydra_main(monkeypatch):
    """Where Hydra has moved the internals run_single takes from 1.3 (its callbacks and failure report),
    a run without flags goes to hydra.main as a flagged one does, rather than failing to import."""
    from distzo.cli.hydra_app import single_run

    assert single_run([], ["steps=2"]) and not single_run(["--cfg", "job"], [])
    assert not single_run([], ["hydra.mode=RUN"]) and not single_run([], ["hydra.verbose=true"])
    monkeypatch.setitem(sys.modules, "hydra._internal.callbacks", None)  # `import` raises ImportError
    assert not single_run([], ["steps=2"])


BROKEN_OPTIMIZER = """
from distzo.registry import register
from distzo.zo.optimizers import Optimizer


@register("optimizer", "broken")
class Broken(Optimizer):
    def update(self, x, state, terms, decay, constants):
        raise RuntimeError("the broken optimizer's bug")
"""
