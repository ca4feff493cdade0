"""Run state on disk: snapshots, the trajectory log, and the final model. Nothing here unpickles.

- A **snapshot** is `checkpoints/step-NNNNNNNN/` holding `weights.safetensors` (the trainable
  parameters under their canonical names), with an optimizer or directions that keep state (momentum,
  adam, hizoo, meazo; LOZO-M, Sparse MeZO) `optimizer.safetensors` (its state tensors,
  `<slot>/<parameter>`, `scalars/<name>`, `directions/<name>`), and `state.json` (step, seed,
  direction scheme, mesh, the config fingerprint, which covers the optimizer and its settings, and the
  files' sha256). It is written as a hidden temporary folder, fsynced and
  renamed into place, so a crash leaves either a complete snapshot or an ignored temporary. Deferred
  (offloaded) updates are flushed before a snapshot, so none is ever pending in one.
- The **trajectory log** `trajectory.jsonl` (written by the driver) has one line per step with
  what the update needs:
  `(step, coefficients c_k, lr, weight decay)` plus the projected gradients. With the seed it
  rebuilds the weights at any logged step from the nearest snapshot without data or forward passes
  (MeZO §2.1): a checkpoint of about a hundred bytes a step.
- Loading verifies the sha256 and the format; a corrupt or truncated snapshot is skipped with a
  warning and the previous one is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import load_file, save_file

from ..config.schema import Config
from ..errors import DistzoError

log = logging.getLogger("distzo")

SNAPSHOT_FORMAT = 1
_SNAPSHOT_RE = re.compile(r"^step-(\d{8})$")


class CorruptSnapshot(DistzoError):
    """A snapshot whose files are missing, truncated or do not match their recorded checksum."""


# --- atomic files ------------------------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def finite_json(data: Any) -> Any:
    """`data` with every non-finite float (NaN, inf) as None: JSON has no such numbers, and Python's
    NaN token is refused by strict readers (jq, JavaScript, json.loads with parse_constant)."""
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {k: finite_json(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_json(v) for v in data]
    return data


def atomic_write_json(path: Path, data: Any) -> None:
    """`data` as strict JSON (non-finite numbers as null) in `path`, whole or not at all."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(finite_json(data), fh, indent=2, sort_keys=True, allow_nan=False)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# --- snapshots ---------------------------------------------------------------------------------------

def snapshots_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_snapshots(run_dir: Path) -> list[Path]:
    """Complete snapshot folders, oldest first (temporaries are not listed)."""
    root = snapshots_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _SNAPSHOT_RE.match(p.name))


OPTIMIZER_FILE = "optimizer.safetensors"


