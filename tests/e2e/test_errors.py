"""Every row of docs/errors.md, run as written: exit status non-zero and exactly the documented line on
stderr (once per rank under torchrun)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distzo.config.compose import config_dir
from tests.distributed.launch import run_forked
from tests.hub.repos import glue_files, sst2_records, tiny_model_files
from tests.hub.server import HubServer, closed_endpoint

# PYTHONUNBUFFERED: the worst case for interleaved output of several ranks (print writes text and newline apart)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
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
def hub_server(tmp_path_factory):
    """The local hub of the rows that name $HUB (docs/errors.md says what it holds)."""
    root = tmp_path_factory.mktemp("error-hub")
    server = HubServer()
    server.add("model", "acme/tiny", tiny_model_files(root / "tiny"))
    server.add("model", "acme/gated", tiny_model_files(root / "gated"), gated=True)
    server.add("model", "acme/notes", {"README.md": b"# notes, no model\n"})
    server.add("dataset", "nyu-mll/glue", glue_files(sst2_records()))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def folders(tmp_path_factory, hub_server):
    root = tmp_path_factory.mktemp("error-fixtures")
    clip = root / "clip"  # an architecture with no causal-LM class
    clip.mkdir()
    (clip / "config.json").write_text(json.dumps({"model_type": "clip"}))
    mamba = root / "mamba"  # a recurrent causal LM: no path can score packed prompts with it
    from transformers import MambaConfig, MambaForCausalLM

    MambaForCausalLM(MambaConfig(hidden_size=16, num_hidden_layers=1, vocab_size=49152,
                                 state_size=4)).save_pretrained(mamba)
    used = root / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text('{"type": "train", "step": 1}\n')
    empty = root / "empty"  # a cache with nothing built in it
    empty.mkdir()
    other = root / "other"
    r = run_forked(1, ["train", "model=tiny", "task=synthetic-cue", "steps=2", "checkpoint.every=2", "eval_every=0",
                       "task.val_size=16", "task.test_size=16", f"hydra.run.dir={other}"], cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    broken_run = root / "broken-run"  # a run whose identity file was cut off, and no snapshot
    broken_run.mkdir()
    (broken_run / "run.json").write_text('{"model": ')
    no_weights = root / "no-weights"  # a llama config and nothing else
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"model_type": "llama"}))
    bad_config = root / "bad-config"
    bad_config.mkdir()
    (bad_config / "config.json").write_text('{"model_type": "llama", ')  # cut off mid-write
    no_final = root / "no-final"  # a finished run that saved no weights
    r = run_forked(1, ["train", "model=tiny", "task=synthetic-cue", "steps=1", "save_final=false", "eval_every=0",
                       "task.val_size=16", "task.test_size=16", f"hydra.run.dir={no_final}"], cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    no_snapshot = root / "no-snapshot"  # a finished run that wrote no snapshot
    r = run_forked(1, ["train", "model=tiny", "task=synthetic-cue", "steps=1", "checkpoint.every=0", "save_final=false",
                       "eval_every=0", "task.val_size=16", "task.test_size=16", f"hydra.run.dir={no_snapshot}"],
                   cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    from distzo.models.loading import load_tokenizer, random_model

    tokenizer = load_tokenizer("smollm2")
    good = root / "good-model"  # a complete save_pretrained folder, broken below in copies
    random_model("llama", len(tokenizer), {}, 0, torch.float32).save_pretrained(good)
    tokenizer.save_pretrained(good)
    broken = {}
    for name in ("truncated", "corrupt", "missing-shard", "bad-tokenizer"):
        broken[name] = root / name
        shutil.copytree(good, broken[name])
    weights = broken["truncated"] / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # a copy cut short
    weights = broken["corrupt"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:8] + b"x" * 16 + weights.read_bytes()[24:])  # its header overwritten
    (broken["missing-shard"] / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    (broken["bad-tokenizer"] / "tokenizer.json").write_text("{ not json")
    bad_shape = root / "bad-shape"  # a config.json that parses, with a hidden size the heads do not divide
    shutil.copytree(good, bad_shape)
    config = json.loads((bad_shape / "config.json").read_text())
    (bad_shape / "config.json").write_text(json.dumps({**config, "hidden_size": 999}))
    cut_adapter = root / "cut-adapter"  # a run whose final adapter was cut short
    shutil.copytree(other, cut_adapter)
    (cut_adapter / "final" / "model.safetensors").unlink()
    from safetensors.torch import save_file

    save_file({"lora_A": torch.zeros(64, 8)}, cut_adapter / "final" / "adapter.safetensors")
    os.truncate(cut_adapter / "final" / "adapter.safetensors", 100)
    bench_run = root / "bench-run"  # a directory a benchmark wrote
    bench_run.mkdir()
    (bench_run / "bench.json").write_text("{}\n")
    data = root / "data"
    data.mkdir()
    reviews = [{"text": f"review {i}", "label": "positive" if i % 2 else "negative"} for i in range(12)]
    write = lambda name, rows: (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))  # noqa: E731
    write("reviews.jsonl", reviews)
    write("odd-label.jsonl", reviews + [{"text": "so-so", "label": "mixed"}])
    write("quiz.jsonl",
          [{"q": f"q{i}", "options": ["a", "b"], "answer": 0} for i in range(8)] + [{"q": "x", "answer": 1}])
    (data / "not-json.jsonl").write_text('{"text": "a", "label": "negative"}\nthis is not JSON\n')
    (data / "nothing").mkdir()  # a folder with no data in it
    (data / "latin1.jsonl").write_bytes('{"text": "caf\u00e9", "label": 0}\n'.encode("latin-1"))  # not UTF-8
    (data / "empty.jsonl").write_text("")
    write("missing-text.jsonl", reviews + [{"label": "negative"}])  # the template's field missing in one record
    empty_test = data / "empty-test"  # a training file and an empty validation file (the test split)
    empty_test.mkdir()
    (empty_test / "train.jsonl").write_text((data / "reviews.jsonl").read_text())
    (empty_test / "val.jsonl").write_text("")
    shadowing = root / "shadowing-presets"  # your presets, one with a packaged preset's path
    (shadowing / "task").mkdir(parents=True)
    (shadowing / "task" / "mr-polarity.yaml").write_text((Path(config_dir()) / "task" / "mr-polarity.yaml").read_text())
    return {"$CLIP": str(clip), "$MAMBA": str(mamba), "$USED_RUN": str(used), "$OTHER_RUN": str(other),
            "$BROKEN_RUN": str(broken_run),
            "$EMPTY_DIR": str(empty),
            "$NO_WEIGHTS": str(no_weights), "$BAD_CONFIG": str(bad_config), "$NO_FINAL_RUN": str(no_final),
            "$NO_SNAPSHOT_RUN": str(no_snapshot),
            "$REVIEWS": str(data / "reviews.jsonl"), "$ODD_LABEL": str(data / "odd-label.jsonl"),
            "$QUIZ": str(data / "quiz.jsonl"), "$NOT_JSON": str(data / "not-json.jsonl"),
            "$EMPTY_TEST": str(empty_test), "$SHADOWING_PRESETS": str(shadowing),
            "$NO_DATA": str(data / "nothing"), "$TRUNCATED_MODEL": str(broken["truncated"]),
            "$CORRUPT_MODEL": str(broken["corrupt"]), "$MISSING_SHARD": str(broken["missing-shard"]),
            "$BAD_TOKENIZER": str(broken["bad-tokenizer"]), "$HUB": hub_server.url, "$NO_HUB": closed_endpoint(),
            "$BAD_SHAPE_MODEL": str(bad_shape), "$CUT_ADAPTER_RUN": str(cut_adapter), "$BENCH_RUN": str(bench_run),
            "$NOT_UTF8": str(data / "latin1.jsonl"), "$EMPTY_FILE": str(data / "empty.jsonl"),
            "$MISSING_FIELD": str(data / "missing-text.jsonl")}


def run(text: str, cwd: Path) -> tuple[subprocess.CompletedProcess, int]:
    """Run a documented command; returns its outcome and the number of ranks that must report.
    Leading NAME=value words set environment variables, as in a shell.

    `python -m distzo ...` rows run in a process forked from the test suite's preloaded server
    (`tests/distributed/launch.py`): the same `distzo.__main__.main(argv)`, exit status and
    stderr as the command line, without paying torch's and transformers' imports once per row (a
    forked rank re-reads huggingface_hub's settings from its environment, as a fresh process would).
    torchrun rows run their ranks the same way, with torchrun's worker environment and store,
    except the multirun row (`-m`), which runs the real torchrun: there all ranks write into one
    stderr pipe, where lines of several ranks could run into one another (issue 17)."""
    argv = shlex.split(text)
    env = {}
    while re.fullmatch(r"[A-Z_]+=.*", argv[0]):
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    if any(name.startswith("HF_") for name in env):
        # Rows about the hub: online where they name an endpoint (the suite runs offline), each with an
        # empty hub cache of its own.
        if "HF_ENDPOINT" in env:
            env.update(HF_HUB_OFFLINE=None, HF_DATASETS_OFFLINE=None)
        env["HF_HOME"] = str(cwd / "hf-home")
    if argv[0] == "python":
        assert argv[1:3] == ["-m", "distzo"], text
        return run_forked(1, argv[3:], cwd=cwd, timeout=300, env=env), 1
    assert argv[0] == "torchrun" and argv[1] == "--nproc-per-node"
    if "-m" not in argv[5:]:  # ranks forked as torchrun's agent starts them; the multirun row runs the real thing
        assert argv[3:5] == ["-m", "distzo"], text
        return run_forked(int(argv[2]), argv[5:], cwd=cwd, timeout=300, env=env), int(argv[2])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={argv[2]}"] + argv[3:]
    return subprocess.run(cmd, capture_output=True, text=True, env={**ENV, **env}, cwd=cwd, timeout=300), int(argv[2])


def trained(run_dir: Path) -> bool:
    """Whether the run in `run_dir` logged a training step (a run that failed before its first step,
    such as keep_best on a figure the data lacks, leaves nothing)."""
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and any(json.loads(line).get("type") == "train"
                                    for line in metrics.read_text().splitlines() if line.strip())


@pytest.mark.parametrize("mistake,cmd,message", ROWS, ids=[r[0] for r in ROWS])
def test_documented_error(tmp_path, folders, mistake, cmd, message):
    for key, value in folders.items():
        cmd = cmd.replace(key, value)
    r, ranks = run(cmd, tmp_path)
    assert r.returncode != 0
    if ranks == 1:
        assert r.returncode == 2
    pattern = re.compile(".*".join(re.escape(part) for part in message.split("...")) + r"\Z")
    ours = [line for line in r.stderr.splitlines() if line.startswith("distzo: error:")]
    assert len(ours) == ranks, r.stderr[-3000:]
    for line in ours:
        assert pattern.match(line), f"\n got: {line}\nwant: {message}"
    if ranks == 1:  # one line and nothing else: no traceback, and no run directory left behind
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        assert not (tmp_path / "multirun").exists()
        # (a run that started training keeps its directory: its snapshot is how it resumes)
        left = [p for p in (tmp_path / "outputs").glob("*/*") if not trained(p)]
        assert not left and (not (tmp_path / "outputs").exists() or any((tmp_path / "outputs").glob("*/*"))), left


def test_error_lines_of_several_processes_never_share_a_line(tmp_path):
    """Eight processes report at once into one pipe with unbuffered stderr (where print() writes a
    line's text and its newline separately): every line arrives whole."""
    code = ("import sys; from distzo.errors import write_error_line\n"
            "for i in range(200): write_error_line(f'rank {sys.argv[1]} line {i} ' + 'x' * 200)\n")
    script = tmp_path / "report.py"
    script.write_text(code)
    r = subprocess.run(["bash", "-c", " & ".join(f"{sys.executable} {script} {k}" for k in range(8)) + "; wait"],
                       capture_output=True, text=True, env={**ENV, "PYTHONUNBUFFERED": "1"}, timeout=120)
    lines = r.stderr.splitlines()
    assert len(lines) == 1600
    assert all(re.fullmatch(r"distzo: error: rank \d line \d+ x{200}", line) for line in lines)
