"""Writing run outputs to disk without ever leaving a half-written file under a final name.

Files are written to a temporary sibling, fsynced and renamed over the target (atomic on POSIX).
A folder cannot be renamed over a non-empty folder, so `save_final` moves an existing `final/` aside
first: a crash in between leaves the complete new folder as `.final.tmp-<pid>`, never a partial one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_final(model, tokenizer, folder: Path) -> Path:
    """The trained model as a loadable Hugging Face folder (`model.safetensors`, config, tokenizer),
    so `model=hf model.path=<run>/final` loads it."""
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, folder)
    _fsync_dir(folder.parent)
    return folder / "model.safetensors"
