"""The configuration schema and the packaged config.yaml agree, and validation covers every number."""

from __future__ import annotations

import dataclasses
import math
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from distzo.config.checks import check_numbers
from distzo.config.compose import compose_config, typed
from distzo.config.schema import Choice, Config
from distzo.errors import ConfigError

CONF = Path(__file__).resolve().parents[2] / "distzo" / "config" / "presets" / "config.yaml"


def _leaves(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_config_yaml_and_the_dataclasses_agree_on_every_default():
    written = {k: v for k, v in _leaves(yaml.safe_load(CONF.read_text()))
               if k != "defaults" and not k.startswith("hydra")}
    schema = OmegaConf.to_container(OmegaConf.structured(Config), resolve=False)
    for key, value in written.items():
        default = OmegaConf.select(OmegaConf.create(schema), key)
        default = default.value if isinstance(default, Choice) else default
        assert default == value, f"{key}: conf/config.yaml says {value!r}, distzo/config/schema.py {default!r}"


def _numeric_fields(cls, prefix=""):
    """(dotted key, field) of every int or float field of a schema dataclass, nested ones included."""
    for f in dataclasses.fields(cls):
        nested = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(nested):
            yield from _numeric_fields(type(nested), f"{prefix}{f.name}.")
        elif str(f.type) in ("int", "float", "Optional[int]", "Optional[float]"):
            yield f"{prefix}{f.name}", f


def _every_settings_class():
    """(prefix, dataclass) of the schema's sections and of every registered estimator's and optimizer's settings."""
    from distzo.config import schema
    from distzo.registry import registry

    yield "", Config
    for name, cls in [("model", schema.ModelConfig), ("task", schema.TaskConfig), ("peft", schema.PeftConfig),
                      ("offload", schema.OffloadConfig), ("logger", schema.LoggerConfig)]:
        yield f"{name}.", cls
    for point, group in (("estimator", "estimator"), ("optimizer", "optim")):
        for name, _ in registry(point).items():
            yield f"{group}[{name}].", registry(point).settings(name)


def test_every_number_of_the_schema_and_of_every_component_has_a_range():
    numeric = {key: f for prefix, cls in _every_settings_class() for key, f in _numeric_fields(cls, prefix)}
    assert {"steps", "optim[sgd].lr", "estimator[agzo].rank", "optim[adam].beta2", "checkpoint.keep",
            "task.val_size"} <= set(numeric)  # it looks deep
    missing = sorted(key for key, f in numeric.items() if "range" not in f.metadata)
    assert not missing, missing


@pytest.mark.parametrize(("overrides", "line"), [
    (["estimator=agzo", "estimator.rank=0"], "estimator.rank=0 is out of range; it must be >= 1"),
    (["optim=adam", "optim.beta2=1"], "optim.beta2=1.0 is out of range; it must be >= 0 and < 1"),
    (["seed=-1"], "seed=-1 is out of range; use 0 <= seed < 2**63, or seed=null to draw one"),
    (["checkpoint.keep=0"], "checkpoint.keep=0 is out of range; it must be > 0"),
])
def test_a_range_in_field_metadata_is_checked(overrides, line):
    with pytest.raises(ConfigError) as exc:
        check_numbers(typed(compose_config(overrides)))
    assert str(exc.value) == line


@pytest.mark.parametrize("key", ["estimator.eps", "optim.lr", "optim.weight_decay", "peft.alpha", "dist_timeout_s",
                                 "sweep.progress_every_s"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_numbers_are_refused(key, value):
    cfg = typed(compose_config([f"{key}={value}"]))
    with pytest.raises(ConfigError, match=f"^{key}=.* is not a finite number"):
        check_numbers(cfg)


def test_the_layers_below_the_run_receive_the_schema_dataclasses(monkeypatch):
    """The configuration is converted once, at the public entry point (distzo.config.compose.typed):
    the model loader, the task, the estimator, the optimizer, PEFT and the engine receive the schema's
    dataclass sections (a component's own settings class), their choices as Enums."""
    from distzo.config import schema
    from distzo.parallel.mesh import Mesh
    from distzo.run import components
    from distzo.zo.optimizers import Adam
    from tests.conftest import make_config

    seen = {}

    def spy(name, label, pick):
        real = getattr(components, name)

        def call(*args, **kwargs):
            seen[label] = pick(args, kwargs)
            return real(*args, **kwargs)
        monkeypatch.setattr(components, name, call)

    spy("load_model", "model", lambda a, k: a[0])
    spy("PromptTask", "task", lambda a, k: a[0])
    spy("build_estimator", "estimator", lambda a, k: a[0])
    spy("build_optimizer", "optim", lambda a, k: a[0])
    spy("apply_peft", "peft", lambda a, k: a[1])
    spy("build_engine", "engine", lambda a, k: (a[0].engine, a[0].offload))
    cfg = make_config("model=tiny", "task=synthetic-cue", "optim.name=adam", "peft=lora")
    assert isinstance(cfg, Config)
    c = components.build_components(cfg, Mesh.single(), 0)
    c.close()
    assert isinstance(seen["model"], schema.ModelConfig) and isinstance(seen["task"], schema.TaskConfig)
    assert isinstance(seen["estimator"], schema.EstimatorSettings) and type(seen["optim"]) is Adam.Settings
    assert isinstance(seen["peft"], schema.PeftConfig)
    assert isinstance(seen["engine"][0], schema.EngineConfig) and isinstance(seen["engine"][1], schema.OffloadConfig)
    assert isinstance(seen["estimator"].difference, schema.Difference) and seen["optim"].beta2 == 0.999
    assert typed(typed(cfg)) is typed(cfg)


def test_typing_a_composition_section_by_section_equals_converting_it_whole():
    """typed() converts a composition one section at a time (the fast path); OmegaConf's conversion of
    the whole root (without the `hydra` key, merged into a fresh schema) is the reference: equal
    dataclasses with the same types, field by field, for every registered estimator and optimizer
    (each its own settings class), presets of every group, with and without the `hydra` section."""
    from distzo.registry import registry

    sets = [[f"estimator={name}"] for name, _ in registry("estimator").items()]
    sets += [[f"optim={name}"] for name, _ in registry("optimizer").items()]
    sets += [["model=tiny", "peft=lora", "estimator=prge", "optim=adam", "seed=null", "micro_batch_size=4",
              "keep_best=accuracy", "mesh=2x2", "device=cpu", "engine.compute=bf16", "offload=cpu"],
             ["model=tiny-opt", "+model.arch_config.max_position_embeddings=2048", "task=lm-2048", "peft=prefix",
              "logger=wandb", "task.kind=lm"]]
    for i, overrides in enumerate(sets):
        with_hydra = i % 2 == 0
        cfg = compose_config(overrides, with_hydra=with_hydra)
        root = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if with_hydra else cfg
        reference = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), root))
        fast = typed(cfg)
        assert fast == reference, overrides
        assert [type(getattr(fast, f)) for f in vars(fast)] == [type(getattr(reference, f)) for f in vars(fast)]


