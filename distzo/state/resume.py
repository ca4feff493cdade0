"""Snapshots of a running job and resuming it (docs/checkpoints.md).

`distzo.state.checkpointer` writes a run's snapshots (rank 0 writes, every rank first enters the engine's
`materialized` context together) and `run.json`, the run's identity (seed, configuration fingerprint,
direction scheme) written when it starts. `find_resume_point` finds where an interrupted run
continues: the newest valid snapshot, then every step after it that `trajectory.jsonl` records
completely. Those steps are re-applied without data or forward passes (`catch_up`, the seed trick
that `distzo replay` uses too: a step's update is its seed plus one scalar per query), through the
engine's own `apply`, so the result is bitwise the uninterrupted run's. A run killed at any moment
therefore loses at most the step in flight; with no snapshot yet it continues from its initial
weights, which are a function of the configuration.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config.compose import PATH_SETTINGS
from ..config.legacy import v1_sections
from ..config.schema import Config
from ..engine import Engine
from ..errors import DistzoError
from ..models.quantize import base_matmul
from ..parallel.mesh import Mesh, device_type
from ..telemetry.jsonl import read_jsonl, truncate_after
from ..telemetry.metrics import Progress
from ..zo.directions import DIRECTIONS_VERSION, gaussian_generator_id, same_directions
from ..zo.estimators import estimator_type
from ..zo.optimizers import Optimizer
from .saved import RUN_FILE
from .snapshots import (
    STAGED,
    CorruptSnapshot,
    list_snapshots,
    newest_valid_snapshot,
    read_optimizer_state,
    read_snapshot,
    snapshots_dir,
    verify_snapshot,
)

log = logging.getLogger("distzo")



# What a snapshot records of the run that wrote it (run_identity's keys).
IDENTITY_KEYS = ("seed", "directions_version", "distribution", "device_type", "gaussian_generator", "mesh",
                 "config_fingerprint", "fingerprint_keys", "sources")


class ResumeError(DistzoError):
    """A run directory that this configuration cannot continue."""


def fingerprint_keys(cfg: Config) -> dict[str, Any]:
    """What a snapshot must agree with to be resumed: everything that shapes the trajectory except
    the mesh, offloading, threads and evaluation cadence (those change where and how fast, not what).
    The estimator's and optimizer's settings are hashed in the layout of the first fingerprints
    (distzo.config.legacy.v1_sections), so runs written before the settings moved beside their
    components still resume."""
    keys = {k: asdict(getattr(cfg, k)) for k in ("model", "task", "peft")}
    keys["estimator"], keys["optim"] = v1_sections(asdict(cfg.estimator), asdict(cfg.optim))
    if keys["model"].get("adapter", "auto") == "auto":
        keys["model"].pop("adapter", None)  # the default: fingerprints of runs from before the option stay valid
    # Keys added later count only when set, so runs written before them still resume.
    added = (("model", "revision", None), ("model", "quantize", "none"), ("model", "init_device", "cpu"),
             ("task", "revision", None), ("task", "max_tokens", None),
             ("task", "subset", None), ("task", "split_names", {"train": None, "validation": None, "test": None}),
             ("estimator", "clean", False))
    for section, key, default in added:
        if keys[section].get(key, default) == default:
            keys[section].pop(key, None)
    if str(cfg.engine.compute) != "fp32":
        keys["compute"] = str(cfg.engine.compute)  # the forward's arithmetic shapes the losses
    matmul = base_matmul(cfg.model.quantize, cfg.engine.quantized_matmul, device_type(cfg.device))
    if matmul not in (None, "torchao"):
        keys["quantized_matmul"] = matmul  # so does how a quantized base multiplies (auto: as resolved here)
    keys["batch_size"] = cfg.batch_size
    keys["objective"] = str(cfg.objective)
    if cfg.optim.schedule != "constant":
        keys["steps"] = cfg.steps  # a decaying schedule depends on the run length
    return json.loads(json.dumps(keys, default=str))  # as plain JSON, the form run.json keeps


def _digest(keys: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def config_fingerprint(cfg: Config) -> str:
    """The hash of `fingerprint_keys`, which run.json and every snapshot record."""
    return _digest(fingerprint_keys(cfg))


# fingerprint_keys' top-level entries that are not named as their configuration keys are
_KEY_NAMES = {"compute": "engine.compute", "quantized_matmul": "engine.quantized_matmul"}


def _flat(keys: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested keys as dotted configuration keys."""
    out = {}
    for k, v in keys.items():
        name = prefix + (k if prefix else _KEY_NAMES.get(k, k))
        out.update(_flat(v, name + ".") if isinstance(v, dict) else {name: v})
    return out


