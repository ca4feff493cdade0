"""Every row of docs/errors.md, run as written: exit status non-zero and exactly the documented line on
stderr (once per rank under torchrun)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"


def rows():
    out = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| ") else []
        if len(cells) == 3 and cells[1].startswith("`") and cells[2].startswith("`"):
            out.append((cells[0], cells[1].strip("`"), cells[2].strip("`")))
    return out


ROWS = rows()


def test_the_table_is_there():
    assert len(ROWS) >= 40


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("error-fixtures")
    gpt2 = root / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    used = root / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text('{"type": "train", "step": 1}\n')
    other = root / "other"
    r = subprocess.run([sys.executable, "-m", "distzo", "train", "model=tiny", "task=synthetic-cue", "steps=2",
                        "checkpoint.every=2", "eval_every=0", "task.val_size=16", "task.test_size=16",
                        f"hydra.run.dir={other}"], env=ENV, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return {"$GPT2": str(gpt2), "$USED_RUN": str(used), "$OTHER_RUN": str(other)}


def command(text: str) -> tuple[list[str], int]:
    """The argv to run and the number of ranks that must report."""
    argv = shlex.split(text)
    if argv[0] == "python":
        return [sys.executable] + argv[1:], 1
    assert argv[0] == "torchrun" and argv[1] == "--nproc-per-node"
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={argv[2]}"] + argv[3:], \
        int(argv[2])


@pytest.mark.parametrize("mistake,cmd,message", ROWS, ids=[r[0] for r in ROWS])
def test_documented_error(tmp_path, folders, mistake, cmd, message):
    for key, value in folders.items():
        cmd = cmd.replace(key, value)
    argv, ranks = command(cmd)
    r = subprocess.run(argv, capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300)
    assert r.returncode != 0
    if ranks == 1:
        assert r.returncode == 2
    pattern = re.compile(".*".join(re.escape(part) for part in message.split("...")) + r"\Z")
    ours = [line for line in r.stderr.splitlines() if line.startswith("distzo: error:")]
    assert len(ours) == ranks, r.stderr[-3000:]
    for line in ours:
        assert pattern.match(line), f"\n got: {line}\nwant: {message}"
