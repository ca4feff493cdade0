"""A user's own files through the command line with no task settings beyond the file: a 300-row CSV
classifies with the default split sizes chosen for it, and SFT data in the standard layouts
(prompt / completion, a chat's messages, plain text) trains with `task.kind=generation` alone."""

from __future__ import annotations

import csv
import json
import random

import pytest

from distzo.telemetry.jsonl import read_jsonl
from tests.distributed.launch import run_forked

RUN = ["model=tiny", "steps=2", "eval_every=0", "checkpoint.every=0"]
WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "river", "stone"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train(tmp_path, name, *overrides):
    run = tmp_path / name
    r = run_forked(1, ["train", *RUN, *overrides, f"hydra.run.dir={run}"], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    evals = [m for m in read_jsonl(run / "metrics.jsonl") if m["type"] == "eval"]
    return json.loads((run / "summary.json").read_text()), evals, r.stdout


def test_a_300_row_csv_trains_with_task_custom_alone(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "reviews.csv"
    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["text", "label"])
        for i in range(300):
            out.writerow([" ".join(rng.choices(WORDS, k=5)), i % 2])
    summary, evals, stdout = train(tmp_path, "csv", "task=custom", f"task.path={path}")
    assert "240 train / 30 validation / 30 test examples" in stdout
    assert [e["examples"] for e in evals] == [30, 30, 30]  # validation before and after, then test
    assert summary["test_accuracy"] == evals[-1]["accuracy"] and (evals[-1]["accuracy"] * 30) % 1 == 0


PAIRS = [(" ".join(random.Random(i).sample(WORDS, 2)), i) for i in range(300)]
LAYOUTS = {
    "prompt-completion": [{"prompt": f"Repeat: {p}\n", "completion": p} for p, _ in PAIRS],
    "messages": [{"messages": [{"role": "user", "content": f"Repeat {p}"}, {"role": "assistant", "content": p}]}
                 for p, _ in PAIRS],
    "text": [{"text": f"the words {p} again"} for p, _ in PAIRS],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sft_layouts_train_with_task_kind_generation_alone(tmp_path, layout):
    path = write_jsonl(tmp_path / f"{layout}.jsonl", LAYOUTS[layout])
    summary, evals, stdout = train(tmp_path, layout, "task=custom", "task.kind=generation", f"task.path={path}")
    assert "240 train / 30 validation / 30 test examples" in stdout
    last = evals[-1]
    assert last["split"] == "test" and last["examples"] == 30
    assert summary["test_perplexity"] == last["perplexity"] and last["perplexity"] > 1
    if layout == "text":  # language modelling: nothing decoded, perplexity is the result
        assert last["accuracy"] is None and "f1" not in last and summary["test_accuracy"] is None
        assert "test perplexity" in stdout
    else:
        assert summary["test_f1"] == last["f1"] and 0 <= last["exact_match"] <= last["f1"] <= 1
        assert "test exact match" in stdout