def _cfg_parameters(path: Path):
    """(function, annotation text or None) of every parameter named cfg in a module."""
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.args + node.args.kwonlyargs:
                if arg.arg == "cfg":
                    yield node.name, ast.unparse(arg.annotation) if arg.annotation is not None else None


def test_a_random_architecture_is_built_once_per_process_and_a_bad_one_refused_every_time(monkeypatch):
    """check_model_config builds a random architecture on the meta device; a command checks its
    configuration up to three times, so a build that succeeded is remembered for the same settings
    (other settings, another dtype: built again), and one that failed is refused again."""
    from distzo.models import checks

    builds = []
    real = checks.random_model

    def counted(arch, *args, **kwargs):
        builds.append((arch, args[1]))
        return real(arch, *args, **kwargs)

    monkeypatch.setattr(checks, "random_model", counted)
    monkeypatch.setattr(checks, "_built", set())
    tiny = typed(compose_config(["model=tiny"])).model
    for _ in range(3):
        checks.check_model_config(tiny)
    assert len(builds) == 1
    wider = dataclasses.replace(tiny, arch_config={**tiny.arch_config, "intermediate_size": 96})
    checks.check_model_config(wider)
    checks.check_model_config(dataclasses.replace(tiny, dtype="bfloat16"))
    assert len(builds) == 3
    bad = dataclasses.replace(tiny, arch_config={**tiny.arch_config, "hidden_size": -8})
    for _ in range(2):
        with pytest.raises(ConfigError, match="does not make a valid llama model"):
            checks.check_model_config(bad)
    assert len(builds) == 5


