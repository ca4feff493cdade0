"""README.md's commands, as a new user types them: the quick start is what CI runs, every distzo
command in the README composes (a renamed key or preset fails here, not in a user's terminal), the
main job runs as written (shortened: two steps, small evaluations, on the real embedded model and a
2 x 2 mesh), and the commands that use its result work on it. `launch/check_readme.sh` runs the
quick start as written, unshortened, in a fresh clone."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.launch import ENV, run_forked

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SHORT = ["steps=2", "eval_every=0", "task.val_size=16", "task.test_size=16", "checkpoint.every=0"]


def section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", README, flags=re.S | re.M)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def commands(text: str) -> list[str]:
    """The shell commands of the ```bash blocks of `text`: continuations joined, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                out.append(" ".join(w if w == "&&" else shlex.quote(w) for w in words))
    return out


def distzo_argv(command: str) -> list[str] | None:
    """`python -m distzo ARGS` or `torchrun ... -m distzo ARGS` -> ARGS (None for other commands)."""
    words = shlex.split(command)
    if "&&" in words:
        words = words[words.index("&&") + 1:]
    for i in range(len(words) - 2):
        if words[i:i + 2] == ["-m", "distzo"] and words[0] in ("python", "torchrun"):
            return words[i + 2:]
    return None


QUICK_START = commands(section("Quick start").split("**What it prints.**")[0])


def test_the_quick_start_sets_up_runs_the_main_job_and_runs_what_ci_runs():
    assert len(QUICK_START) == 2
    main, tests = QUICK_START
    assert main == "bash launch/setup.sh && torchrun --nproc-per-node 4 -m distzo train mesh=2x2"
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [tests] == ["bash launch/setup.sh && python -m ruff check . && python -m pytest -q"]


def readme_distzo_commands() -> list[list[str]]:
    return [argv for argv in map(distzo_argv, commands(README)) if argv]


@pytest.mark.parametrize("argv", readme_distzo_commands(), ids=lambda a: " ".join(a)[:60])
def test_every_readme_command_composes(argv):
    """Each train / eval / bench command's overrides compose into a valid configuration. Paths the
    README names as examples (a user's files) need not exist, so configurations naming one are only
    composed; the others are validated too (the mesh against no launcher)."""
    command, rest = argv[0], argv[1:]
    assert command in ("train", "eval", "bench", "sweep", "prepare", "replay")
    if command in ("replay", "sweep") or "--help" in rest:
        return
    overrides = [a for a in rest if "=" in a and not a.startswith(("eval.run=", "-"))]
    names_a_path = any(o.split("=", 1)[0].endswith("path") for o in overrides)
    from distzo.config.compose import compose_config, concrete_override_sets
    from distzo.run.checks import validate

    multirun = "-m" in rest  # every value of every sweep, with Hydra's own settings (launcher, sweeper)
    for concrete in concrete_override_sets(overrides) if multirun else [overrides]:
        cfg = compose_config(concrete, with_hydra=multirun)
        if not names_a_path:
            validate(cfg, check_world=False)


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    """The quick start's main job as written, shortened, under a 2 x 2 mesh of forked ranks."""
    argv = distzo_argv(QUICK_START[0])
    root = tmp_path_factory.mktemp("readme")
    run = root / "run"
    r = run_forked(4, argv + SHORT + [f"hydra.run.dir={run}"], cwd=root, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return root, run, r


def test_the_main_job_prints_what_the_readme_shows_and_writes_the_run_directory(main_run):
    _, run, r = main_run
    for shown in ("Task mr-polarity (classification, label words [' terrible', ' great']",
                  "Training 134.52M parameters (peft=none) with mezo (q=1, eps=0.001, gaussian directions), "
                  "seed 0, mesh 2x2",
                  "step 0: validation accuracy", "Validation accuracy", "test accuracy"):
        assert shown in r.stdout + r.stderr, shown
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mesh"] == "2x2" and summary["steps"] == 2
    for name in ("metrics.jsonl", "train.log", ".hydra/overrides.yaml", "trajectory.jsonl", "run.json",
                 "final/model.safetensors", "final/config.json", "final/tokenizer.json"):
        assert (run / name).exists(), name


def test_the_commands_that_use_the_result_work_on_it(main_run):
    root, run, _ = main_run
    uses = commands(section("Quick start").split("**Use the result.**")[1])
    assert len(uses) == 3
    example_dir = re.search(r"eval\.run=(\S+)", uses[0]).group(1)
    evaluated, continued, loaded = (u.replace(example_dir, str(run)) for u in uses)

    r = run_forked(1, distzo_argv(evaluated) + [f"hydra.run.dir={root / 'eval'}"], cwd=root, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((root / "eval" / "eval.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert result["split"] == "test" and result["examples"] == 16
    assert result["accuracy"] == summary["test_accuracy"]  # the same weights, the same batches

    r = run_forked(1, distzo_argv(continued) + SHORT[:1] + SHORT[1:] + [f"hydra.run.dir={root / 'further'}"],
                   cwd=root, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((root / "further" / "summary.json").read_text())["seed"] == 1

    words = shlex.split(loaded)
    assert words[:2] == ["python", "-c"]
    r = subprocess.run([sys.executable, "-c", words[2]], capture_output=True, text=True, env=ENV, cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
