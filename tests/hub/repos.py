"""Repositories for the test hub, laid out like their public counterparts: a tiny causal LM (config,
safetensors weights, the embedded default's tokenizer) and a GLUE-like dataset whose `sst2` subset
holds SST-2's fields (`sentence`, `label`, `idx`) in Parquet split files listed by the card's
`configs`, beside a second subset the tests never fetch. The sentences are the bundled movie-review
set's, so the same records can also be written as GLUE's TSV files for the file reader."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from .server import folder_files

GLUE_CARD = """---
configs:
- config_name: cola
  data_files:
  - split: train
    path: cola/train-*
- config_name: sst2
  data_files:
  - split: train
    path: sst2/train-*
  - split: validation
    path: sst2/validation-*
  - split: test
    path: sst2/test-*
---
# A GLUE-like dataset for distzo's tests
"""


def tiny_model_files(folder: Path, init_seed: int = 0) -> dict[str, bytes]:
    """A random two-layer Llama with the embedded default's tokenizer, saved by save_pretrained."""
    from distzo.models.loading import load_tokenizer, random_model

    tokenizer = load_tokenizer("smollm2")
    random_model("llama", len(tokenizer), {}, init_seed, torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder_files(folder)


def sst2_records(n_train: int = 96, n_val: int = 48, n_test: int = 32) -> dict[str, list[dict]]:
    """SST-2-shaped records (sentence, label, idx) from the bundled movie-review sentences; the test
    split unlabelled (-1) as in GLUE."""
    import random

    from distzo.data.bundled import movie_reviews

    pool = random.Random(0).sample(movie_reviews(), n_train + n_val + n_test)  # both classes in every split
    rows = [{"sentence": r["sentence"], "label": int(r["label"])} for r in pool]
    splits = {"train": rows[:n_train], "validation": rows[n_train:n_train + n_val],
              "test": [dict(r, label=-1) for r in rows[n_train + n_val:]]}
    return {name: [dict(r, idx=i) for i, r in enumerate(rs)] for name, rs in splits.items()}


def _parquet(records: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), buf)
    return buf.getvalue()


def glue_files(records: dict[str, list[dict]]) -> dict[str, bytes]:
    """The dataset repository: card, sst2's three split files, cola's one."""
    files = {"README.md": GLUE_CARD.encode()}
    for split, rows in records.items():
        files[f"sst2/{split}-00000-of-00001.parquet"] = _parquet(rows)
    files["cola/train-00000-of-00001.parquet"] = _parquet([{"sentence": "a sentence", "label": 1, "idx": 0}])
    return files


def glue_tsv_folder(records: dict[str, list[dict]], folder: Path) -> Path:
    """The same records as GLUE's SST-2 distribution writes them: train.tsv and dev.tsv (the labelled
    splits; GLUE's test.tsv has no labels and is left out, as the file reader then uses dev as test)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, split in (("train", "train"), ("dev", "validation")):
        lines = ["sentence\tlabel"] + [f"{r['sentence']}\t{r['label']}" for r in records[split]]
        (folder / f"{name}.tsv").write_text("\n".join(lines) + "\n")
    return folder
