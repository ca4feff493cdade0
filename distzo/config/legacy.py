"""Configurations written for earlier layouts, read in today's.

Until the estimators and optimizers declared their settings beside their classes (distzo.registry),
their own settings were sections named after them: `estimator.agzo.rank`, `estimator.prge.materialize`,
`optim.momentum.mu`, `optim.adam.beta1`; an optimizer was chosen with `optim.name=adam` (still a
spelling of the config group option `optim=adam`). Command lines, run directories'
`.hydra/config.yaml` and the resume fingerprints of runs started then (run.json, snapshots) keep
working through this module, the one place that knows those layouts. One case does not: a run of the
earlier layout that set a setting of an estimator it did not choose (`estimator=mezo
estimator.agzo.rank=2`, as a sweep over estimators gives) hashed that value, which today's layout has
nowhere to hold, so such a run does not resume (its fingerprint differs; the message says so).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..errors import ConfigError
from ..registry import registry

log = logging.getLogger("distzo")

POINTS = {"estimator": "estimator", "optim": "optimizer"}  # config group -> its extension point

# The sections the first layout had, with their defaults then (part of every v1 fingerprint).
V1_ESTIMATOR_SECTIONS = {"prge": {"materialize": True},
                         "agzo": {"rank": 1, "power_iters": 3, "tied_embeddings": "freeze"}}
V1_OPTIMIZER_SECTIONS = {"momentum": {"mu": 0.9}, "adam": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}}

_noted: set[str] = set()


# The group options config.yaml's defaults list chooses (tests/unit/test_legacy.py checks them).
DEFAULT_CHOICES = {"estimator": "mezo", "optim": "sgd"}


def _choices(override: str) -> list[str]:
    """The options a group override selects: one, or each value of a sweep (`a,b`, `choice(a,b)`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([override])[0]
    except Exception:  # not Hydra's grammar: composition names the mistake
        return [override.partition("=")[2]]
    if parsed.is_sweep_override():
        return [str(v) for v in parsed.sweep_string_iterator()]
    return [str(parsed.value())]


def upgrade_overrides(overrides: list[str]) -> list[str]:
    """Command-line overrides in today's spelling: `optim.name=X` / `estimator.name=X` select the
    group option (`optim=X`; a later choice wins, as a later override did), and a component's setting
    under its name (`optim.adam.beta2=0.99`) is the group's own key (`optim.beta2=0.99`) where the
    run chooses that component, and is left out where it does not (the earlier layout held every
    component's section and read only the chosen one's). A sweep over a group whose options differ
    in having such a setting is refused in one line. Other overrides pass unchanged."""
    chosen: dict[str, tuple[int, list[str]]] = {}
    for i, override in enumerate(overrides):  # the group options chosen, in today's spelling
        key, sep, value = override.partition("=")
        parts = key.split(".")
        if sep and key[:1] not in "+~" and parts[0] in POINTS and (len(parts) == 1 or parts[1:] == ["name"]):
            names = _choices(f"{parts[0]}={value}")
            if len(parts) == 2:  # optim.name=X names a registered component
                for name in names:
                    registry(POINTS[parts[0]]).get(name, key=key)
            chosen[parts[0]] = (i, names)
    out: list[str] = []
    for i, override in enumerate(overrides):
        key, sep, value = override.partition("=")
        parts = key.split(".")
        if not sep or key[:1] in "+~" or parts[0] not in POINTS:
            out.append(override)
        elif len(parts) == 1 or parts[1:] == ["name"]:
            if chosen[parts[0]][0] == i:  # the last choice of the group
                out.append(f"{parts[0]}={value}")
        elif len(parts) == 3 and _is_setting(POINTS[parts[0]], parts[1], parts[2]):
            new = f"{parts[0]}.{parts[2]}"
            names = chosen.get(parts[0], (0, [DEFAULT_CHOICES[parts[0]]]))[1]
            have = [n for n in names if _is_setting(POINTS[parts[0]], n, parts[2])]
            if have and len(have) < len(names):
                raise ConfigError(f"{key} applies to {parts[0]}={parts[1]}, and the sweep also chooses "
                                  f"{', '.join(n for n in names if n not in have)}, which has no {parts[2]}: sweep "
                                  f"presets of your own instead ({parts[0]}/my_{parts[1]}.yaml holding defaults: "
                                  f"[{parts[1]}, _self_] and {parts[2]}: ...)")
            if have:
                out.append(f"{new}={value}")
                _note(f"{key} is spelled {new} now (the old spelling is still accepted)")
            else:
                _note(f"{key} is ignored: {parts[0]}={parts[1]} is not this run's {parts[0]}")
        else:
            out.append(override)
    return out


def _is_setting(point: str, component: str, field: str) -> bool:
    reg = registry(point)
    if component not in reg:
        return False
    settings = reg.settings(component)
    return settings is not None and field in getattr(settings, "__dataclass_fields__", {})


def _note(line: str) -> None:
    """One line per old spelling and process (rank 0's only, under a launcher)."""
    if line in _noted or os.environ.get("RANK", "0") != "0":
        return
    _noted.add(line)
    log.warning("%s", line)


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
    for group, point in POINTS.items():
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
