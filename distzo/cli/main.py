"""Command line: `python -m distzo <command> [hydra overrides and flags]`.

Each command is a Hydra application over the packaged presets (distzo/config/presets), so overrides (`steps=100`, `model=tiny`), Hydra's
flags (`--cfg job`, `--help`, `-m`) and `hydra.run.dir=...` work as Hydra users expect. Before
Hydra runs, the overrides are composed and validated once, so a mistyped key, a wrong type or an
unknown preset costs one clear line on stderr and exit status 2, not a traceback.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Callable

COMMANDS = {
    "train": "fine-tune a model with zeroth-order SGD (forward passes only)",
    "prepare": "convert and cache the model and data a config needs (run once after install)",
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

Converts and caches what a configuration needs (the embedded default's GGUF -> Hugging Face folder
in $DISTZO_CACHE or ~/.cache/distzo, the tokenizer, the task's data), so the first training run
starts at once. Takes the same overrides as `train`, e.g. `python -m distzo prepare model=tiny`."""

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


def fail(message: str, code: int = 2) -> None:
    from ..errors import write_error_line

    write_error_line(message)
    wait_for_failing_siblings()
    raise SystemExit(code)


def wait_for_failing_siblings(timeout_s: float = 20.0) -> None:
    """Under torchrun, the first rank to exit makes torchrun kill the others, possibly before they
    print their own error. Input errors are deterministic, so every rank fails the same way: each
    failing rank counts itself on torchrun's store and waits (bounded) until all ranks have reported,
    so the job ends with every rank's line."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "MASTER_ADDR" not in os.environ:
        return
    import datetime
    import time

    try:
        from torch.distributed import TCPStore

        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
        key = f"distzo/failed/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        deadline = time.time() + timeout_s
        if store.add(key, 1) < world:
            while store.add(key, 0) < world and time.time() < deadline:
                time.sleep(0.05)
    except Exception:  # the store is a courtesy; failing to reach it must not hide the error
        pass


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


def shell_quoted_override(key: str, value: str) -> str:
    """`key=value` with the value as one quoted string of Hydra's grammar, itself double-quoted for
    the shell: the form to type when the bare value holds override syntax."""
    # In Hydra's quoted strings a backslash escapes only a quote, or the backslashes before one
    # (the closing quote included); elsewhere it is itself.
    hydra_value = "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\" if m.group(2) else "") + m.group(2),
                               value) + "'"
    text = f"{key}={hydra_value}"
    for ch in ("\\", '"', "$", "`"):  # what a double-quoted shell word still interprets
        text = text.replace(ch, "\\" + ch)
    return f'"{text}"'


def check_override_grammar(overrides: list[str]) -> None:
    """Each override alone through Hydra's parser, so a value that its grammar rejects (a template
    with braces, a text with a colon or a comma) is named with the quoted form that works, instead of
    the parser's "no viable alternative at input"."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except OverrideParseException:
            key, sep, value = override.partition("=")
            if not sep:
                fail(f"'{override}' is not an override; write key=value (e.g. steps=100)")
            fail(f"{key}: Hydra's override grammar cannot read the value {value!r} (braces, brackets, quotes, "
                 f"commas, colons and some spaces are its syntax); quote the value: {shell_quoted_override(key, value)}")


