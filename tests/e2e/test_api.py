"""The public Python API (`import distzo`) against the command line: training, evaluation and saving
driven through the API give bitwise the weights of the CLI run of the same configuration, in one
process and on a 2x2 mesh launched by torchrun; callbacks see every step, evaluation and snapshot;
your own model and task; your own config directory; mistakes as one-line ConfigErrors."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import distzo
from distzo.config.compose import config_dir
from tests.distributed.launch import run_forked, torchrun_script

BASE = ["model=tiny", "task=synthetic-cue", "eval_every=0", "task.val_size=16", "task.test_size=16", "optim.lr=1e-3",
        "seed=3"]
TINY = [*BASE, "steps=4", "checkpoint.every=2"]


def assert_same_weights(a: Path, b: Path) -> None:
    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys() and x
    for k in x:
        assert torch.equal(x[k], y[k]), k


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("api-cli")
    r = run_forked(1, ["train", *TINY, f"hydra.run.dir={root / 'run'}"], cwd=root, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return root / "run"


class Recorder(distzo.Callback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, trainer):
        self.events.append(("begin", trainer.step_count))

    def on_step_end(self, trainer, record):
        self.events.append(("step", record.step))

    def on_evaluate(self, trainer, split, result):
        self.events.append(("eval", split, trainer.step_count))

    def on_snapshot(self, trainer, step, path):
        self.events.append(("snapshot", step, path is not None and path.is_dir()))

    def on_train_end(self, trainer, summary):
        self.events.append(("end", summary.steps))


def test_fit_through_the_api_is_the_cli_run(cli_run, tmp_path):
    cfg = distzo.compose(*TINY)
    recorder = Recorder()
    summary = distzo.train(cfg, run_dir=tmp_path / "api", callbacks=[recorder])
    assert_same_weights(cli_run / "final" / "model.safetensors", tmp_path / "api" / "final" / "model.safetensors")
    cli_summary = json.loads((cli_run / "summary.json").read_text())
    assert summary.test_accuracy == cli_summary["test_accuracy"] and summary["seed"] == 3
    assert recorder.events == [("eval", "validation", 0), ("begin", 0), ("step", 1), ("step", 2),
                               ("snapshot", 2, True), ("step", 3), ("step", 4), ("snapshot", 4, True),
                               ("eval", "validation", 4), ("eval", "test", 4), ("end", 4)]
    # the same files as a command-line run: a later `eval eval.run=` or `replay` reads them
    for name in ("metrics.jsonl", "trajectory.jsonl", "run.json", "summary.json", "train.log", ".hydra/config.yaml",
                 "checkpoints/step-00000004"):
        assert (tmp_path / "api" / name).exists(), name


def test_step_evaluate_save_by_hand_is_the_cli_run(cli_run, tmp_path):
    """Driving the loop yourself: the same updates, so the same weights."""
    cfg = distzo.compose(*TINY)
    with distzo.Trainer(cfg, run_dir=tmp_path / "by-hand") as trainer:
        records = [trainer.step() for _ in range(cfg.steps)]
        result = trainer.evaluate("test")
        path = trainer.save(tmp_path / "exported")
    assert [r.step for r in records] == [1, 2, 3, 4] and not any(r.skipped for r in records)
    logged = [m["projected_grads"] for m in distzo_metrics(cli_run) if m["type"] == "train"]
    assert [list(r.projected_grads) for r in records] == logged
    assert result["accuracy"] == json.loads((cli_run / "summary.json").read_text())["test_accuracy"]
    assert path == tmp_path / "exported"  # the folder from_pretrained takes
    assert_same_weights(cli_run / "final" / "model.safetensors", path / "model.safetensors")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(loaded.model.norm.weight, load_file(str(path / "model.safetensors"))["model.norm.weight"])


def distzo_metrics(run: Path) -> list[dict]:
    from distzo.telemetry.jsonl import read_jsonl

    return list(read_jsonl(run / "metrics.jsonl"))


def test_your_own_model_tokenizer_and_task(cli_run, tmp_path):
    """A transformers model you built and a task from records in memory: model=tiny is a seeded
    random Llama, so building the same one yourself trains to the same weights."""
    from distzo.data.tasks import PromptTask
    from distzo.models.loading import load_tokenizer, random_model

    cfg = distzo.compose(*TINY)
    tokenizer = load_tokenizer("smollm2")
    model = random_model("llama", len(tokenizer), {}, 0, torch.float32)
    task = distzo.PromptTask(cfg.task, tokenizer)
    assert isinstance(task, PromptTask)
    with distzo.Trainer(cfg, run_dir=tmp_path / "own", model=model, tokenizer=tokenizer, task=task) as trainer:
        assert trainer.model is model
        for _ in range(cfg.steps):
            trainer.step()
        path = trainer.save()
    assert path == tmp_path / "own" / "final"
    assert_same_weights(cli_run / "final" / "model.safetensors", path / "model.safetensors")


def test_evaluate_a_run_as_the_cli_does(cli_run, tmp_path):
    result = distzo.evaluate(run=cli_run, run_dir=tmp_path / "eval")
    assert result["split"] == "test" and result["examples"] == 16
    assert result["accuracy"] == json.loads((cli_run / "summary.json").read_text())["test_accuracy"]
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["accuracy"] == result["accuracy"]
    for swap in ("model=tiny-opt", "model.path=/elsewhere"):  # another model scored under the run's name: refused
        with pytest.raises(distzo.ConfigError, match=rf"evaluates the run's trained weights .*, and "
                                                     rf"{swap.split('=')[0]}= on the command line would score "
                                                     "another model in their place"):
            distzo.evaluate(run=cli_run, run_dir=tmp_path / swap, overrides=[swap])
        assert not (tmp_path / swap).exists()


def test_replay_through_the_api(cli_run, tmp_path):
    """The weights after the last step, bitwise; an --out that exists is replaced only when asked,
    one inside the run's final/ or checkpoints/ never, and a device replay cannot draw on is refused,
    each before anything loads."""
    from distzo.run.replay import ReplayError

    out = distzo.replay(cli_run, step=4, out=tmp_path / "step4.safetensors")
    final = load_file(str(cli_run / "final" / "model.safetensors"))
    replayed = load_file(str(out))
    assert replayed and set(replayed) <= set(final)  # the trainable tensors (a tied head is saved once)
    for k in replayed:
        assert torch.equal(replayed[k], final[k]), k
    kept = {path: path.read_bytes() for path in (cli_run / "final" / "model.safetensors", out)}
    for where, message in [(out, r"step4.safetensors exists; name another file, or pass --force"),
                           (tmp_path, "is a directory; name a .safetensors file"),
                           (cli_run / "final" / "model.safetensors", r"inside the run's final/, whose weights"),
                           (cli_run / "checkpoints" / "x.safetensors", r"inside the run's checkpoints/")]:
        with pytest.raises(ReplayError, match=message):
            distzo.replay(cli_run, step=2, out=where)
    assert {path: path.read_bytes() for path in kept} == kept
    assert distzo.replay(cli_run, step=4, out=out, overwrite=True) == out
    with pytest.raises(ReplayError, match=r"no valid snapshot at or before step 1 .*: its earliest snapshot is of "
                                          r"step 2 \(checkpoint.every sets the cadence.*--from-step 0"):
        distzo.replay(cli_run, step=1, out=tmp_path / "step1.safetensors")
    with pytest.raises(ReplayError, match="--device foo: replay draws the directions on cpu or cuda"):
        distzo.replay(cli_run, out=tmp_path / "x.safetensors", device="foo")
    if not torch.cuda.is_available():
        with pytest.raises(ReplayError, match="--device cuda: this machine has no CUDA device"):
            distzo.replay(cli_run, out=tmp_path / "x.safetensors", device="cuda")


def test_compose_sets_values_by_key_and_refuses_mistakes_in_one_line():
    cfg = distzo.compose("model=tiny", task="synthetic-cue", steps=7, **{"optim.lr": 1e-4, "task.val_size": 8})
    assert (cfg.task.name, cfg.steps, cfg.optim.lr, cfg.task.val_size) == ("synthetic-cue", 7, 1e-4, 8)
    with pytest.raises(distzo.ConfigError, match=r"^unknown config key 'optim.lrr'"):
        distzo.compose("model=tiny", "optim.lrr=1")
    for added in ("+optim.lrr=1", "+lrr=1", "+optm.lr=1"):  # + adds a key the typed configuration would drop
        with pytest.raises(distzo.ConfigError, match=rf"^unknown config key '{added[1:-2]}'.*\(\+ adds keys only"):
            distzo.compose("model=tiny", added)
    with pytest.raises(distzo.ConfigError, match=r"^estimator.rank is a setting of estimator=agzo, .*add estimator="):
        distzo.compose("model=tiny", "+estimator.rank=2")
    assert distzo.compose("model=tiny", "+model.arch_config.rope_theta=5000.0").model.arch_config == {
        "rope_theta": 5000.0}  # an open section
    with pytest.raises(distzo.ConfigError, match=r"^unknown model preset 'gpt5'; available: "):
        distzo.compose(model="gpt5")
    with pytest.raises(distzo.ConfigError, match=r"^sweep.metric=validation_acc_after is not an evaluation figure "
                                                 r"of the run's summary; use one of: validation_accuracy_after, "):
        distzo.compose("model=tiny", "sweep.metric=validation_acc_after")  # refused before training, not after
    with pytest.raises(distzo.ConfigError, match=r"^optim.warmup_steps=50 is longer than the run \(steps=10\)"):
        distzo.compose("model=tiny", "steps=10", "optim.warmup_steps=50")
    with pytest.raises(distzo.ConfigError, match=r"^save_final=maybe: expected true or false$"):
        distzo.compose("model=tiny", "save_final=maybe")
    with pytest.raises(distzo.ConfigError, match=r"^steps=-1 is out of range"):
        distzo.compose("model=tiny", steps=-1)
    with pytest.raises(distzo.ConfigError, match=r"quote the value: \"task.template='\{text\} It was'\""):
        distzo.compose("task.template={text} It was")


def test_your_own_config_directory(tmp_path):
    """A team's presets outside the tree: by argument, by $DISTZO_CONFIG_PATH, on the command line."""
    (tmp_path / "presets" / "task").mkdir(parents=True)
    (tmp_path / "presets" / "task" / "cue16.yaml").write_text(
        "name: cue16\ndataset: synthetic-cue\nval_size: 16\ntest_size: 16\n")
    cfg = distzo.compose("model=tiny", "task=cue16", config_dirs=[tmp_path / "presets"])
    assert (cfg.task.name, cfg.task.val_size) == ("cue16", 16)
    (tmp_path / "presets" / "experiment").mkdir()  # a group of its own, appended with +, merged at the top
    (tmp_path / "presets" / "experiment" / "short.yaml").write_text("# @package _global_\nsteps: 7\n")
    assert distzo.compose("model=tiny", "+experiment=short", config_dirs=[tmp_path / "presets"]).steps == 7
    with pytest.raises(distzo.ConfigError, match="unknown task preset 'cue16'"):
        distzo.compose("model=tiny", "task=cue16")
    r = run_forked(1, ["train", "model=tiny", "task=cue16", "steps=1", "eval_every=0",
                       f"hydra.run.dir={tmp_path / 'r'}"],
                   cwd=tmp_path, timeout=600, env={"DISTZO_CONFIG_PATH": str(tmp_path / "presets")})
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 1


