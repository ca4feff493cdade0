"""docs/architecture.md's "what adding something touches", kept true: components of your own join
distzo through DISTZO_PLUGINS alone, one file each, and run as the built-in ones do.

The example plugins (examples/plugins/clipped_spsa.py: an estimator with a setting;
examples/plugins/signum.py: an optimizer with a setting and a state slot) train from the command line
on 1x1 and on a mesh (the estimator's 2x2 ranks as torchrun starts them, the optimizer's 1x2 workers
self-launched by `python -m distzo train mesh=1x2`, whose launching process composes and checks the plugin's
configuration before its workers import the plugin again), with their settings changed on the command
line, and agree within the layout bound of tests/distributed/test_estimator_layouts.py; they train
under ZOTrainer with their settings as ZOArguments fields. A command and a task kind written here, one file each, run
through `python -m distzo`."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.launch import ENV, run_forked

ROOT = Path(__file__).resolve().parents[2]
ESTIMATOR, OPTIMIZER = ROOT / "examples" / "plugins" / "clipped_spsa.py", ROOT / "examples" / "plugins" / "signum.py"
PLUGINS = {"DISTZO_PLUGINS": f"{ESTIMATOR},{OPTIMIZER}"}
STEPS = 6
COMMON = ["train", "model=tiny", "task=synthetic-cue", "eval_every=0", "log_every=1000", f"steps={STEPS}",
          "batch_size=8", "seed=5", "task.val_size=16", "task.test_size=16", "checkpoint.every=0", "estimator.q=2"]
RUNS = {  # each plugin with a setting of its own changed on the command line
    "clipped_spsa": ["estimator=clipped_spsa", "estimator.clip=0.05", "optim.lr=1e-3"],
    "signum": ["optim=signum", "optim.beta=0.5", "optim.lr=1e-3"],
}
# each plugin's mesh run, and how it starts: 4 ranks forked with torchrun's environment, or one plain
# process that starts its 2 workers (fresh interpreters, each paying its imports: one such run of two
# is enough)
MESHES = {"clipped_spsa": ("2x2", 4), "signum": ("1x2", 1)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each plugin's run on 1x1 (in 1x1/) and on its mesh (MESHES, in mesh/)."""
    root = tmp_path_factory.mktemp("plugins")
    for name, overrides in RUNS.items():
        for folder, (mesh, nproc) in (("1x1", ("1x1", 1)), ("mesh", MESHES[name])):
            r = run_forked(nproc, [*COMMON, *overrides, f"mesh={mesh}", f"hydra.run.dir={root / name / folder}"],
                           cwd=root, timeout=600, env=PLUGINS)
            assert r.returncode == 0, r.stderr[-3000:]
    return root


def initial_weights(root: Path) -> dict[str, torch.Tensor]:
    from distzo.config.compose import compose_config, typed
    from distzo.models.loading import load_model

    model, _ = load_model(typed(compose_config(["model=tiny"])).model)
    model.save_pretrained(root / "initial")
    return load_file(root / "initial" / "model.safetensors")


@pytest.mark.parametrize("name", list(RUNS))
def test_a_plugin_trains_on_a_mesh_as_on_one_process(runs, name):
    """The bound of tests/distributed/test_estimator_layouts.py: the weights agree to 1e-4 of how far
    training moved them; Signum, like sign SGD, may take the other sign on the few elements whose
    estimate is within the shards' rounding of zero (at most 1e-3 of them, each off by at most
    2 lr a step)."""
    ref = load_file(runs / name / "1x1" / "final" / "model.safetensors")
    got = load_file(runs / name / "mesh" / "final" / "model.safetensors")
    start = initial_weights(runs)
    moved = max(float((ref[k] - start[k]).abs().max()) for k in ref)
    diff = max(float((ref[k] - got[k]).abs().max()) for k in ref)
    assert moved > 1e-4, moved
    if name == "signum":
        off = sum(int(((ref[k] - got[k]).abs() > 1e-4 * moved).sum()) for k in ref)
        assert off <= 1e-3 * sum(t.numel() for t in ref.values()), off
        assert diff <= 2 * 1e-3 * STEPS * (1 + 1e-6), diff
    else:
        assert diff < 1e-4 * moved, (diff, moved)