def explain(exc: BaseException) -> str:
    """One line from Hydra's and OmegaConf's multi-line composition errors."""
    text = str(exc)
    if exc.__cause__ is not None:  # "Error merging override x=y" carries the reason in its cause
        text = f"{text}\n{exc.__cause__}"
    ambiguous = re.search(r"Ambiguous value for argument '([^=']+)=([^']*)'", text)
    if ambiguous:
        key, value = ambiguous.groups()
        return (f"{key}={value}: a comma separates the values of a sweep (with -m) or of a list ([a,b]); for one "
                f"text holding a comma, quote it: {shell_quoted_override(key, value)}")
    missing = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if missing:
        group, option = missing.groups()
        options = re.findall(r"^\t(\S+)$", text, flags=re.M)
        hint = f"; available: {', '.join(options)}" if options else ""
        return f"unknown {group} preset '{option}'{hint}"
    not_in_struct = re.search(r"Key '([^']+)' is not in struct", text) or re.search(
        r"Could not override '([^']+)'", text)
    if not_in_struct:
        key = not_in_struct.group(1)
        full = re.search(r"full_key: (\S+)", text)
        name = full.group(1) if full else key
        return (f"unknown config key '{name}'; see `python -m distzo train --cfg job` for the valid keys "
                f"(prefix with + only to add keys deliberately)")
    conversion = re.search(r"Value '([^']*)' (?:of type '\w+' )?could not be converted to (\w+)", text)
    if conversion:
        value, kind = conversion.groups()
        full = re.search(r"full_key: (\S+)", text)
        where = f"{full.group(1)}=" if full else ""
        return f"{where}{value!s}: expected {kind.lower()}"
    choice = re.search(r"Invalid value '([^']*)', expected one of \[([^\]]*)\]", text)
    if choice:  # a choice field's Enum
        value, options = choice.groups()
        full = re.search(r"full_key: (\S+)", text)
        return f"{full.group(1) if full else 'value'}={value!r} is not supported; use one of: {options}"
    invalid = re.search(r"Invalid value assigned: (.*)", text)
    if invalid:
        full = re.search(r"full_key: (\S+)", text)
        return f"{full.group(1) if full else 'value'}: {invalid.group(1).rstrip('.')}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(lines[:2]) if lines else type(exc).__name__


def concrete_override_sets(overrides: list[str]) -> list[list[str]]:
    """Sweep overrides (`lr=1e-5,2e-5`, `range(...)`, `choice(...)`) expanded so that every value is
    checked once: the first set takes each sweep's first value; each further set changes one sweep."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    base = []
    sweeps: list[tuple[int, list[str]]] = []
    for i, o in enumerate(parsed):
        if o.is_sweep_override():
            values = [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
            base.append(values[0])
            sweeps.append((i, values[1:]))
        else:
            base.append(o.input_line)
    sets = [base]
    for i, rest in sweeps:
        for v in rest:
            sets.append(base[:i] + [v] + base[i + 1:])
    return sets


def compose_and_validate(overrides: list[str], multirun: bool = False, with_hydra: bool = True,
                         check_world: bool = True):
    """Compose the presets with the overrides and validate the result; exit with one line on any error.
    With multirun, every value of every sweep is checked. Returns the (first) composed config."""
    from ..config.schema import compose_config
    from ..errors import ConfigError
    from ..run.checks import validate

    check_override_grammar(overrides)
    try:
        sets = concrete_override_sets(overrides) if multirun else [overrides]
    except Exception as exc:
        fail(explain(exc))
    first = None
    for concrete in sets:
        try:
            cfg = compose_config(concrete, with_hydra=with_hydra)
        except ConfigError as exc:
            fail(str(exc))
        except Exception as exc:  # Hydra and OmegaConf raise many types; all are input errors here
            fail(explain(exc))
        try:
            validate(cfg, check_world=check_world)
        except ConfigError as exc:
            fail(str(exc))
        first = first if first is not None else cfg
    return first


# Set by the rank-0 pre-check: the nearest directory above the run directory that exists already, when
# this invocation creates the run directory (a fixed path that does not exist yet, or a timestamped
# default), so that a failure before training can remove what it created.
_RUN_DIR_BASE: Path | None = None


def check_run_dir(cfg) -> None:
    """Before Hydra creates the run directory and writes .hydra/ into it: the directory can be
    created and written, it holds no other run (unless resuming), and a run it holds is one this
    configuration may continue; resume=auto needs a directory that a restarted job finds again."""
    global _RUN_DIR_BASE
    from omegaconf import OmegaConf

    raw = str(OmegaConf.to_container(cfg.hydra.run, resolve=False)["dir"])
    if cfg.resume == "auto" and "${now:" in raw:
        fail("resume=auto needs a fixed run directory that a restarted job finds again: add "
             "hydra.run.dir=/path/to/run")
    try:
        run_dir = Path(OmegaConf.select(cfg, "hydra.run.dir"))
        fixed = True
    except Exception:  # an interpolation that needs Hydra's runtime (${now:...}): check its fixed part
        run_dir, fixed = Path(raw.split("${", 1)[0] or "."), False
    base = check_writable_dir(run_dir, "hydra.run.dir")
    _RUN_DIR_BASE = base.resolve() if not fixed or not run_dir.exists() else None
    if not fixed:
        return
    if (run_dir / "metrics.jsonl").exists() and cfg.resume != "auto":
        fail(f"{run_dir} already holds a run (metrics.jsonl); choose another hydra.run.dir or add resume=auto "
             "to continue it")
    if cfg.resume == "auto":
        from ..errors import DistzoError
        from ..state.resume import check_resumable

        try:
            check_resumable(cfg, run_dir)
        except DistzoError as exc:
            fail(str(exc))


def check_writable_dir(path: Path, key: str) -> Path:
    """`path` is a writable directory, or can be created as one: its nearest existing ancestor (which
    is returned) is a writable directory."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        fail(f"{key}={path} cannot be created: {probe} is not a directory; choose another {key}")
    import tempfile

    try:  # a real attempt: permission bits do not tell for root, read-only mounts or /proc
        os.rmdir(tempfile.mkdtemp(prefix=".distzo-probe-", dir=probe))
    except OSError as exc:
        what = "written" if probe == path else "created"
        fail(f"{key}={path} cannot be {what}: creating a directory in {probe} fails ({exc.strerror or exc}); "
             f"choose another {key}")
    return probe