def fingerprint_differences(recorded: dict[str, Any], cfg: Config, most: int = 6) -> list[str]:
    """The settings in which `cfg` differs from a run's recorded `fingerprint_keys`, as
    "key: VALUE there, VALUE here", at most `most` of them and a count of the rest ("the default":
    a key that counts only when set, which was not)."""
    there, here = _flat(recorded), _flat(fingerprint_keys(cfg))

    def shown(values: dict[str, Any], key: str) -> str:
        return json.dumps(values[key]) if key in values else "the default"

    named = [f"{k}: {shown(there, k)} there, {shown(here, k)} here"
             for k in sorted(set(there) | set(here)) if there.get(k, ...) != here.get(k, ...)]
    return named[:most] + [f"{len(named) - most} more"] if len(named) > most else named


def run_identity(cfg: Config, seed: int, mesh: Mesh, sources: dict[str, Any] | None = None) -> dict[str, Any]:
    """What every snapshot of a run records, and run.json holds from its start. sources: the hub
    commits the run reads (distzo.run.hub_pins), which resume, eval.run and replay read again."""
    keys = fingerprint_keys(cfg)
    identity = {"seed": seed, "directions_version": DIRECTIONS_VERSION,
                "distribution": str(cfg.estimator.distribution), "device_type": mesh.device.type,
                "gaussian_generator": gaussian_generator_id(mesh.device), "mesh": str(mesh.shape),
                "config_fingerprint": _digest(keys), "fingerprint_keys": keys}
    if sources:
        identity["sources"] = dict(sources)
    return identity


@dataclass
class ResumePoint:
    """Where an interrupted run continues: `snapshot` (None: from the initial weights) and the logged
    steps after it, to be re-applied."""

    identity: dict[str, Any]
    snapshot: str | None = None
    snapshot_step: int = 0
    nonfinite_in_a_row: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def step(self) -> int:
        """The step the run continues after."""
        return self.records[-1]["step"] if self.records else self.snapshot_step

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The snapshot's trainable tensors (verified again on this rank), or None."""
        return read_snapshot(Path(self.snapshot))[0] if self.snapshot is not None else None

    def optimizer_state(self) -> dict[str, torch.Tensor] | None:
        """The snapshot's optimizer state, or None (no snapshot: the state starts from zeros)."""
        return read_optimizer_state(Path(self.snapshot)) if self.snapshot is not None else None


def _as_recorded_paths(keys: dict[str, Any], recorded: dict[str, Any] | None) -> dict[str, Any]:
    """`keys` with each path the run recorded relative (written before the command line made them
    absolute) put back where it names the same file from here, so such a run still resumes."""
    if not recorded:
        return keys
    keys = json.loads(json.dumps(keys))
    for setting in PATH_SETTINGS:  # those the fingerprint holds (eval.run is not among them)
        section, key = setting.split(".")
        there, here = recorded.get(section, {}).get(key), keys.get(section, {}).get(key)
        if isinstance(there, str) and isinstance(here, str) and not os.path.isabs(there) \
                and os.path.isabs(here) and os.path.abspath(os.path.expanduser(there)) == here:
            keys[section][key] = there
    return keys


