"""The command line: `python -m distzo <command> [overrides]`. Argument handling and messages only;
every check and action is the library's (distzo.run)."""

from .main import main

__all__ = ["main"]