def remove_failed_run_dir(run_dir: Path) -> None:
    """After an error before training started: the run directory this invocation created goes again
    (only Hydra's own files are in it), with the empty parents it created, so a failed command leaves
    nothing behind."""
    if _RUN_DIR_BASE is None or int(os.environ.get("RANK", "0")) != 0 or not run_dir.is_dir():
        return
    if not set(os.listdir(run_dir)) <= {".hydra", "train.log"}:
        return
    import logging
    import shutil

    logging.shutdown()  # train.log's handler
    shutil.rmtree(run_dir, ignore_errors=True)
    parent = run_dir.resolve().parent
    while parent != _RUN_DIR_BASE and _RUN_DIR_BASE in parent.parents:
        try:
            parent.rmdir()  # only if empty
        except OSError:
            break
        parent = parent.parent


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def run_hydra(task: Callable, command: str, args: list[str]) -> None:
    import hydra

    from ..config.schema import config_dir, register_configs
    from ..errors import ConfigError

    register_configs()
    flags, overrides = split_args(args)
    multirun = bool(_MULTIRUN.intersection(flags))
    if multirun and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        fail("-m (multirun) cannot run under torchrun: every rank would sweep on its own; run one torchrun "
             "per configuration instead")
    if multirun and any(_key(o) == "mesh" and ("," in o or "(" in o) for o in overrides):
        fail(f"{command} -m runs every configuration in this one process, so the mesh cannot vary; sweep layouts "
             "with python -m distzo sweep mesh=1x2,2x1 ... (one torchrun job per layout)")
    if not _SKIP_PRECHECK.intersection(flags):
        cfg = compose_and_validate(overrides, multirun=multirun)
        if not multirun and int(os.environ.get("RANK", "0")) == 0:
            check_run_dir(cfg)
    try:
        conf = config_dir()
    except ConfigError as exc:
        fail(str(exc))
    sys.argv = [f"distzo {command}"] + args + worker_overrides() + [f"hydra.help.app_name={command}"]
    hydra.main(config_path=conf, config_name="config", version_base="1.3")(task)()


def worker_overrides() -> list[str]:
    """Under torchrun every rank runs this CLI; only rank 0 may create the run directory and its logs
    (otherwise Hydra makes one timestamped directory per rank). Other ranks stay in the current
    directory, write no .hydra/ and no log file, and adopt rank 0's run directory by broadcast."""
    if int(os.environ.get("RANK", "0")) == 0:
        return []
    return ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=worker", "hydra/hydra_logging=none"]


