"""Hydra's application around the commands that run a configuration (train, eval, bench): the
packaged presets (conf/) with the command line's overrides, Hydra's flags (`--cfg job`, `--help`,
`-m`) and `hydra.run.dir=...` as Hydra users expect. Before Hydra runs, the overrides are composed and
checked once, and rank 0 claims the run directory, so a mistake costs one line and leaves nothing
behind."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from ..parallel.launch_env import launched_rank, launched_world_size
from .args import MULTIRUN, SKIP_PRECHECK, fail, reported, split_args


def claim_run_dir(cfg: Any, resumable: bool = True):
    """Before Hydra creates the run directory and writes .hydra/ into it: the library's checks of it
    (`RunDirectory.claim`); the claimed directory, which the Hydra job hands to the library so that a
    failure before training removes what this command created. A timestamped default
    (`${now:...}`) is checked by its fixed part."""
    from omegaconf import OmegaConf

    from ..config.compose import typed
    from ..run.launcher import timestamped
    from ..run.rundir import RunDirectory

    raw = str(OmegaConf.to_container(cfg.hydra.run, resolve=False)["dir"])
    if not raw.strip():  # Hydra would run in the current directory, among whatever else is there
        fail("hydra.run.dir is empty; name the run's directory (hydra.run.dir=runs/a), or leave it out for the "
             "timestamped default")
    if resumable and cfg.resume == "auto" and timestamped(raw):
        fail("resume=auto needs a fixed run directory that a restarted job finds again: add "
             "hydra.run.dir=/path/to/run")
    try:
        path, fixed = Path(OmegaConf.select(cfg, "hydra.run.dir")), True
    except Exception:  # an interpolation that needs Hydra's runtime (${now:...}): check its fixed part
        path, fixed = Path(raw.split("${", 1)[0] or "."), False
    return RunDirectory.claim(typed(cfg), path, fixed=fixed, resumable=resumable)


def run_hydra(task: Callable[[Any, Any], Any], command: str, args: list[str]) -> None:
    """Run `task(cfg, claimed)` as Hydra's application of `command` (claimed: the run directory this
    command claimed for rank 0 of a single run, else None)."""
    import hydra

    from ..config.compose import config_dir, override_key, register_configs
    from ..run.checks import compose_and_check

    register_configs()
    flags, overrides = split_args(args)
    multirun = bool(MULTIRUN.intersection(flags))
    if single_run(flags, overrides):
        return run_single(task, command, overrides)
    overrides = command_overrides(overrides, multirun)
    if multirun and launched_world_size() > 1:
        fail("-m (multirun) cannot run under torchrun: every rank would sweep on its own; run one torchrun "
             "per configuration instead")
    # Jobs of a launcher other than Hydra's basic one (submitit's) run elsewhere, each its own mesh.
    remote = multirun and any(override_key(o) == "hydra/launcher" and o.split("=", 1)[-1] != "basic" for o in overrides)
    if multirun and not remote and any(override_key(o) == "mesh" and ("," in o or "(" in o) for o in overrides):
        fail(f"{command} -m runs every configuration in this one process, so the mesh cannot vary; sweep layouts "
             "with python -m distzo sweep mesh=1x2,2x1 ... (one torchrun job per layout)")
    conf = config_dir()
    claimed = None
    if not SKIP_PRECHECK.intersection(flags):
        # eval deals its batches over whatever processes run (the library fits the mesh to them)
        cfg = compose_and_check(overrides, multirun=multirun, check_world=command != "eval" and not remote)
        if not multirun and launched_rank() == 0:
            claimed = claim_run_dir(cfg, resumable=command == "train")  # eval and bench continue no run
    # The flags last: a flag whose value is optional (`--info`) would take the next override as it.
    sys.argv = ([f"distzo {command}"] + overrides + worker_overrides() + [f"hydra.help.app_name={command}"]
                + flags)

    def job(cfg):
        if multirun:
            return sweep_job(task, cfg)
        with reported():
            return task(cfg, claimed)

    hydra.main(config_path=conf, config_name="config", version_base="1.3")(job)()


def single_run(flags: list[str], overrides: list[str]) -> bool:
    """A run with no Hydra flag (no -m, --cfg, --help, ...), no hydra.mode of its own and no
    hydra.verbose (whose composition report only hydra.main prints): the command runs Hydra's job
    itself on the configuration it composed and checked (`run_single`)."""
    from ..config.compose import override_key

    return (not flags and not any(override_key(o) in ("hydra.mode", "hydra.verbose") for o in overrides)
            and hydra_run_steps() is not None)


def hydra_run_steps() -> tuple[Any, Any] | None:
    """Hydra 1.3's callbacks and failure report (`Callbacks`, `run_and_report`), which `run_single`
    uses as `Hydra.run` does; None where this Hydra has moved them (hydra.main then runs every run)."""
    try:
        from hydra._internal.callbacks import Callbacks
        from hydra._internal.utils import run_and_report
    except ImportError:
        return None
    return Callbacks, run_and_report


def command_overrides(overrides: list[str], multirun: bool = False) -> list[str]:
    """The command line's overrides as Hydra composes them: upgraded from older keys, relative paths
    made absolute, continued after a restart (`restart_overrides`, not for a sweep), and your config
    directories ($DISTZO_CONFIG_PATH) on the search path."""
    from ..config.compose import (
        absolute_path_overrides,
        override_key,
        search_path_override,
        upgrade_overrides,
        user_config_dirs,
    )
    from ..run.launcher import restart_overrides

    overrides = absolute_path_overrides(upgrade_overrides(overrides if multirun else restart_overrides(overrides)))
    if not any(override_key(o) == "hydra.searchpath" for o in overrides):
        overrides = search_path_override(user_config_dirs()) + overrides
    return overrides


def single_run_overrides(command: str, overrides: list[str]) -> list[str]:
    """The overrides a single run of `command` composes: the command line's (`command_overrides`),
    this rank's (`worker_overrides`), the help's application name, and hydra.mode=RUN (which
    hydra.main adds to a run's overrides)."""
    return command_overrides(overrides) + worker_overrides() + [f"hydra.help.app_name={command}", "hydra.mode=RUN"]


def run_single(task: Callable[[Any, Any], Any], command: str, overrides: list[str]) -> None:
    """One run as hydra.main runs it (Hydra's logging, the job's output directory and .hydra/, the
    callbacks of hydra.callbacks, a failure's report and exit status 1), on the configuration this
    command composed and checked: what was checked is what runs, and it is composed once. hydra.main
    would compose it twice more (once to read hydra.mode, once to run), each ~0.15-0.25 s of CPU, in
    every rank. The steps are Hydra 1.3's `Hydra.run` after its composition; Hydra's `run_job` (the
    API its launcher plugins use) runs the job."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext

    from ..config.compose import config_dir
    from ..run.checks import compose_and_check

    Callbacks, run_and_report = hydra_run_steps()
    cfg = compose_and_check(single_run_overrides(command, overrides), check_world=command != "eval")
    claimed = claim_run_dir(cfg, resumable=command == "train") if launched_rank() == 0 else None

    def job(task_cfg):
        with reported():
            return task(task_cfg, claimed)

    def run() -> None:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name=command):
            configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
            callbacks = Callbacks(cfg)
            callbacks.on_run_start(config=cfg, config_name="config")
            ret = run_job(hydra_context=HydraContext(config_loader=GlobalHydra.instance().hydra.config_loader,
                                                     callbacks=callbacks),
                          task_function=job, config=cfg, job_dir_key="hydra.run.dir", job_subdir_key=None)
            callbacks.on_run_end(config=cfg, config_name="config", job_return=ret)
            _ = ret.return_value  # raises the job's exception

    run_and_report(run)


def sweep_job(task: Callable[[Any, Any], Any], cfg: Any) -> Any:
    """One job of a `-m` sweep: a DistzoError is its one line, then raised on to the sweeper, which
    records the job as failed and goes on as its settings say (Hydra's basic sweeper runs the rest
    and reports the first failure at the end; Optuna's counts it against max_failure_rate). Exiting
    here, as a single run does, would end the whole sweep at its first failed job."""
    from ..errors import DistzoError, write_error_line
    from ..parallel.mesh import peer_failure

    try:
        return task(cfg, None)
    except DistzoError as exc:
        write_error_line(str(exc))
        raise
    except RuntimeError as exc:  # a job's mesh (a SLURM launcher's) whose peer failed first: say so in one line
        line = peer_failure(exc)
        if line is not None:
            write_error_line(line)
        raise


def worker_overrides() -> list[str]:
    """Under torchrun every rank runs this CLI; only rank 0 may create the run directory and its logs
    (otherwise Hydra makes one timestamped directory per rank). Other ranks stay in the current
    directory, write no .hydra/ and no log file, and adopt rank 0's run directory by broadcast."""
    if launched_rank() == 0:
        return []
    return ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=worker", "hydra/hydra_logging=none"]


def run_dir(claimed: Any):
    """The run directory the library is handed inside Hydra: the one this command claimed (rank 0 of
    a single run), Hydra's job directory (a multirun job: the library checks it), or None (the
    other ranks take rank 0's)."""
    from hydra.core.hydra_config import HydraConfig

    from ..run.rundir import RunDirectory

    if launched_rank() != 0:
        return None
    output = Path(HydraConfig.get().runtime.output_dir)
    if claimed is not None:
        return RunDirectory(output, claimed.created_from)
    return output