def check_identity(cfg: Config, where: str, identity: dict[str, Any]) -> int:
    """The seed of a run that `cfg` may continue; raises ResumeError naming the difference."""
    recorded = identity.get("config_fingerprint")
    if recorded != config_fingerprint(cfg) \
            and recorded != _digest(_as_recorded_paths(fingerprint_keys(cfg), identity.get("fingerprint_keys"))):
        named = fingerprint_differences(identity["fingerprint_keys"], cfg) if identity.get("fingerprint_keys") else []
        if named:  # runs written since run.json records the keys themselves, not only their hash
            raise ResumeError(f"cannot resume from {where}: it was written with another configuration ("
                              f"{'; '.join(named)}); run with the settings it was written with, or use another "
                              "hydra.run.dir to start afresh")
        raise ResumeError(f"cannot resume from {where}: it was written with a different model, task, estimator, "
                          "optimiser, trainable set (peft), objective or batch size (or steps, with a decaying lr "
                          "schedule), engine.compute, or engine.quantized_matmul on a quantized base (auto is "
                          "decoded on CUDA and torchao elsewhere: set the one the run used); use another "
                          "hydra.run.dir to start afresh")
    if not same_directions(identity.get("directions_version"), str(cfg.estimator.distribution)):
        raise ResumeError(f"cannot resume from {where}: its {cfg.estimator.distribution} directions were drawn with "
                          f"scheme {identity.get('directions_version')}, and this distzo draws scheme "
                          f"{DIRECTIONS_VERSION}; finish that run with the distzo version that started it, or use "
                          "another hydra.run.dir to start afresh")
    if cfg.seed is not None and cfg.seed != identity["seed"]:
        raise ResumeError(f"cannot resume from {where}: it used seed {identity['seed']}, not seed={cfg.seed}")
    return int(identity["seed"])


def check_resumable(cfg: Config, run_dir: Path) -> None:
    """Whether `cfg` may continue the run in `run_dir` (its newest snapshot's, or else run.json's,
    identity), from JSON files only: the CLI checks this before Hydra writes into the directory."""
    for path in reversed(list_snapshots(run_dir)):
        try:
            state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # a corrupt snapshot: resume skips it too
        check_identity(cfg, str(path), state)
        return
    if (run_dir / RUN_FILE).is_file():
        try:
            identity = json.loads((run_dir / RUN_FILE).read_text())
        except (OSError, ValueError):
            return
        check_identity(cfg, str(run_dir / RUN_FILE), identity)


def logged_steps_after(run_dir: Path, step: int) -> list[dict[str, Any]]:
    """The trajectory's records of steps step+1, step+2, ... as far as they run without a gap (a torn
    last line, from a kill mid-write, ends the list)."""
    out, expect = [], step + 1
    for record in read_jsonl(run_dir / "trajectory.jsonl"):
        if record.get("step") == expect:
            out.append(record)
            expect += 1
        elif record.get("step", 0) > expect:
            break
    return out


def find_resume_point(cfg: Config, run_dir: Path, mesh: Mesh) -> ResumePoint | None:
    """With resume=auto, rank 0 finds where the run in `run_dir` continues (None: a fresh run) and
    every rank receives it."""
    if cfg.resume != "auto":
        return None
    return mesh.decided_on_main(lambda: _resume_point(cfg, run_dir, mesh.device))


def resume_point_at(cfg: Config, snapshot: Path) -> ResumePoint:
    """Where a run continues from an explicit snapshot folder (its weights, optimizer state and step),
    whatever was logged after it. Raises ResumeError for a snapshot that `cfg` cannot continue."""
    try:
        _, state = read_snapshot(snapshot)
    except CorruptSnapshot as exc:
        raise ResumeError(f"cannot resume from {snapshot}: {exc}") from None
    if state.get("weights_only"):
        raise ResumeError(f"cannot resume from {snapshot}: it holds the weights alone (keep_best's best "
                          "evaluation), not the optimizer's state a run continues with; resume from one of the "
                          "run's checkpoints/step-N snapshots")
    point = ResumePoint({k: state.get(k) for k in IDENTITY_KEYS}, str(snapshot), int(state["step"]),
                        int(state.get("nonfinite_in_a_row", 0)))
    check_identity(cfg, str(snapshot), point.identity)
    return point


def _resume_point(cfg: Config, run_dir: Path, device: torch.device) -> ResumePoint | None:
    for stale in snapshots_dir(run_dir).glob(STAGED):  # a snapshot whose writer died
        log.warning("Removing an unfinished snapshot %s", stale)
        shutil.rmtree(stale, ignore_errors=True)
    newest = newest_valid_snapshot(run_dir)
    identity_file = run_dir / RUN_FILE
    if newest is not None:
        path, _, state = newest
        point = ResumePoint({k: state.get(k) for k in IDENTITY_KEYS},
                            str(path), int(state["step"]), int(state.get("nonfinite_in_a_row", 0)))
    elif identity_file.is_file():
        try:
            identity = json.loads(identity_file.read_text())
        except (OSError, ValueError) as exc:
            raise ResumeError(f"cannot resume from {run_dir}: {RUN_FILE} is unreadable ({exc}); use another "
                              "hydra.run.dir to start afresh") from None
        point = ResumePoint(identity)
    else:
        return _start_over(run_dir, f"it has no valid snapshot and no {RUN_FILE}")
    where = point.snapshot or str(identity_file)
    check_identity(cfg, where, point.identity)
    point.records, why = replayable_records(cfg, point.identity, logged_steps_after(run_dir, point.snapshot_step),
                                            device)
    if why is not None:
        if point.snapshot is None and not point.records:
            return _start_over(run_dir, f"it has no snapshot to continue from, and {why}")
        log.warning("resume=auto: the steps logged after %s cannot be re-applied from step %d on (%s); continuing "
                    "from step %d", "the snapshot" if point.snapshot else "the initial weights", point.step + 1, why,
                    point.step)
    return point