def _train_task(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    from ..run.signals import EXIT_STOPPED, Stopped
    from ..run.training import train

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        _run_in_hydra(cfg, train)
    except Stopped as stop:
        if int(os.environ.get("RANK", "0")) == 0:
            where = f"snapshot {stop.snapshot}" if stop.snapshot else "a snapshot"
            print(f"distzo: stopped on {stop.signame} after step {stop.step}, {where}; continue with resume=auto "
                  f"hydra.run.dir={run_dir}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_STOPPED)


def _run_in_hydra(cfg, command: Callable) -> None:
    """A command inside Hydra's run directory: validated, and any input error one line (exit 2)
    after removing the run directory this invocation created."""
    from hydra.core.hydra_config import HydraConfig

    from ..errors import DistzoError
    from ..run.checks import validate

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        validate(cfg)
        command(cfg, run_dir)
    except DistzoError as exc:
        remove_failed_run_dir(run_dir)
        fail(str(exc))


def _bench_task(cfg) -> None:
    from ..run.bench import bench

    _run_in_hydra(cfg, bench)


def _eval_task(cfg) -> None:
    from ..run.evaluation import evaluate

    _run_in_hydra(cfg, evaluate)


def eval_args(args: list[str]) -> list[str]:
    """`eval`'s overrides: with `eval.run=RUN`, the run's own overrides first (its model, trainable set
    and task), so that the command line's win (`distzo.run.evaluation.run_overrides`); under torchrun
    without a mesh, `mesh=1xN` (evaluation deals its batches over every rank whatever the shape)."""
    from ..errors import DistzoError
    from ..run.evaluation import run_overrides

    overrides = [a for a in args if not a.startswith("-")]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not any(_key(a) == "mesh" for a in overrides):
        args = args + [f"mesh=1x{world}"]
    runs = [a.split("=", 1)[1] for a in overrides if _key(a) == "eval.run"]
    if not runs or runs[-1] in ("", "null", "None"):
        return args
    try:
        return run_overrides(Path(runs[-1])) + args
    except DistzoError as exc:
        fail(str(exc))


def prepare(args: list[str]) -> None:
    """Convert and cache what a configuration needs, so the first training run starts at once."""
    import logging

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    from .. import native
    from ..data.tasks import PromptTask
    from ..errors import DistzoError
    from ..models import load_model

    overrides = overrides_only(args, "prepare", PREPARE_USAGE)
    if overrides is None:
        return
    cfg = compose_and_validate(overrides, with_hydra=False, check_world=False)
    try:
        _, tokenizer = load_model(cfg.model)
        task = PromptTask(cfg.task, tokenizer, str(cfg.objective))
        kernels = native.load(cfg.engine.native)  # compiled once into the cache
    except DistzoError as exc:
        fail(str(exc))
    fused = f"fused kernels {kernels.path}" if kernels else "no fused kernels (torch ops)"
    print(f"ready: model {cfg.model.name}, task {task.name} ({task.size('train')} training examples), {fused}")


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
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        fail("sweep cannot run under torchrun: it launches one torchrun job per configuration itself; run "
             "python -m distzo sweep ...")
    try:
        run_overrides, own = split_overrides(overrides)
        combos = expand(run_overrides)
    except DistzoError as exc:
        fail(str(exc))
    except Exception as exc:  # Hydra's override grammar
        fail(explain(exc))
    cfgs = [compose_and_validate(combo + own, check_world=False) for combo, _ in combos]
    try:
        root = Path(str(OmegaConf.select(cfgs[0], "hydra.sweep.dir")))
    except Exception as exc:
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
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # distzo never downloads models or data sets
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    # Before torch (and its OpenMP runtime) loads. After each parallel region libgomp's threads spin
    # for ~300,000 iterations (milliseconds) by default, and after every block's forward that spin
    # takes a core from the threads that build the next block's working copies (measured on the
    # embedded default: the Gaussian perturb phase 0.67-0.71 s -> 0.54-0.57 s). 10,000 iterations
    # still bridge the microsecond gaps between the ops of a forward. A value set by the user wins,
    # and so does a user's OMP_WAIT_POLICY (libgomp lets an explicit GOMP_SPINCOUNT override it).
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    if command == "train":
        run_hydra(_train_task, command, rest)
    elif command == "bench":
        run_hydra(_bench_task, command, rest)
    elif command == "eval":
        run_hydra(_eval_task, command, eval_args(rest))
    elif command == "prepare":
        prepare(rest)
    elif command == "replay":
        replay_command(rest)
    elif command == "sweep":
        sweep_command(rest)


if __name__ == "__main__":
    main()