def write_snapshot(run_dir: Path, step: int, tensors: dict[str, torch.Tensor], state: dict[str, Any],
                   keep: int, optimizer_state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a snapshot atomically into <run_dir>/checkpoints/step-N and prune to the newest `keep`.
    optimizer_state: the optimizer's state tensors (none for sgd), in `optimizer.safetensors`."""
    root = snapshots_dir(run_dir)
    final = write_snapshot_to(root / f"step-{step:08d}", step, tensors, state, optimizer_state)
    for old in list_snapshots(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


STAGED = ".*.tmp-*"  # the snapshot folders being written beside their final names (`_staged`)


@contextmanager
def _staged(final: Path) -> Iterator[Path]:
    """A snapshot folder to write beside `final`, its files synced by the caller, then renamed into
    place, replacing an older one there: a reader sees the old folder or the whole new one."""
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    yield tmp
    if final.exists():  # an older run's snapshot of the same step (never a newer one: logs are truncated)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)


def _write_state(folder: Path, state: dict[str, Any]) -> None:
    with open(folder / "state.json", "w", encoding="utf-8") as fh:
        json.dump(state, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())


def write_snapshot_to(final: Path, step: int, tensors: dict[str, torch.Tensor], state: dict[str, Any],
                      optimizer_state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a snapshot atomically as the folder `final` (its files written beside it first, then
    renamed into place), replacing an older one there."""
    with _staged(final) as tmp:
        cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        save_file(cpu, tmp / "weights.safetensors", metadata={"step": str(step), "format": str(SNAPSHOT_FORMAT)})
        _fsync_file(tmp / "weights.safetensors")
        full_state = dict(state, step=step, format=SNAPSHOT_FORMAT,
                          weights_sha256=sha256_of(tmp / "weights.safetensors"))
        if optimizer_state:
            cpu = {k: v.detach().to("cpu").contiguous() for k, v in optimizer_state.items()}
            save_file(cpu, tmp / OPTIMIZER_FILE, metadata={"step": str(step), "format": str(SNAPSHOT_FORMAT)})
            _fsync_file(tmp / OPTIMIZER_FILE)
            full_state["optimizer_sha256"] = sha256_of(tmp / OPTIMIZER_FILE)
        _write_state(tmp, full_state)
        _maybe_test_kill(step)
    return final


def copy_snapshot_weights(source: Path, final: Path) -> Path:
    """The weights of the snapshot `source` as a weights-only snapshot `final` (keep_best's), written
    as `write_snapshot_to` writes one."""
    state = json.loads((source / "state.json").read_text(encoding="utf-8"))
    state.pop("optimizer_sha256", None)
    state["weights_only"] = True
    with _staged(final) as tmp:
        shutil.copyfile(source / "weights.safetensors", tmp / "weights.safetensors")
        _fsync_file(tmp / "weights.safetensors")
        _write_state(tmp, state)
    return final


def _maybe_test_kill(step: int) -> None:
    """Test hook: DISTZO_TEST_KILL_IN_SNAPSHOT=<step> SIGKILLs this process after a snapshot's files
    are written but before the snapshot is renamed into place (the worst moment to die)."""
    if os.environ.get("DISTZO_TEST_KILL_IN_SNAPSHOT") == str(step):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def read_snapshot(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load and verify one snapshot (safetensors and JSON only: no code runs)."""
    path = Path(path)
    state = verify_snapshot(path)
    try:
        return load_file(path / "weights.safetensors"), state
    except Exception as exc:  # safetensors raises its own error types
        raise CorruptSnapshot(f"{path}: weights.safetensors unreadable ({exc})") from None


def verify_snapshot(path: Path) -> dict[str, Any]:
    """One snapshot's state, its files checked against their sha256 (streamed, not loaded); raises
    CorruptSnapshot naming what is wrong."""
    path = Path(path)
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CorruptSnapshot(f"{path}: state.json unreadable ({exc})") from None
    if state.get("format") != SNAPSHOT_FORMAT:
        raise CorruptSnapshot(f"{path}: snapshot format {state.get('format')!r}, expected {SNAPSHOT_FORMAT}")
    weights = path / "weights.safetensors"
    if not weights.is_file():
        raise CorruptSnapshot(f"{path}: weights.safetensors is missing")
    if sha256_of(weights) != state.get("weights_sha256"):
        raise CorruptSnapshot(f"{path}: weights.safetensors does not match its sha256 (truncated or corrupted)")
    if state.get("optimizer_sha256") is not None:
        optimizer = path / OPTIMIZER_FILE
        if not optimizer.is_file() or sha256_of(optimizer) != state["optimizer_sha256"]:
            raise CorruptSnapshot(f"{path}: {OPTIMIZER_FILE} is missing or does not match its sha256")
    return state


def read_optimizer_state(path: Path) -> dict[str, torch.Tensor] | None:
    """A snapshot's optimizer state (verified by `read_snapshot` before), or None (sgd's: none)."""
    file = Path(path) / OPTIMIZER_FILE
    if not file.is_file():
        return None
    try:
        return load_file(file)
    except Exception as exc:  # safetensors raises its own error types
        raise CorruptSnapshot(f"{path}: {OPTIMIZER_FILE} unreadable ({exc})") from None


def newest_valid_snapshot(run_dir: Path) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]] | None:
    """The newest snapshot that verifies; corrupt ones are reported and skipped."""
    for path in reversed(list_snapshots(run_dir)):
        try:
            tensors, state = read_snapshot(path)
        except CorruptSnapshot as exc:
            log.warning("Skipping a corrupt snapshot: %s", exc)
            continue
        return path, tensors, state
    return None


# --- the final model ---------------------------------------------------------------------------------

def save_final(model, tokenizer, folder: Path, params=None, cfg: Config | None = None) -> Path:
    """The trained model as a loadable Hugging Face folder (`model.safetensors`, config, tokenizer),
    so `model=hf model.path=<run>/final` loads it. With a parameter-efficient method (cfg.peft) only
    the trainable tensors are written, as `adapter.safetensors` under their canonical names, with
    `peft.json` (the method's settings; the base model is the run's `model`); LoRA and LoRA-FA also
    as a PEFT adapter (`adapter_config.json`, `adapter_model.safetensors`: distzo.peft.export). A folder cannot be
    renamed over a non-empty folder, so an existing `final/` is moved aside first: a crash in
    between leaves the complete new folder as `.final.tmp-<pid>`, never a partial one."""
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    peft = cfg is not None and cfg.peft.method != "none"
    if peft:
        tmp.mkdir(parents=True)
        save_file({p.name: p.tensor.detach().to("cpu").contiguous() for p in params}, tmp / "adapter.safetensors")
        (tmp / "peft.json").write_text(json.dumps({"peft": asdict(cfg.peft), "model": asdict(cfg.model)},
                                                  indent=2, sort_keys=True, default=str) + "\n")
        if cfg.peft.method in ("lora", "lora_fa"):  # also as a PEFT adapter (peft.PeftModel.from_pretrained)
            from ..peft.export import write_peft_lora

            base = cfg.model.path if cfg.model.source == "local" else cfg.model.name
            write_peft_lora(model, cfg.peft.r, cfg.peft.alpha, base, tmp)
    else:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    for f in tmp.iterdir():
        _fsync_file(f)
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, folder)
    _fsync_dir(folder.parent)
    return folder / ("adapter.safetensors" if peft else "model.safetensors")