def test_the_run_state_and_telemetry_layers_take_a_typed_configuration():
    """No `cfg` without a type or typed Any below the public entry points; those (train, Trainer,
    evaluate, bench) may take a DictConfig and say so, and convert it once."""
    package = Path(__file__).resolve().parents[2] / "distzo"
    found = []
    for layer in ("run", "state", "telemetry"):
        for path in sorted((package / layer).rglob("*.py")):
            for function, annotation in _cfg_parameters(path):
                found.append((path.relative_to(package).as_posix(), function, annotation))
    assert len(found) > 20
    untyped = [f for f in found if f[2] is None or "Any" in f[2]]
    assert not untyped, untyped
    entry = {(f[0], f[1]) for f in found if "DictConfig" in f[2]}
    assert entry <= {("run/training.py", "__init__"), ("run/training.py", "train"), ("run/evaluation.py", "evaluate"),
                     ("run/bench.py", "bench"), ("run/evaluation.py", "evaluation_config"),
                     ("run/checks.py", "validate"),
                     # the local launch reads the composed run directory from Hydra's section
                     ("run/launcher.py", "run_local_workers"), ("run/launcher.py", "resolved_run_dir")}, entry


def test_a_training_run_converts_its_configuration_once(monkeypatch, tmp_path):
    """A composed configuration becomes the schema's Config once, at the entry point: every
    conversion builds one Config (typed's, or OmegaConf.to_object's of a whole root), counted here."""
    import sys

    import distzo
    from tests.conftest import TINY

    cfg = distzo.compose(*TINY, "steps=2", "checkpoint.every=0", "save_final=false")
    assert not isinstance(cfg, Config)
    calls, real = [], Config.__init__

    def init(self, *args, **kwargs):
        calls.append(sys._getframe(1).f_globals.get("__name__", ""))
        real(self, *args, **kwargs)

    monkeypatch.setattr(Config, "__init__", init)
    distzo.train(cfg, tmp_path / "run")
    assert calls == ["distzo.config.compose"]


@contextmanager
def logging_as_it_was():
    """Every logger's handlers, level, propagation and disabling restored afterwards (handlers added
    meanwhile closed): for a command run in the test process, whose Hydra application configures
    logging as it would for a process of its own."""
    import logging

    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)]
    saved = {lg: (lg.handlers[:], lg.level, lg.propagate, lg.disabled) for lg in loggers}
    try:
        yield
    finally:
        for lg in [logging.getLogger()] + [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]:
            handlers, level, propagate, disabled = saved.get(lg, ([], logging.NOTSET, True, False))
            for h in lg.handlers[:]:
                if h not in handlers:
                    lg.removeHandler(h)
                    h.close()
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled


def test_a_command_composes_its_configuration_once(monkeypatch, tmp_path):
    """The command line checks the configuration before deciding whether to start workers, and
    Hydra's application checks it again: the second is a copy of the first (composed_once), equal
    and not shared. Outside a command, every call composes."""
    import hydra

    from distzo.cli.main import main
    from distzo.config.compose import composed_once
    from tests.conftest import TINY

    composed, real = [], hydra.compose
    monkeypatch.setattr(hydra, "compose", lambda *a, **k: composed.append(k["overrides"]) or real(*a, **k))
    with logging_as_it_was():  # Hydra's application configures logging (and sys.argv) for the process
        monkeypatch.setattr(sys, "argv", list(sys.argv))
        main(["train", *TINY, "steps=1", "eval_every=0", "save_final=false", f"hydra.run.dir={tmp_path / 'run'}"])
    assert len(composed) == 1 and (tmp_path / "run" / "summary.json").is_file()
    with composed_once():
        first, again, other = (compose_config(o) for o in (["steps=3"], ["steps=3"], ["steps=4"]))
    assert len(composed) == 3 and first == again and first is not again and other.steps == 4
    again.steps = 5
    assert first.steps == 3 and compose_config(["steps=3"]).steps == 3 and len(composed) == 4


