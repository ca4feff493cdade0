"""Command line: `python -m distzo <command> [hydra overrides and flags]`.

This module parses and dispatches: the commands are registered components (`distzo.cli.commands`,
one module each; your own through DISTZO_PLUGINS), Hydra's application around train, eval and bench
is `distzo.cli.hydra_app`, the argument helpers and the one-line error report `distzo.cli.args`,
and what runs (composition and checks, the local workers, sweeps, the
runs themselves) is the library's. Every input error, wherever it is raised, becomes one line
`distzo: error: ...` on stderr and exit status 2 (`reported`), not a traceback.
"""

from __future__ import annotations

import sys

from ..parallel.launch_env import adopt_slurm_environment, launcher
from .args import MULTIRUN, SKIP_PRECHECK, fail, reported, split_args

USAGE = """usage: python -m distzo <command> [key=value ...] [hydra flags]

commands:
{commands}

Examples:
  python -m distzo train                                   # the embedded default (SmolLM2-135M, movie reviews)
  python -m distzo train model=tiny task=synthetic-cue steps=50
  python -m distzo train optim.lr=1e-5 estimator.eps=1e-3 hydra.run.dir=runs/a
  python -m distzo train --cfg job                         # show the composed config
  python -m distzo train --help                            # presets and every key

Run `python -m distzo <command> --help` for a command's configuration."""

def start_own_workers(command: str, args: list[str]) -> bool:
    """A plain process (no torchrun, no srun) whose mesh needs several: start them here, as local
    workers each running this same command (distzo.run.launcher), and exit with the job's status;
    False where this process runs the command itself. The configuration is checked once first, so
    a mistake costs one line, not one per worker."""
    from ..run.checks import compose_and_check
    from ..run.launcher import WorkerFailed, run_local_workers
    from .hydra_app import single_run, single_run_overrides

    flags, overrides = split_args(args)
    if launcher() != "none" or MULTIRUN.intersection(flags) or SKIP_PRECHECK.intersection(flags) or "--cfg" in flags:
        return False
    with reported():
        if single_run(flags, overrides):  # the composition the run itself will use (composed once)
            overrides = single_run_overrides(command, overrides)
        cfg = compose_and_check(overrides, check_world=False)
        try:
            return run_local_workers(command, args, cfg)
        except WorkerFailed as exc:
            if str(exc):
                from ..errors import write_error_line

                write_error_line(str(exc))
            raise SystemExit(exc.exit_code) from None


def main(argv: list[str] | None = None) -> None:
    from ..config.compose import composed_once
    from ..registry import registry

    args = list(sys.argv[1:] if argv is None else argv)
    commands = registry("command")
    with reported(), composed_once():
        ordered = sorted(commands.items(), key=lambda item: _usage_place(item[0]))
        if not args or args[0] in ("-h", "--help", "help"):
            print(USAGE.format(commands="\n".join(f"  {name:9s} {cls.summary()}" for name, cls in ordered)))
            return
        command, rest = args[0], args[1:]
        if command not in commands:
            fail(f"unknown command '{command}'; commands: {', '.join(n for n, _ in ordered)} "
                 "(see python -m distzo --help)")
        adopt_slurm_environment()  # under srun: this task's rank, world and master from SLURM's variables
        handler = commands.get(command)
        if handler.starts_workers and start_own_workers(command, rest):
            return
        handler.run(rest)


# The usage lists these first, in this order; other commands (your own) follow.
USAGE_ORDER = ("train", "prepare", "replay", "eval", "bench", "sweep")


def _usage_place(name: str) -> tuple[int, str]:
    return (USAGE_ORDER.index(name), "") if name in USAGE_ORDER else (len(USAGE_ORDER), name)


if __name__ == "__main__":
    main()
