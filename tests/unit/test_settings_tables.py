"""The registry gives the docs their settings tables and ZOArguments its fields: every settings
block of the docs is the table distzo.config.tables generates from the components' `Settings`
(regenerate with `python -m distzo.config.tables docs/*.md`), every built-in estimator and optimizer
has its table in the docs, and ZOArguments has a field for every setting the registry lists."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from distzo.config.tables import blocks, builtin, render, zo_argument_fields

DOCS = sorted((Path(__file__).resolve().parents[2] / "docs").glob("*.md"))
BLOCKS = [(path.name, group, name, table) for path in DOCS for group, name, table in blocks(path.read_text())]


def test_the_docs_hold_settings_tables():
    assert len(BLOCKS) >= 8


@pytest.mark.parametrize("doc,group,name,table", BLOCKS, ids=[f"{b[0]}:{b[1]}={b[2]}" for b in BLOCKS])
def test_each_settings_table_is_the_registry_s(doc, group, name, table):
    assert table == render(group, name), f"{doc}: run python -m distzo.config.tables docs/*.md"


@pytest.mark.parametrize("group", ["estimator", "optim"])
def test_every_built_in_component_has_its_table(group):
    documented = {name for _, g, name, _ in BLOCKS if g == group}
    assert set(builtin(group)) <= documented | {"sign", "fzoo"}  # those two have no settings of their own


def test_zoarguments_has_a_field_for_every_registered_setting():
    from distzo.hf import ZOArguments

    names = {f.name for f in dataclasses.fields(ZOArguments)}
    assert set(zo_argument_fields()) <= names
    assert {"eps", "q", "rank", "materialize", "optim_mu", "optim_beta2", "optim_eps"} <= names
    # the earlier class's names of the optimizers' settings are still read, as their fields now
    from distzo.hf.arguments import setting_overrides

    got = setting_overrides(ZOArguments(optimizer="adam", adam_betas=[0.8, 0.95], adam_eps=1e-7))
    assert got[-3:] == ["optim.beta1=0.8", "optim.beta2=0.95", "optim.eps=1e-07"]