def test_a_preset_of_yours_with_a_packaged_presets_name_is_refused(tmp_path):
    """Hydra searches distzo's packaged presets before your directories, so a file of yours with a
    packaged preset's path would never be read: refused with the fix, from the API and the CLI, and
    before a run directory is made."""
    (tmp_path / "presets" / "task").mkdir(parents=True)
    mine = (Path(config_dir()) / "task" / "mr-polarity.yaml").read_text().replace("It was", "Seen as")  # changed copy
    (tmp_path / "presets" / "task" / "mr-polarity.yaml").write_text(mine)
    with pytest.raises(distzo.ConfigError, match=r"task/mr-polarity.yaml would never be read: distzo's packaged "
                                                 r"preset task=mr-polarity .* select it with task=mr-polarity-ours"):
        distzo.compose("model=tiny", config_dirs=[tmp_path / "presets"])
    r = run_forked(1, ["train", "model=tiny", f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path, timeout=600,
                   env={"DISTZO_CONFIG_PATH": str(tmp_path / "presets")})
    assert r.returncode != 0 and "select it with task=mr-polarity-ours" in r.stderr and not (tmp_path / "r").exists()
    (tmp_path / "presets" / "task" / "mr-polarity.yaml").rename(tmp_path / "presets" / "task" / "mr-ours.yaml")
    assert distzo.compose("model=tiny", "task=mr-ours", config_dirs=[tmp_path / "presets"]).task.template == \
        "{sentence} Seen as"  # renamed as told, it is read


SCRIPT = textwrap.dedent("""
    import sys
    import distzo

    cfg = distzo.compose(*sys.argv[2:])
    with distzo.Trainer(cfg, run_dir=sys.argv[1]) as trainer:
        for _ in range(cfg.steps):
            trainer.step()
        trainer.evaluate("validation")
        path = trainer.save()
    if trainer.is_main:
        print("saved", path)
""")


def test_the_api_under_torchrun_on_a_2x2_mesh_is_the_cli_run(tmp_path):
    """Every rank runs the same script; the mesh comes from torchrun's environment (the script's ranks
    forked with it, as the CLI's are: torchrun's own agent is tests/cluster's and test_resume's)."""
    overrides = [*TINY, "mesh=2x2"]
    r = run_forked(4, ["train", *overrides, f"hydra.run.dir={tmp_path / 'cli'}"], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    script = tmp_path / "train_api.py"
    script.write_text(SCRIPT)
    r = torchrun_script(4, script, str(tmp_path / "api"), *overrides, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("saved ") == 1  # rank 0 alone writes and reports
    assert_same_weights(tmp_path / "cli" / "final" / "model.safetensors",
                        tmp_path / "api" / "final" / "model.safetensors")


def test_two_runs_in_one_process_leave_nothing_behind(tmp_path):
    """As in a notebook: a second run starts clean (threads, log handlers) and gives the same weights."""
    import logging

    threads = torch.get_num_threads()
    handlers = list(logging.getLogger("distzo").handlers)
    cfg = distzo.compose(*BASE, "steps=2", "checkpoint.every=0")
    distzo.train(cfg, run_dir=tmp_path / "a")
    distzo.train(cfg, run_dir=tmp_path / "b")
    assert_same_weights(tmp_path / "a" / "final" / "model.safetensors", tmp_path / "b" / "final" / "model.safetensors")
    assert logging.getLogger("distzo").handlers == handlers and torch.get_num_threads() == threads


def test_a_callback_ends_fit_early(tmp_path):
    class StopAfterTwo(distzo.Callback):
        def on_step_end(self, trainer, record):
            if record.step == 2:
                trainer.should_stop = True

    summary = distzo.train(distzo.compose(*TINY), run_dir=tmp_path / "early", callbacks=[StopAfterTwo()])
    from distzo.telemetry.jsonl import read_jsonl

    assert summary.steps == 2 and [r["step"] for r in read_jsonl(tmp_path / "early" / "trajectory.jsonl")] == [1, 2]
    assert (tmp_path / "early" / "final" / "model.safetensors").is_file()
