"""The hub's pieces without a server: which names are hub ids, which files of a model repository a load
reads, a dataset card's subsets and a repository's split files (as fetched, or as a local copy), and
the one-line messages of the hub's typed errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distzo import hub
from distzo.data.records import DataError, card_configs, read_records, repository_patterns
from distzo.models.loading import MODEL_SETTING, repository_files

CARD = """---
license: other
configs:
- config_name: mnli
  data_files:
  - split: train
    path: mnli/train-*
  - split: validation_matched
    path: mnli/validation_matched-*
- config_name: sst2
  default: true
  data_files:
  - split: train
    path: sst2/train-*
  - split: validation
    path: sst2/validation-*
---
# card
"""


def test_hub_ids_are_names_that_are_not_paths(tmp_path, monkeypatch):
    assert hub.is_hub_id("Qwen/Qwen2.5-0.5B") and hub.is_hub_id("gpt2") and hub.is_hub_id("nyu-mll/glue")
    assert hub.is_hub_id("aps/super_glue") and hub.is_hub_id("HuggingFaceTB/SmolLM2-135M")
    for path in ("/models/x", "./x", "../x", "~/x", "reviews.csv", "data/train.jsonl", "a/b/c", "a--b/c", "org/.x",
                 "", None):
        assert not hub.is_hub_id(path), path
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "tiny").mkdir(parents=True)
    assert not hub.is_hub_id("acme/tiny")  # an existing local folder wins over a hub id of the same name


def test_a_model_repository_is_read_as_transformers_reads_it():
    files = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json", "merges.txt", "vocab.json", "README.md",
             ".gitattributes", "pytorch_model.bin", "onnx/model.onnx", "original/consolidated.00.pth",
             "gguf/model-q4.gguf", "chat_template.jinja", "tokenizer.model"]
    chosen = repository_files(files, MODEL_SETTING, "org/m")
    assert set(chosen) == {"config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                           "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
                           "tokenizer_config.json", "special_tokens_map.json", "merges.txt", "vocab.json",
                           "chat_template.jinja", "tokenizer.model"}  # safetensors over .bin; no subfolders
    assert "pytorch_model.bin" in repository_files(["config.json", "pytorch_model.bin"], MODEL_SETTING, "org/m")
    tokenizer_only = repository_files(files, MODEL_SETTING, "org/m", weights=False)
    assert not any(f.endswith((".safetensors", ".bin")) for f in tokenizer_only) and "tokenizer.json" in tokenizer_only
    with pytest.raises(hub.HubError, match=r"model.path='org/m' has no weights transformers reads"):
        repository_files(["config.json", "model.gguf"], MODEL_SETTING, "org/m")
    with pytest.raises(hub.HubError, match=r"has no config.json at its top level"):
        repository_files(["README.md"], MODEL_SETTING, "org/m")


def test_a_dataset_card_lists_its_subsets_and_their_files(tmp_path):
    card = tmp_path / "README.md"
    card.write_text(CARD)
    configs = card_configs(card)
    assert configs["sst2"] == {"train": ["sst2/train-*"], "validation": ["sst2/validation-*"]}
    assert configs[""] is configs["sst2"]  # the default subset
    assert repository_patterns(card, None, "x") == ["README.md", "sst2/train-*", "sst2/validation-*"]
    assert repository_patterns(card, "mnli", "x") == ["README.md", "mnli/train-*", "mnli/validation_matched-*"]
    with pytest.raises(DataError, match=r"task.subset='qnli': x has no such subset; it has mnli, sst2"):
        repository_patterns(card, "qnli", "x")
    plain = tmp_path / "plain.md"
    plain.write_text("# no header\n")
    assert card_configs(plain) == {} and repository_patterns(plain, None, "x") is None
    with pytest.raises(DataError, match=r"task.subset='sst2': x has no subsets"):
        repository_patterns(plain, "sst2", "x")
    two = tmp_path / "two.md"
    two.write_text(CARD.replace("  default: true\n", ""))
    with pytest.raises(DataError, match=r"x has several subsets \(mnli, sst2\); name one with task.subset=NAME"):
        repository_patterns(two, None, "x")


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_local_copy_of_a_dataset_repository_reads_its_subsets_splits(tmp_path):
    """A repository's layout read from disk, as after a fetch: the card's subset files, the usual split
    spellings, task.split_names for the others, sharded files concatenated in order."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text(CARD.replace("-*", "-*.jsonl"))
    _jsonl(repo / "sst2" / "train-00000-of-00002.jsonl", [{"sentence": "a", "label": 1}])
    _jsonl(repo / "sst2" / "train-00001-of-00002.jsonl", [{"sentence": "b", "label": 0}])
    _jsonl(repo / "sst2" / "validation-00000-of-00001.jsonl", [{"sentence": "c", "label": 1}])
    _jsonl(repo / "mnli" / "train-00000-of-00001.jsonl", [{"premise": "p", "label": 2}])
    _jsonl(repo / "mnli" / "validation_matched-00000-of-00001.jsonl", [{"premise": "q", "label": 0}])
    parts = read_records(str(repo), subset="sst2")
    assert parts == {"train": [{"sentence": "a", "label": 1}, {"sentence": "b", "label": 0}],
                     "validation": [{"sentence": "c", "label": 1}]}
    assert read_records(str(repo)) == parts  # the default subset
    mnli = read_records(str(repo), subset="mnli", split_names={"validation": "validation_matched"})
    assert mnli == {"train": [{"premise": "p", "label": 2}], "validation": [{"premise": "q", "label": 0}]}
    with pytest.raises(DataError, match=r"task.split_names.test='test_matched': .* has no split 'test_matched'"):
        read_records(str(repo), subset="mnli", split_names={"test": "test_matched"})
    # no card: files whose names say their split, in any subfolder (google/boolq's data/train-*.parquet)
    bare = tmp_path / "bare"
    _jsonl(bare / "data" / "train-00000-of-00001.jsonl", [{"x": 1}])
    _jsonl(bare / "data" / "validation-00000-of-00001.jsonl", [{"x": 2}])
    assert read_records(str(bare)) == {"train": [{"x": 1}], "validation": [{"x": 2}]}


