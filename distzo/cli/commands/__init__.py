"""The commands of `python -m distzo <command>`: each module of this package registers one
(`@register("command", name)`, distzo.registry) as a `Command`; a new command is one new module here,
or a module of your own named by DISTZO_PLUGINS."""

from __future__ import annotations

import importlib
import pkgutil
from typing import ClassVar


class Command:
    """A command: `run(args)` with the arguments after its name; the first line of its class
    docstring is its line in the usage. starts_workers: a plain process whose mesh needs several
    processes starts them itself, each running this command (distzo.run.launcher), instead of
    running it."""

    name: ClassVar[str]
    starts_workers: ClassVar[bool] = False

    @classmethod
    def summary(cls) -> str:
        return next(iter((cls.__doc__ or "").strip().splitlines()), "")

    @classmethod
    def run(cls, args: list[str]) -> None:
        raise NotImplementedError


class HydraCommand(Command):
    """A command that runs a configuration as Hydra's application (distzo.cli.hydra_app): `task(cfg,
    claimed)` runs inside Hydra's job, with the run directory the command claimed."""

    starts_workers = True

    @classmethod
    def run(cls, args: list[str]) -> None:
        from ..hydra_app import run_hydra

        run_hydra(cls.task, cls.name, args)

    @classmethod
    def task(cls, cfg, claimed) -> object:
        raise NotImplementedError


for _module in pkgutil.iter_modules(__path__):  # every command module registers itself on import
    importlib.import_module(f"{__name__}.{_module.name}")
