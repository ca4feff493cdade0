"""A sweep's combinations: every comma-separated value of the command line's overrides, as Hydra's
basic sweeper would run them."""

from __future__ import annotations

import itertools
from typing import Sequence

from ...config.compose import override_key
from ...errors import DistzoError


class SweepError(DistzoError):
    """A sweep that cannot start; the message names the fix."""


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(overrides for the runs, overrides of the sweep itself: sweep.* and hydra.sweep.*)."""
    runs, own = [], []
    for o in overrides:
        key = override_key(o)
        if key == "hydra.run.dir":
            raise SweepError("a sweep sets each run's directory to <hydra.sweep.dir>/<n>; set hydra.sweep.dir=... "
                             "instead of hydra.run.dir")
        (own if key.startswith(("sweep.", "hydra.sweep.")) else runs).append(o)
    return runs, own


def expand(overrides: Sequence[str]) -> list[tuple[list[str], list[str]]]:
    """Every combination of the sweep values (cartesian product, first key outermost like Hydra's
    basic sweeper): [(full override list, swept key=value pairs)]."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    choices: list[list[str]] = []
    swept_at: list[int] = []
    for i, o in enumerate(parsed):
        if o.is_sweep_override():
            values = [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
            if not values:
                raise SweepError(f"{o.input_line}: the sweep has no values; list them as key=a,b,c")
            choices.append(values)
            swept_at.append(i)
        else:
            choices.append([o.input_line])
    if not swept_at:
        raise SweepError("nothing to sweep: give at least one key several comma-separated values, e.g. "
                         "python -m distzo sweep mesh=1x2,2x1 model=tiny")
    return [(list(combo), [combo[i] for i in swept_at]) for combo in itertools.product(*choices)]