class _Response:
    """What huggingface_hub's HTTP errors read of a response."""

    status_code = 500
    headers: dict = {}
    request = None


def test_the_hubs_errors_are_one_line_naming_the_setting_and_the_fix(monkeypatch):
    from huggingface_hub import constants, errors

    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.example")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    setting = hub.Setting("model.path", "model.revision")

    def line(exc, revision="main", kind="model"):
        return str(hub.explain(exc, kind, "org/m", revision, setting))

    def http(cls, message="x"):
        try:
            return cls(message, response=_Response())
        except TypeError:
            return cls(message)

    assert line(http(errors.GatedRepoError)).startswith(
        "model.path='org/m' is a gated repository on https://hub.example: accept its conditions at "
        "https://hub.example/org/m, then log in")
    assert line(http(errors.RevisionNotFoundError), "v2") == (
        "model.revision='v2': org/m has no such branch, tag or commit on https://hub.example; name one it has, or "
        "leave model.revision unset for its default branch")
    assert "is neither a local folder nor a model repository on https://hub.example" in line(
        http(errors.RepositoryNotFoundError))
    assert "is neither a local file or folder nor a dataset repository" in line(
        http(errors.RepositoryNotFoundError), kind="dataset")
    assert "cannot reach the hub at https://hub.example (ConnectionRefusedError: refused)" in line(
        ConnectionRefusedError("refused"))
    assert "the hub at https://hub.example answered 500" in line(http(errors.HfHubHTTPError, "server error"))
    assert "cannot write the hub cache" in line(PermissionError(13, "Permission denied"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert "is not in the hub cache" in line(errors.LocalEntryNotFoundError("not cached")) and "HF_HUB_OFFLINE" in line(
        errors.LocalEntryNotFoundError("not cached"))
    for exc in (http(errors.GatedRepoError), ConnectionRefusedError("x"), errors.LocalEntryNotFoundError("x")):
        assert "\n" not in line(exc)