def test_a_damaged_saved_configuration_says_so_and_not_that_distzo_changed(tmp_path):
    """eval.run and replay read a run's .hydra/config.yaml: a file cut short or overwritten is named as
    damaged (copy the run again), not as written by another distzo version; one that lacks sections
    (valid YAML, cut at a line) is named so, not left to fail where a section is first read."""
    from distzo.state.saved import CONFIG_FILE, RunFilesError, load_run_config

    (tmp_path / CONFIG_FILE).parent.mkdir(parents=True)
    for text, message in [("model: {name: tiny\ntask: [", r"is not readable YAML \(.*\); copy the run directory"),
                          ("- a\n- b\n", r"holds no configuration \(a YAML list\); copy the run directory"),
                          ("steps: 3\n", r"lacks estimator, logger, model, offload, optim, peft, task, which every "
                                         r"run's saved configuration holds: the file was cut short or overwritten "
                                         r"\(copy the run directory again")]:
        (tmp_path / CONFIG_FILE).write_text(text)
        with pytest.raises(RunFilesError, match=message):
            load_run_config(tmp_path, key="eval.run")


def test_escaped_newlines_and_tabs_in_prompt_texts_are_the_characters(tokenizer, tmp_path):
    """On a command line `"task.template='Q: {question}\\nA:'"` reaches Hydra as a backslash and an n
    (its quoted strings keep them); the prompt texts (template, candidate and completion templates,
    stop, demo separator, label words) take `\\n` and `\\t` as a newline and a tab, and a prompt
    built from the template has the newline. Typing the typed configuration again changes nothing."""
    import json

    from distzo.config.compose import saved_form
    from distzo.data.tasks import PromptTask

    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answers": [f"a{i}"]}) + "\n" for i in range(8)))
    cfg = typed(compose_config(["model=tiny", "task=custom", "task.kind=generation", f"task.path={path}",
                                "task.template='Q: {question}\\nA:'", "task.stop='\\n'",
                                "task.demo_separator='\\n\\t'", "task.completion_template=' {answer}\\t'",
                                "task.val_size=2", "task.test_size=2"]))
    t = cfg.task
    assert (t.template, t.stop, t.demo_separator, t.completion_template) == ("Q: {question}\nA:", "\n", "\n\t",
                                                                             " {answer}\t")
    assert typed(saved_form(cfg)).task == t
    task = PromptTask(t, tokenizer, "loss")
    prompt = tokenizer.decode(task._prompts["train"][0])
    assert "\n" in prompt and "\\" not in prompt


def test_relative_paths_on_the_command_line_become_absolute_where_they_exist(tmp_path):
    """As Hydra's to_absolute_path: a relative file or folder that exists from here names the same
    one under hydra.job.chdir=true and in the saved configuration; hub ids, the tokenizer preset's
    name, sweeps' lists, other settings and absolute paths stay as written; a path with characters
    of Hydra's grammar comes back quoted."""
    from distzo.config.compose import absolute_path_overrides

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "reviews.jsonl").write_text("{}\n")
    (tmp_path / "my model").mkdir()
    (tmp_path / "smollm2").mkdir()
    given = ["task.path=data/reviews.jsonl", "task.path='data/reviews.jsonl'", "model.path=acme/tiny",
             "+model.tokenizer=./smollm2", "model.tokenizer=smollm2", "task.path=data/reviews.jsonl,other.jsonl",
             "model.path=my model", "task.template=data/reviews.jsonl", f"eval.run={tmp_path}/data", "eval.run=gone"]
    assert absolute_path_overrides(given, str(tmp_path)) == [
        f"task.path={tmp_path}/data/reviews.jsonl", f"task.path={tmp_path}/data/reviews.jsonl", "model.path=acme/tiny",
        f"+model.tokenizer={tmp_path}/smollm2", "model.tokenizer=smollm2", "task.path=data/reviews.jsonl,other.jsonl",
        f"model.path='{tmp_path}/my model'", "task.template=data/reviews.jsonl", f"eval.run={tmp_path}/data",
        "eval.run=gone"]