def drawn_by(identity: dict[str, Any], record: dict[str, Any] | None = None) -> str:
    """Who drew a logged step's Gaussian directions: the generator its trajectory record names, else
    (a record logged before distzo named it, or none given) the one its start, a snapshot or run.json,
    records."""
    named = record.get("drawn_by") if record is not None else None
    return named or identity.get("gaussian_generator") or identity.get("device_type", "cpu")


def not_replayable(cfg: Config, identity: dict[str, Any], device: torch.device) -> str | None:
    """Why steps logged after the start `identity` describes (a snapshot or run.json), without a
    generator of their own, cannot be re-applied here, or None where they can (their directions are a
    function of the seed and the step, drawn as this process draws)."""
    if not estimator_type(cfg.estimator.name).replayable:
        return _activation_directions(cfg)
    here = gaussian_generator_id(device)
    if identity.get("distribution") == "gaussian" and drawn_by(identity) != here:
        return f"its Gaussian directions were drawn by {drawn_by(identity)}, this run draws by {here}"
    return None


def _activation_directions(cfg: Config) -> str:
    """Why no logged step of an estimator that is not `replayable` can be re-applied."""
    return f"estimator={cfg.estimator.name}'s directions depend on each step's activations"


def snapshot_drawn_elsewhere(run_dir: Path, after: int, upto: int,
                             device: torch.device) -> tuple[str, dict[str, Any]] | None:
    """For trajectory records from before they named their generator: the first step-N snapshot with
    after < N <= upto that records Gaussian directions drawn by another generator than this process's
    (its name and identity), or None. The session that wrote it drew the steps before it."""
    here = gaussian_generator_id(device)
    for path in list_snapshots(run_dir):
        identity = _saved_identity(path / "state.json") if after < int(path.name.split("-")[1]) <= upto else None
        if identity is not None and identity.get("distribution") == "gaussian" and drawn_by(identity) != here:
            return path.name, identity
    return None


def replayable_records(cfg: Config, identity: dict[str, Any], records: list[dict[str, Any]],
                       device: torch.device) -> tuple[list[dict[str, Any]], str | None]:
    """The leading `records` (logged after the start `identity` describes) that this process can
    re-apply, and why the next cannot (None: all can). A step's Gaussian directions must have been drawn
    as this process draws: a session on another GPU architecture, or a CPU one, may have logged it."""
    if not records:
        return [], None
    if not estimator_type(cfg.estimator.name).replayable:
        return [], _activation_directions(cfg)
    if identity.get("distribution") != "gaussian":
        return list(records), None
    here = gaussian_generator_id(device)
    for i, record in enumerate(records):
        if not record.get("skipped") and drawn_by(identity, record) != here:
            return records[:i], (f"step {record['step']}'s Gaussian directions were drawn by "
                                 f"{drawn_by(identity, record)}, this run draws by {here}")
    return list(records), None


