"""Configurations written for earlier layouts, read in today's.

Until the estimators and optimizers declared their settings beside their classes (distzo.registry),
their own settings were sections named after them: `estimator.agzo.rank`, `estimator.prge.materialize`,
`optim.momentum.mu`, `optim.adam.beta1`; an optimizer was chosen with `optim.name=adam` (still a
spelling of the config group option `optim=adam`). Command lines, run directories'
`.hydra/config.yaml` and the resume fingerprints of runs started then (run.json, snapshots) keep
working through this module, the one place that knows those layouts.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from ..errors import ConfigError
from ..registry import registry

log = logging.getLogger("distzo")

GROUPS = {"estimator": "estimator", "optim": "optimizer"}  # config group -> extension point

# The sections the first layout had, with their defaults then (part of every v1 fingerprint).
V1_ESTIMATOR_SECTIONS = {"prge": {"materialize": True},
                         "agzo": {"rank": 1, "power_iters": 3, "tied_embeddings": "freeze"}}
V1_OPTIMIZER_SECTIONS = {"momentum": {"mu": 0.9}, "adam": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}}

_noted: set[str] = set()


# The group options config.yaml's defaults list chooses (tests/unit/test_config.py checks them).
DEFAULT_CHOICES = {"estimator": "mezo", "optim": "sgd"}


def upgrade_overrides(overrides: list[str]) -> list[str]:
    """Command-line overrides in today's spelling: `optim.name=X` / `estimator.name=X` select the
    group option (`optim=X`), and a component's setting under its name (`optim.adam.beta2=0.99`)
    is the group's own key (`optim.beta2=0.99`), or, for a component the run does not choose, is
    dropped (the earlier layout held every component's section and read only the chosen one's).
    Other overrides pass unchanged."""
    chosen: dict[str, str] = {}
    selections: list[str] = []
    for override in overrides:  # the group options chosen, in today's spelling
        key, sep, value = override.partition("=")
        parts = key.split(".")
        if sep and key[:1] not in "+~" and parts[0] in GROUPS and (len(parts) == 1 or parts[1:] == ["name"]):
            if len(parts) == 2 and re.fullmatch(r"[\w.-]+(,[\w.-]+)*", value):  # each value of a sweep (a,b)
                for name in value.split(","):
                    registry(GROUPS[parts[0]]).get(name, key=key)
            if chosen.get(parts[0], value) != value:
                raise ConfigError(f"{parts[0]} is chosen twice ({parts[0]}={chosen[parts[0]]} and {value}); choose one")
            chosen[parts[0]] = value
    out: list[str] = []
    for override in overrides:
        key, sep, value = override.partition("=")
        parts = key.split(".")
        if not sep or key[:1] in "+~" or parts[0] not in GROUPS:
            out.append(override)
        elif len(parts) == 1 or parts[1:] == ["name"]:
            if f"{parts[0]}={value}" not in selections:
                selections.append(f"{parts[0]}={value}")
                out.append(f"{parts[0]}={value}")
        elif len(parts) == 3 and _is_setting(GROUPS[parts[0]], parts[1], parts[2]):
            if parts[1] in chosen.get(parts[0], DEFAULT_CHOICES[parts[0]]).split(","):
                out.append(f"{parts[0]}.{parts[2]}={value}")
            _note(key, f"{parts[0]}.{parts[2]}")
        else:
            out.append(override)
    return out


def _is_setting(point: str, component: str, field: str) -> bool:
    reg = registry(point)
    if component not in reg:
        return False
    settings = reg.settings(component)
    return settings is not None and field in getattr(settings, "__dataclass_fields__", {})


def _note(old: str, new: str) -> None:
    """One line per old spelling and process (rank 0's only, under a launcher)."""
    if old in _noted or os.environ.get("RANK", "0") != "0":
        return
    _noted.add(old)
    log.warning("%s is spelled %s now (the old spelling is still accepted)", old, new)


def upgrade_saved(data: dict[str, Any]) -> dict[str, Any]:
    """A saved configuration (a run's .hydra/config.yaml as plain data) in today's layout: each
    group's chosen component's section merged into the group, the other components' sections
    dropped; the optimizer's flat settings of the layout before sections (beta1, beta2, adam_eps,
    a number as momentum) read first; no optimizer name is sgd."""
    optim = data.get("optim")
    if isinstance(optim, dict):
        flat = {k: optim.pop(k) for k in ("beta1", "beta2", "adam_eps") if k in optim}
        if flat:
            optim["adam"] = {{"adam_eps": "eps"}.get(k, k): v for k, v in flat.items()}
        if isinstance(optim.get("momentum"), (int, float)):
            optim["momentum"] = {"mu": optim["momentum"]}
        optim.setdefault("name", "sgd")
    for group, point in GROUPS.items():
        section = data.get(group)
        if not isinstance(section, dict):
            continue
        names = set(registry(point).names()) | set(V1_ESTIMATOR_SECTIONS) | set(V1_OPTIMIZER_SECTIONS)
        for key in [k for k, v in section.items() if isinstance(v, dict) and k in names]:
            own = section.pop(key)
            if key == section.get("name"):
                section.update(own)
    return data


def v1_sections(estimator: dict[str, Any], optim: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The `estimator` and `optim` sections (today's, as plain data) as the first layout had them in
    a resume fingerprint: every estimator's section present (the chosen one's settings, the others'
    defaults then), and the optimizer's name and its own section only when it is not sgd."""
    name = estimator["name"]
    own = V1_ESTIMATOR_SECTIONS.get(name, {})
    est = {k: v for k, v in estimator.items() if k not in own}
    for section, defaults in V1_ESTIMATOR_SECTIONS.items():
        est[section] = {k: (estimator[k] if section == name else v) for k, v in defaults.items()}
    opt_name = optim["name"]
    settings = V1_OPTIMIZER_SECTIONS.get(opt_name, {})
    opt = {k: v for k, v in optim.items() if k not in settings and k != "name"}
    if opt_name != "sgd":
        opt["name"] = opt_name
        if settings:
            opt[opt_name] = {k: optim[k] for k in settings}
    return est, opt
