"""Build the model and tokenizer a config names: the embedded default, a random config, or a local folder."""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from .assets import WHEEL_MODELS, smollm2_folder, wheel_model_folder

log = logging.getLogger(__name__)

# The shapes of random models (model=tiny is the llama entry); `model.arch_config` overrides any field.
_RANDOM_BASE: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, sliding_window=8, tie_word_embeddings=False),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True),
    "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=512, word_embed_proj_dim=64, tie_word_embeddings=True),
    # Families on the general path (distzo.models.generic).
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=0, eos_token_id=0),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=512, rotary_pct=0.5, tie_word_embeddings=False),
    "phi3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=0,
                 eos_token_id=0, tie_word_embeddings=False),
    "phi": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=512, bos_token_id=0, eos_token_id=0),  # its LM head has a bias
    "gemma3_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=8,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                        tie_word_embeddings=True),
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
                   bos_token_id=0, eos_token_id=0),
    "stablelm": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False),
}


def check_weight_files(folder: str | Path, key: str = "model.path") -> None:
    """Every weights file of a model folder is whole, read from headers only (no tensor is loaded):
    a safetensors file holds the header its first 8 bytes announce and every tensor's bytes that
    header lists; a shard index names only files that exist. A copy cut short or overwritten then
    costs one line naming the file, not a loader's traceback."""
    folder = Path(folder)
    for index in folder.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{key}={str(folder)!r}: the shard index {index.name} is unreadable ({exc}); copy the "
                              "model folder again, or save it again with save_pretrained") from None
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise ConfigError(f"{key}={str(folder)!r}: the shard index {index.name} names {missing[:3]}, which "
                              "the folder lacks; copy the missing shards into it")
    for path in sorted(folder.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem:
            raise ConfigError(f"{key}={str(folder)!r}: {path.name} is {problem}; copy the model folder again (or "
                              "save it again with save_pretrained)")


def _safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be whole (None: its header and sizes agree)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"{size} bytes long, too short for a safetensors file (truncated)"
            length = struct.unpack("<Q", head)[0]
            if length > size - 8:
                return f"truncated or not a safetensors file (its header claims {length} bytes, the file has {size})"
            header = json.loads(fh.read(length))
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    except (ValueError, UnicodeDecodeError):
        return "corrupt (its header is not the JSON a safetensors file starts with)"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
            and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2]
    need = 8 + length + max(ends, default=0)
    if size < need:
        return f"truncated ({size} bytes; its header lists tensors up to byte {need})"
    return None


def load_tokenizer(spec: str | None):
    """A tokenizer from a preset name ("smollm2") or a local folder."""
    from transformers import AutoTokenizer

    if spec in (None, "smollm2"):
        folder = smollm2_folder()
    else:
        folder = os.path.expanduser(spec)
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError, EnvironmentError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ConfigError(f"cannot read a tokenizer from {folder} ({type(exc).__name__}: {reason}); the folder needs the "
                          "files a tokenizer's save_pretrained writes (tokenizer.json, or the vocabulary files and "
                          "tokenizer_config.json), or name another folder with model.tokenizer=PATH") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def random_model(arch: str, vocab_size: int, overrides: dict[str, Any], init_seed: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu"):
    """A randomly initialised stock model. Seeded, so every rank builds bit-identical weights.
    device="meta" builds the structure only (instant): validation uses it to check shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(_RANDOM_BASE[arch])
    settings.update(overrides)
    settings.setdefault("vocab_size", vocab_size)
    try:
        config = AutoConfig.for_model(arch, **settings)
        config._attn_implementation = "sdpa"
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(init_seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, TypeError, RuntimeError, AttributeError) as exc:
        raise ConfigError(f"model.arch_config={overrides} does not make a valid {arch} model: {exc}") from None
    return model.eval()  # dropout off: ZO forwards must be deterministic


def load_model(cfg) -> tuple[torch.nn.Module, Any]:
    """(model in eval mode with dropout off, tokenizer) for a ModelConfig."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, cfg.dtype)  # one of config.DTYPES
    if cfg.source == "random":
        tok = load_tokenizer(cfg.tokenizer)
        model = random_model(cfg.arch, len(tok), dict(cfg.arch_config), cfg.init_seed, dtype)
    else:
        folder = wheel_model_folder(cfg.source) if cfg.source in WHEEL_MODELS else os.path.expanduser(cfg.path)
        tok = load_tokenizer(cfg.tokenizer or str(folder))
        check_weight_files(folder)
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:  # safetensors, torch.load, config errors
            reason = " ".join(str(exc).split())[:200]
            raise ConfigError(f"cannot load the model in {folder} ({type(exc).__name__}: {reason}); check that the "
                              "folder is a complete save_pretrained copy of a causal LM") from None
    # ZO forwards must be deterministic: dropout off (MeZO runs its forwards in eval mode too).
    model.eval()
    model.requires_grad_(True)
    n = sum(p.numel() for p in model.parameters())
    log.info("Model %s: %s, %.1fM parameters, %s", cfg.name, type(model).__name__, n / 1e6, cfg.dtype)
    return model, tok
