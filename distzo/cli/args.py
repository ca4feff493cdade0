"""The command line's arguments and errors: Hydra's flags told from overrides, and every input error
as one line `distzo: error: ...` on stderr with exit status 2 (`reported`), not a traceback."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from ..errors import DistzoError
from ..parallel.launch_env import wait_for_failing_peers

# Hydra flags that take a value (the value is not an override).
VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
               "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}
# Flags after which nothing runs (help, the config, shell completion): no checks, no workers.
SKIP_PRECHECK = {"--help", "-h", "--hydra-help", "--version", "--info", "-i", "--shell-completion", "-sc",
                 "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun"}
MULTIRUN = {"-m", "--multirun"}


def fail(message: str, code: int = 2, wait: bool = True) -> None:
    """One error line on stderr and exit `code`; under a launcher, first wait for the peers that fail
    the same way (so the job's output is every rank's one line, not a peer's lost connection)."""
    from ..errors import write_error_line

    write_error_line(message)
    if wait:
        wait_for_failing_peers()
    raise SystemExit(code)


@contextmanager
def reported() -> Iterator[None]:
    """Inside: a DistzoError is one line and exit status 2. A rank whose peers are gone (one was
    killed or crashed) says so in one line, exit status 1, without waiting for them and without a
    traceback: the rank that failed first has reported the cause."""
    from ..parallel.mesh import peer_failure

    try:
        yield
    except DistzoError as exc:
        fail(str(exc))
    except RuntimeError as exc:
        line = peer_failure(exc)
        if line is None:
            raise
        fail(line, code=1, wait=False)


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(hydra flags with their values, overrides)."""
    flags, overrides = [], []
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("-"):
            flags.append(a)
            if a in VALUE_FLAGS and i + 1 < len(args) and "=" not in args[i + 1]:
                flags.append(args[i + 1])
                i += 1
        else:
            overrides.append(a)
        i += 1
    return flags, overrides


def overrides_only(args: list[str], command: str, usage: str, note: str = "") -> list[str] | None:
    """The key=value overrides of a command that takes no Hydra flags; None after printing its usage
    for -h / --help; one clear error for any other flag."""
    flags, overrides = split_args(args)
    if {"-h", "--help"}.intersection(flags):
        print(usage)
        return None
    if flags:
        fail(f"{command} takes key=value overrides only, not {' '.join(flags)}{note}")
    return overrides
