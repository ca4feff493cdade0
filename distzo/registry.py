"""Extension points: every kind of component distzo can be extended with is a registry of named
classes, filled by one decorator (docs/architecture.md#what-adding-something-touches).

    @register("estimator", "clipped_spsa")
    class ClippedSPSA(SPSA):
        @dataclass
        class Settings(SPSA.Settings):            # typed, with defaults; ranges as field metadata
            clip: float = setting(10.0, "> 0", "the largest |g| a step applies")

| point | a run names one by | the built-in ones are registered by |
|---|---|---|
| `estimator` | `estimator=<name>` (a Hydra config group: its settings are `estimator.<field>`) | `distzo.zo.estimators` |
| `optimizer` | `optim=<name>` or `optim.name=<name>` (a config group: `optim.<field>`) | `distzo.zo.optimizers` |
| `task_kind` | `task.kind=<name>` | `distzo.data.kinds` |
| `engine_mode` | chosen by the engine from the configuration and the mesh | `distzo.engine` |
| `command` | `python -m distzo <name>` | `distzo.cli.commands` |

A component of a point with a config group declares its settings as a dataclass named `Settings`
beside (inside) its class, extending its point's base (`distzo.config.schema.EstimatorSettings`,
`OptimSettings`); the registry hands them to Hydra's ConfigStore (`distzo.config.compose`), to the
range checks (`distzo.config.checks`), to `distzo.hf.ZOArguments` and to the docs' settings tables.

Your own components register the same way, from modules that $DISTZO_PLUGINS names (comma-separated
module names, or paths of .py files): each is imported before a name is looked up, in every process
of a run, so what it registers is usable on the command line, on a mesh and under ZOTrainer.

This module sits below the configuration layer: it imports the modules that register built-in
components by name, when a registry is first read, as it imports plugins.
"""  # noqa: E501 (a markdown table above: its rows cannot wrap)

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, TypeVar

from .errors import ConfigError

PLUGINS_ENV = "DISTZO_PLUGINS"

T = TypeVar("T", bound=type)


@dataclass(frozen=True)
class ExtensionPoint:
    """A kind of component. key: how a run names one (for messages). noun: what one is called, with
    its article. home: the module whose import registers the built-in ones. group: the Hydra config
    group whose options are the components' settings (None: its components have no settings)."""

    name: str
    key: str
    noun: str
    home: str
    group: str | None = None


POINTS: dict[str, ExtensionPoint] = {p.name: p for p in (
    ExtensionPoint("estimator", "estimator", "an estimator", "distzo.zo.estimators", group="estimator"),
    ExtensionPoint("optimizer", "optim.name", "an optimizer", "distzo.zo.optimizers", group="optim"),
    ExtensionPoint("task_kind", "task.kind", "a task kind", "distzo.data.kinds"),
    ExtensionPoint("engine_mode", "engine mode", "an engine mode", "distzo.engine"),
    ExtensionPoint("command", "command", "a command", "distzo.cli.commands"),
)}


class Registry:
    """The components of one extension point, by name, in registration order."""

    def __init__(self, point: ExtensionPoint):
        self.point = point
        self._classes: dict[str, type] = {}
        self._loaded = False

    def add(self, name: str, cls: T) -> T:
        known = self._classes.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"two {self.point.name}s are called {name!r}: {known.__module__}.{known.__qualname__} "
                             f"and {cls.__module__}.{cls.__qualname__}")
        cls.name = name
        self._classes[name] = cls
        return cls

    def load(self) -> Registry:
        """Import the built-in components' module and your plugins (once)."""
        if not self._loaded:
            self._loaded = True
            importlib.import_module(self.point.home)
        load_plugins()
        return self

    def get(self, name: Any, key: str | None = None) -> type:
        """The class registered as `name`; a ConfigError naming `key=name` (default: the point's key)
        and the registered names when there is none."""
        name = str(name)
        if name not in self._classes or not self._loaded:
            self.load()
        try:
            return self._classes[name]
        except KeyError:
            raise ConfigError(f"{key or self.point.key}={name} is not {self.point.noun}; use one of: "
                              f"{', '.join(self._classes)}") from None

    def names(self) -> list[str]:
        return list(self.load()._classes)

    def items(self) -> Iterator[tuple[str, type]]:
        return iter(list(self.load()._classes.items()))

    def having(self, attribute: str) -> str:
        """The components whose class sets `attribute` true, as "a, b, c" (sorted; for messages)."""
        return ", ".join(sorted(n for n, cls in self.items() if getattr(cls, attribute, False)))

    def settings(self, name: Any) -> type | None:
        """The settings dataclass of component `name` (None for a point without config groups)."""
        return getattr(self.get(name), "Settings", None) if self.point.group else None

    def __contains__(self, name: object) -> bool:
        return str(name) in self.load()._classes


_REGISTRIES = {name: Registry(point) for name, point in POINTS.items()}


def registry(point: str) -> Registry:
    """The registry of an extension point (`estimator`, `optimizer`, `task_kind`, `engine_mode`, `command`)."""
    return _REGISTRIES[point]


def register(point: str | type, name: str | None = None) -> Any:
    """Class decorator: make the class available as component `name` of extension point `point`
    (sets the class's `name`). `@register` on a class with a `name` attribute, the optimizers'
    decorator before there were extension points, registers an optimizer (still read)."""
    if isinstance(point, type):
        return _REGISTRIES["optimizer"].add(point.name, point)
    if point not in _REGISTRIES or name is None:
        raise ValueError(f"register(point, name): unknown extension point {point!r}; one of: {', '.join(_REGISTRIES)}")
    return lambda cls: _REGISTRIES[point].add(name, cls)


_plugins: dict[str, ModuleType] = {}  # what load_plugin imported, by the name it was given


def plugin_names() -> list[str]:
    """What $DISTZO_PLUGINS names, in order."""
    return [n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()]


def load_plugins() -> None:
    """Import every module (or .py file) $DISTZO_PLUGINS names, once per process."""
    for name in plugin_names():
        load_plugin(name)


def load_plugin(name: str) -> ModuleType:
    """Import a plugin (a module name, or the path of a .py file) once per process; ConfigError when
    it cannot be imported."""
    if name in _plugins:
        return _plugins[name]
    try:
        module = _import_file(Path(name)) if name.endswith(".py") or os.sep in name else importlib.import_module(name)
    except ImportError as exc:
        raise ConfigError(f"{PLUGINS_ENV} names {name!r}, which cannot be imported ({exc}); put it on PYTHONPATH, "
                          f"install it or give the path of its .py file, or remove it from {PLUGINS_ENV}") from None
    except Exception as exc:  # the plugin's own code failed as it ran: its author's line to fix
        raise ConfigError(f"{PLUGINS_ENV}: importing {name!r} failed ({type(exc).__name__}: {exc}); fix it, or remove "
                          f"it from {PLUGINS_ENV}") from None
    _plugins[name] = module
    return module


def _import_file(path: Path) -> ModuleType:
    """A plugin given as a file: imported as a module named after it (distzo_plugin_<stem>), once
    whatever path names it."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ImportError(f"no file {path}")
    import sys

    module_name = f"distzo_plugin_{path.stem}"
    known = sys.modules.get(module_name)
    if known is not None and getattr(known, "__file__", None) == str(path):
        return known
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
