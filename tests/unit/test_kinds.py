"""Task kinds as objects (distzo.data.kinds): every `task.kind` value has its class, nothing outside
that module decides by comparing a kind's name, and each kind's decisions read from its class
(objectives it refuses, settings only it reads, teacher forcing, evaluation)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from distzo.data.checks import check_task_config
from distzo.data.kinds import Classification, Generation, MultipleChoice, kind_type
from distzo.errors import ConfigError
from distzo.registry import registry
from tests.conftest import make_config

PACKAGE = Path(__file__).resolve().parents[2] / "distzo"


KINDS = {"classification": Classification, "multiple_choice": MultipleChoice, "generation": Generation}


def test_every_task_kind_is_registered_by_its_name():
    assert dict(registry("task_kind").items()) == KINDS
    assert all(kind_type(name) is cls for name, cls in KINDS.items())
    with pytest.raises(ConfigError, match="is not a task kind; use one of: classification, multiple_choice"):
        kind_type("regression")


# The one module of the package that knows the names of earlier layouts' components.
LEGACY = PACKAGE / "config" / "legacy.py"


@pytest.mark.parametrize("point", ["task_kind", "estimator", "optimizer"])
def test_no_module_compares_a_component_name_outside_its_own(point):
    """The behaviour of a kind, an estimator or an optimizer lives in its class and its properties: no
    `== "generation"` or `est.name == "prge"` (or `!=`, `in (...)` over the names) in the package's
    other modules."""
    names = set(registry(point).names())
    homes = {Path(__import__(cls.__module__, fromlist=["_"]).__file__) for _, cls in registry(point).items()}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in homes or path == LEGACY:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                consts = [c for c in [node.left, *node.comparators] for c in ast.walk(c)
                          if isinstance(c, ast.Constant) and c.value in names]
                if consts:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, f"{point} names compared outside their own modules:\n" + "\n".join(found)


@pytest.mark.parametrize("overrides,objective,message", [
    (("task=sst2",), "f1", "objective=f1 scores generated answers; task sst2 is classification"),
    (("task=copa",), "exact_match", "objective=exact_match scores generated answers; task copa is multiple_choice"),
    (("task=custom", "task.kind=generation", "task.path=."), "accuracy",
     "objective=accuracy compares candidates; task custom generates answers"),
    (("task=sst2", "task.messages_field=messages"), "loss", "task.messages_field .* is read by task.kind=generation"),
    (("task=sst2", "task.candidates_field=options"), "loss", "are read by task.kind=multiple_choice only"),
])
def test_each_kind_refuses_what_it_cannot_train_on(overrides, objective, message):
    with pytest.raises(ConfigError, match=message):
        check_task_config(make_config(*overrides).task, objective)


def test_what_a_kind_decides():
    assert KINDS["classification"].teacher_forcing("teacher_forcing", "loss")
    assert not KINDS["multiple_choice"].teacher_forcing("classification", "loss")
    assert not KINDS["classification"].teacher_forcing("teacher_forcing", "accuracy")
    assert Generation.teacher_forcing("classification", "loss")  # a completion's tokens, whatever task.loss says
    assert not Generation.scores_candidates and KINDS["classification"].scores_candidates