def replay_point(cfg: Config, run_dir: Path, point: ResumePoint, step: int,
                 device: torch.device) -> tuple[ResumePoint | None, str]:
    """A start from which re-applying the logged steps passes through `step` (earlier than
    `point.step`) and reaches `point.step`: `point` itself where it starts at or before `step`, else the
    newest valid step-N snapshot at or before `step`, else the run's initial weights (run.json). Returns
    it, or None with the reason where the steps cannot be re-applied here or trajectory.jsonl has a gap
    (rank 0: it reads the run directory)."""
    if not estimator_type(cfg.estimator.name).replayable:
        return None, _activation_directions(cfg)
    if point.snapshot_step <= step and (point.records or step == point.snapshot_step):
        return point, ""
    snapshots = [(int(path.name.split("-")[1]), path) for path in list_snapshots(run_dir)]
    start = None
    for at, path in reversed(snapshots):
        if at > step:
            continue
        try:
            state = verify_snapshot(path)
        except CorruptSnapshot:
            continue
        if not state.get("weights_only"):
            start = ResumePoint({k: state.get(k) for k in IDENTITY_KEYS}, str(path), at,
                                int(state.get("nonfinite_in_a_row", 0)))
            break
    if start is None:  # the initial weights: the run's model and seed rebuild them
        identity = _saved_identity(run_dir / RUN_FILE)
        if identity is None:
            return None, f"no valid snapshot at or before step {step}, and {RUN_FILE} is missing or unreadable"
        start = ResumePoint(identity)
    check_identity(cfg, start.snapshot or str(run_dir / RUN_FILE), start.identity)
    records = [r for r in logged_steps_after(run_dir, start.snapshot_step) if r["step"] <= point.step]
    if (records[-1]["step"] if records else start.snapshot_step) != point.step:
        return None, f"trajectory.jsonl does not hold every step from {start.snapshot_step + 1} to {point.step}"
    if any("drawn_by" not in r for r in records if not r.get("skipped")):
        # Logged before records named their generator: they are taken as drawn by the start's, and a
        # session that drew by another continued from a snapshot without re-applying the steps after
        # it (resume=auto), so the start and every snapshot up to the point must have drawn as this
        # process draws.
        why = not_replayable(cfg, start.identity, device)
        if why is not None:
            return None, f"{why} ({Path(start.snapshot).name if start.snapshot else RUN_FILE})"
        elsewhere = snapshot_drawn_elsewhere(run_dir, step, point.snapshot_step, device)
        if elsewhere is not None:
            return None, f"{not_replayable(cfg, elsewhere[1], device)} (snapshot {elsewhere[0]})"
    kept, why = replayable_records(cfg, start.identity, records, device)
    if why is not None:
        return None, why
    start.records = kept
    return start, ""


def _saved_identity(path: Path) -> dict[str, Any] | None:
    """A snapshot's state.json or run.json as a run identity; None where it is unreadable."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _start_over(run_dir: Path, why: str) -> None:
    """A fresh start in a used directory: its earlier logs are set aside, not deleted."""
    if (run_dir / "metrics.jsonl").exists():
        log.warning("resume=auto: %s cannot be continued (%s); starting over (earlier logs set aside)", run_dir, why)
        for name in ("metrics.jsonl", "trajectory.jsonl"):
            if (run_dir / name).exists():
                (run_dir / name).rename(run_dir / f"{name}.abandoned-{int(time.time())}")
        best = snapshots_dir(run_dir) / "best"  # keep_best's: the abandoned run's best is not this run's
        if best.is_dir():
            best.rename(best.with_name(f"best.abandoned-{int(time.time())}"))
    return None


def truncate_logs(run_dir: Path, step: int) -> None:
    """Keep the records of steps <= step in metrics.jsonl and trajectory.jsonl, dropping summaries
    (a resumed run rewrites what came after), and any torn last line with them."""
    for name in ("metrics.jsonl", "trajectory.jsonl"):
        truncate_after(run_dir / name, step)


def catch_up(engine: Engine, records: list[dict[str, Any]], nonfinite_in_a_row: int, show: bool,
             optimizer: Optimizer | None = None) -> int:
    """Re-apply logged steps through the engine (their updates, or nothing for skipped ones), as
    training applied them; returns the non-finite steps in a row at the last one. Collective.
    optimizer: the run's, whose host numbers (MEAZO's) each re-applied step advances as it did in
    training (the logged coefficients already hold their effect on the weights)."""
    progress = Progress("catching up step", len(records), enabled=show)
    for i, r in enumerate(records):
        engine.begin_step(r["update"])  # as the step began in training
        if r.get("skipped"):
            nonfinite_in_a_row += 1
        else:
            nonfinite_in_a_row = 0
            if optimizer is not None:
                optimizer.advance(r["grads"])
            engine.apply(r["update"], [tuple(c) for c in r["coefficients"]], r["lr"], r["weight_decay"])
        progress.update(i + 1)
    return nonfinite_in_a_row
