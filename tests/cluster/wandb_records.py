"""Read a wandb offline run back from its `.wandb` file, independently of distzo's writer.

The file is wandb's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version), then LevelDB
log-format chunks in 32 KiB blocks (crc32, length, type: full / first / middle / last), each whole
record a `wandb.proto.wandb_internal_pb2.Record`. wandb 0.31 writes it from its Go core and ships no
Python reader, so this is the few lines the format needs, parsed with wandb's own protobuf classes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a wandb transaction log"
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        pending += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)  # wandb stores "a/b" keys as nested keys


def read_run(run_dir: Path) -> dict[str, Any]:
    """{'config': {...}, 'history': [{key: value} per logged row], 'summary': {...}, 'name', 'project'}."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    out: dict[str, Any] = {"config": {}, "history": [], "summary": {}}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["name"], out["project"] = r.run.display_name, r.run.project
            out["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            out["history"].append({_key(i): json.loads(i.value_json) for i in r.history.item})
        elif kind == "summary":
            out["summary"].update({_key(i): json.loads(i.value_json) for i in r.summary.update if _key(i)})
    return out
