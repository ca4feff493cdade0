"""Your own extensions, loaded by name: `DISTZO_PLUGINS=mypackage.rules,other.module` imports each module
before distzo looks a name up in one of its registries (an optimizer of `optim.name`), so a module that
registers an optimizer (`distzo.zo.optimizers.register`) makes its name usable on the command line, in
every process of a mesh (each imports it), as in Python (docs/optimizers.md#your-own-optimizer)."""

from __future__ import annotations

import importlib
import os

from .errors import ConfigError

PLUGINS_ENV = "DISTZO_PLUGINS"
_loaded: set[str] = set()


def load_plugins() -> None:
    """Import every module $DISTZO_PLUGINS names (comma-separated), once per process."""
    for name in (n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",")):
        if not name or name in _loaded:
            continue
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"{PLUGINS_ENV} names {name!r}, which cannot be imported ({exc}); put it on "
                              "PYTHONPATH or install it, or remove it from " + PLUGINS_ENV) from None
        _loaded.add(name)
