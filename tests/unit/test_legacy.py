"""Runs written before the settings moved beside their components still work: the resume
fingerprints of today's configurations equal those distzo computed before (recorded at a69fb26, the
last commit of the earlier layout), command lines in the earlier spelling compose to the same
configuration, and a run directory's saved configuration of that layout is read in today's."""

from __future__ import annotations

import pytest
import yaml

from distzo.config.compose import compose_config, saved_config, typed
from distzo.config.legacy import DEFAULT_CHOICES
from distzo.parallel.mesh import Mesh
from distzo.state.resume import ResumeError, check_identity, config_fingerprint, run_identity
from distzo.zo.directions import DIRECTIONS_VERSION

# config_fingerprint(compose_config(overrides)) as a69fb26 computed it.
RECORDED = {
    "": "b2b1e3f36e13a274",
    "model=tiny task=synthetic-cue": "429c015dce476278",
    "estimator=agzo": "c10ee3d497af54ea",
    "estimator=agzo estimator.agzo.rank=2 estimator.agzo.power_iters=1": "6f3575d48b449a3d",
    "estimator=prge peft=lora_fa": "859ad001c66d768f",
    "estimator=prge peft=lora_fa estimator.prge.materialize=false estimator.q=2": "3c60a69c64ae6f39",
    "optim.name=momentum": "2350623d9f163b03",
    "optim.name=momentum optim.momentum.mu=0.5": "b09e0c1541fc992c",
    "optim.name=adam optim.adam.beta2=0.99 optim.lr=1e-4": "4ac262eca71d14d6",
    "optim.name=sign": "c4ef1b47f0ff5638",
    "optim.name=fzoo estimator.difference=forward estimator.q=4": "c6ad39a910c6a687",
    "estimator.distribution=rademacher estimator.eps=1e-2 optim.schedule=linear steps=50": "8515fe07833813f7",
    # device=cpu: engine.quantized_matmul=auto multiplies as torchao's linears there, as a69fb26 did everywhere
    "peft=lora model.quantize=int8 engine.compute=bf16 device=cpu": "23932e39da9cd325",
    "task=sst2 batch_size=8 objective=accuracy": "25ebdf6dddf43579",
}
TODAY = {  # the same configurations in today's spelling
    "estimator=agzo estimator.agzo.rank=2 estimator.agzo.power_iters=1": "estimator=agzo estimator.rank=2 "
                                                                         "estimator.power_iters=1",
    "estimator=prge peft=lora_fa estimator.prge.materialize=false estimator.q=2": "estimator=prge peft=lora_fa "
                                                                                  "estimator.materialize=false "
                                                                                  "estimator.q=2",
    "optim.name=momentum optim.momentum.mu=0.5": "optim=momentum optim.mu=0.5",
    "optim.name=adam optim.adam.beta2=0.99 optim.lr=1e-4": "optim=adam optim.beta2=0.99 optim.lr=1e-4",
}


@pytest.mark.parametrize("overrides", list(RECORDED))
def test_the_fingerprint_of_a_configuration_is_the_one_recorded_before(overrides):
    assert config_fingerprint(typed(compose_config(overrides.split()))) == RECORDED[overrides]
    today = TODAY.get(overrides)
    if today is not None:
        assert config_fingerprint(typed(compose_config(today.split()))) == RECORDED[overrides]


def test_the_default_choices_are_config_yaml_s():
    from pathlib import Path

    conf = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "config.yaml").read_text())
    defaults = {k: v for entry in conf["defaults"] if isinstance(entry, dict) for k, v in entry.items()}
    assert {group: defaults[group] for group in DEFAULT_CHOICES} == DEFAULT_CHOICES


# A run directory's .hydra/config.yaml of the earlier layout (the sections that changed).
SAVED = """
estimator: {name: agzo, eps: 0.0001, q: 2, difference: forward, distribution: gaussian,
            prge: {materialize: true}, agzo: {rank: 3, power_iters: 1, tied_embeddings: dense}}
optim: {name: adam, lr: 0.001, weight_decay: 0.0, schedule: constant, warmup_steps: 0,
        momentum: {mu: 0.9}, adam: {beta1: 0.8, beta2: 0.99, eps: 1.0e-08}}
steps: 7
"""
OLDER = """
optim: {lr: 0.001, weight_decay: 0.0, schedule: constant, warmup_steps: 0, beta1: 0.8, beta2: 0.99, adam_eps: 1.0e-07}
"""