def test_the_settings_given_on_the_command_line_are_the_ones_that_ran(runs):
    grads = [g for line in open(runs / "clipped_spsa" / "mesh" / "trajectory.jsonl") for g in json.loads(line)["grads"]]
    assert grads and max(abs(g) for g in grads) <= 0.05 and any(abs(g) == 0.05 for g in grads)  # clipped
    log = (runs / "signum" / "mesh" / "train.log").read_text()
    assert "optimizer signum (beta 0.5)" in log
    summary = json.loads((runs / "signum" / "mesh" / "summary.json").read_text())
    assert summary["optimizer"] == "signum" and summary["optimizer_state_bytes"] > 0


def test_the_plugins_train_under_zotrainer_with_their_settings_as_zoarguments(tmp_path):
    """DISTZO_PLUGINS names them before distzo.hf is imported, so ZOArguments has `clip` and
    `optim_beta` fields; the Trainer's run uses them."""
    from distzo.models.loading import load_tokenizer, random_model

    folder = tmp_path / "tiny"
    tokenizer = load_tokenizer("smollm2")
    random_model("llama", len(tokenizer), {}, 0, torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT / "examples")!r})
        from hf_trainer import build
        trainer = build({str(folder)!r}, {str(tmp_path / "out")!r}, 4, None, estimator="clipped_spsa", clip=0.05,
                        optimizer="signum", optim_beta=0.5)
        result = trainer.train()
        cfg = trainer.zo_config(4)
        print(json.dumps({{"clip": cfg.estimator.clip, "beta": cfg.optim.beta, "loss": result.training_loss}}))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={**ENV, **PLUGINS})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["clip"] == 0.05 and got["beta"] == 0.5 and got["loss"] > 0


COMMAND = '''
from distzo.cli.commands import Command
from distzo.registry import register


@register("command", "hello")
class Hello(Command):
    """greet"""

    @classmethod
    def run(cls, args):
        print("hello", *args)
'''

KIND = '''
from distzo.data.kinds import Classification
from distzo.registry import register


@register("task_kind", "polar")
class Polar(Classification):
    @classmethod
    def describe(cls, task):
        words, loss = super().describe(task)
        return words + ", as the polar kind", loss
'''


def test_a_command_and_a_task_kind_of_your_own_are_one_file_each(tmp_path):
    (tmp_path / "hello_command.py").write_text(COMMAND)
    (tmp_path / "polar_kind.py").write_text(KIND)
    env = {"DISTZO_PLUGINS": f"{tmp_path / 'hello_command.py'},{tmp_path / 'polar_kind.py'}"}
    r = run_forked(1, ["hello", "world"], cwd=tmp_path, timeout=300, env=env)
    assert r.returncode == 0 and "hello world" in r.stdout, r.stderr[-2000:]
    r = run_forked(1, ["--help"], cwd=tmp_path, timeout=300, env=env)
    assert "hello     greet" in r.stdout
    run = ["train", "model=tiny", "task=synthetic-cue", "task.kind=polar", "steps=2", "eval_every=0",
           "task.val_size=16", "task.test_size=16", "checkpoint.every=0", f"hydra.run.dir={tmp_path / 'run'}"]
    r = run_forked(1, run, cwd=tmp_path, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "as the polar kind" in (tmp_path / "run" / "train.log").read_text()
    r = run_forked(1, ["train", "model=tiny", "task.kind=polar"], cwd=tmp_path, timeout=300)  # without the plugin
    assert r.returncode == 2 and "task.kind=polar is not a task kind" in r.stderr