def saved(sections: str) -> dict:
    """A whole saved configuration: today's defaults with the earlier layout's sections."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(compose_config([]), enum_to_str=True)
    data.update(yaml.safe_load(sections))
    return data


def test_a_saved_configuration_of_the_earlier_layouts_reads_in_today_s():
    from distzo.zo.estimators import AGZO
    from distzo.zo.optimizers import SGD, Adam

    cfg = typed(saved_config(saved(SAVED)))
    assert type(cfg.estimator) is AGZO.Settings and (cfg.estimator.rank, cfg.estimator.power_iters) == (3, 1)
    assert str(cfg.estimator.tied_embeddings) == "dense" and cfg.estimator.q == 2
    assert type(cfg.optim) is Adam.Settings and (cfg.optim.beta1, cfg.optim.beta2, cfg.optim.lr) == (0.8, 0.99, 1e-3)
    assert cfg.steps == 7
    older = typed(saved_config(saved(OLDER)))  # before optimizers had names: sgd
    assert type(older.optim) is SGD.Settings and older.optim.lr == 1e-3


def test_the_earlier_spelling_composes_to_today_s_configuration():
    old = typed(compose_config(["estimator=agzo", "estimator.agzo.rank=2", "optim.name=adam", "optim.adam.beta2=0.9",
                                "optim.momentum.mu=0.5"]))
    new = typed(compose_config(["estimator=agzo", "estimator.rank=2", "optim=adam", "optim.beta2=0.9"]))
    assert old == new


def _cfg(overrides: str):
    return typed(compose_config(overrides.split()))


def test_a_run_that_records_its_fingerprint_keys_is_refused_naming_what_differs():
    written = run_identity(_cfg("model=tiny optim=adam optim.beta2=0.99"), 0, Mesh.single("cpu"))
    assert check_identity(_cfg("model=tiny optim=adam optim.beta2=0.99"), "run", written) == 0
    with pytest.raises(ResumeError) as err:
        check_identity(_cfg("model=tiny optim.lr=0.5 batch_size=4"), "run", written)
    assert str(err.value) == (
        "cannot resume from run: it was written with another configuration (batch_size: 16 there, 4 here; "
        "optim.adam.beta1: 0.9 there, the default here; optim.adam.beta2: 0.99 there, the default here; "
        "optim.adam.eps: 1e-08 there, the default here; optim.lr: 2e-05 there, 0.5 here; "
        "optim.name: \"adam\" there, the default here); run with the settings it was written with, or use "
        "another hydra.run.dir to start afresh")


def test_a_run_written_before_the_keys_were_recorded_is_refused_with_the_general_message():
    written = {"seed": 0, "directions_version": DIRECTIONS_VERSION,  # run.json of before: no fingerprint_keys
               "config_fingerprint": config_fingerprint(_cfg("model=tiny"))}
    assert check_identity(_cfg("model=tiny"), "run", written) == 0
    with pytest.raises(ResumeError, match="it was written with a different model, task, estimator"):
        check_identity(_cfg("model=tiny optim.lr=0.5"), "run", written)


def test_a_run_that_recorded_a_relative_data_path_resumes_with_it_made_absolute(tmp_path, monkeypatch):
    """Runs started before the command line made paths absolute recorded task.path as typed; the
    same command from the same directory now gives the absolute path of the same file, which resumes.
    Another file does not."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reviews.jsonl").write_text("{}\n")
    (tmp_path / "other.jsonl").write_text("{}\n")
    written = run_identity(_cfg("model=tiny task=custom task.path=reviews.jsonl"), 0, Mesh.single("cpu"))
    here = _cfg(f"model=tiny task=custom task.path={tmp_path / 'reviews.jsonl'}")
    assert config_fingerprint(here) != written["config_fingerprint"] and check_identity(here, "run", written) == 0
    with pytest.raises(ResumeError, match="task.path: \"reviews.jsonl\" there"):
        check_identity(_cfg(f"model=tiny task=custom task.path={tmp_path / 'other.jsonl'}"), "run", written)
