"""Build the model and tokenizer a config names: the embedded default, a random config, a local folder,
or a hub repository (fetched into the hub cache at one commit, then read from there like a folder)."""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import struct
import time
from pathlib import Path
from typing import Any, Mapping

import torch
from huggingface_hub.errors import StrictDataclassError

from .. import hub
from ..config.schema import ModelConfig
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


MODEL_SETTING = hub.Setting("model.path", "model.revision")
TOKENIZER_SETTING = hub.Setting("model.tokenizer", "model.tokenizer")
# What transformers reads of a model repository's top level besides the weights: the configuration,
# the tokenizer (tokenizer.json, vocabularies, merges, SentencePiece and tiktoken files) and a chat
# template. Subfolders (onnx/, original/, gguf variants) are never fetched.
_SIDE_FILES = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")


def repository_files(files: list[str], setting: hub.Setting, repo_id: str, weights: bool = True) -> tuple[str, ...]:
    """The files of a model repository a load reads (`weights=False`: a tokenizer's only): the
    top-level configuration and tokenizer files, and the safetensors weights (PyTorch's .bin files
    where a repository has no safetensors)."""
    top = [f for f in files if "/" not in f]
    chosen = [f for f in top if any(fnmatch.fnmatch(f, p) for p in _SIDE_FILES)]
    if weights:
        if "config.json" not in top:
            raise hub.HubError(f"{setting.key}={repo_id!r} has no config.json at its top level, so it is not a "
                               "transformers model repository; name the repository of the model itself")
        tensors = [f for f in top if f.endswith(".safetensors")] or [f for f in top if f.endswith(".bin")]
        if not tensors:
            raise hub.HubError(f"{setting.key}={repo_id!r} has no weights transformers reads (*.safetensors or "
                               "pytorch_model*.bin at its top level; GGUF or ONNX files are not read); name a "
                               "repository with safetensors weights")
        chosen += tensors
    return tuple(sorted(set(chosen)))


def model_fetches(m, recorded: Mapping[str, hub.Pin] | None = None) -> list[hub.Fetch]:
    """What to fetch from the hub for a model configuration (one metadata request per repository):
    the model named by `model.path` (at `model.revision`), and a tokenizer named by `model.tokenizer`;
    [] when both are local. recorded: the pins an earlier run of this configuration read."""
    recorded = recorded or {}
    out = []
    if str(m.source) == "local" and hub.is_hub_id(m.path):
        pin, files = hub.resolve("model", str(m.path), m.revision, MODEL_SETTING, recorded.get("model"))
        out.append(hub.Fetch("model", pin, repository_files(files, MODEL_SETTING, str(m.path)), MODEL_SETTING))
    if _hub_tokenizer(m.tokenizer):
        out.append(tokenizer_fetch(str(m.tokenizer), recorded.get("tokenizer")))
    return out


def tokenizer_fetch(repo_id: str, recorded: hub.Pin | None = None) -> hub.Fetch:
    """A tokenizer repository's tokenizer files (at its default branch, or the recorded commit)."""
    pin, files = hub.resolve("model", repo_id, None, TOKENIZER_SETTING, recorded)
    return hub.Fetch("tokenizer", pin, repository_files(files, TOKENIZER_SETTING, repo_id, weights=False),
                     TOKENIZER_SETTING)


def _hub_tokenizer(spec: Any) -> bool:
    return spec not in (None, "smollm2") and hub.is_hub_id(spec)


def _hub_folder(role: str, fetches: list[hub.Fetch], pins: Mapping[str, hub.Pin] | None, setting: hub.Setting) -> Path:
    """The cached snapshot of a hub model or tokenizer: the pinned commit (fetched already), or
    fetched here when nothing is pinned (a process on its own)."""
    pin = (pins or {}).get(role)
    if pin is None:
        pin = hub.fetch_here(f for f in fetches if f.role == role)[role]
    return hub.cached_folder(pin, setting)


ENCODER_ONLY = ("bert", "roberta", "deberta", "deberta-v2", "distilbert", "electra", "albert", "xlm-roberta",
                "t5", "mt5", "bart", "mbart", "pegasus", "marian", "whisper", "vit")


# What transformers raises for a configuration it refuses: its own checks raise ValueError (and the
# like), the configurations' strict-dataclass validators huggingface_hub's StrictDataclassError.
CONFIG_ERRORS = (OSError, ValueError, TypeError, KeyError, RuntimeError, StrictDataclassError)


def config_reason(exc: BaseException) -> str:
    """Why a configuration was refused, in one line: a strict-dataclass validator's own error, which
    huggingface_hub wraps in a message of several lines naming the validator."""
    inner = exc.__cause__ if isinstance(exc, StrictDataclassError) and exc.__cause__ is not None else exc
    return f"{type(inner).__name__}: {' '.join(str(inner).split())[:200]}"


def _readable_dir(path: str, key: str, what: str) -> Path:
    folder = Path(os.path.expanduser(path))
    if not folder.is_dir():
        raise ConfigError(f"{key}={path!r} does not exist or is not a folder; pass the folder of {what}")
    if not os.access(folder, os.R_OK | os.X_OK):
        raise ConfigError(f"{key}={path!r} is not readable by this user; fix its permissions or copy it elsewhere")
    return folder


def check_local_model(path: str, shown: str | None = None) -> None:
    """A transformers causal-LM folder: config.json readable and valid, a causal-LM architecture,
    weights present. shown: the name messages give it (a hub id, for its cached snapshot)."""
    folder = _readable_dir(path, "model.path", "a local transformers causal LM (config.json plus weights), or "
                           "a hub id (org/name)")
    path = shown or path
    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError(f"model.path={path!r} has no config.json; it must be a transformers model folder "
                          "(as written by save_pretrained)")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"model.path={path!r}: cannot read config.json ({exc}); it must be the JSON that "
                          "save_pretrained writes") from None
    if model_type in ENCODER_ONLY:
        raise ConfigError(f"model.path={path!r} holds a {model_type!r} model, which is not a decoder-only causal LM; "
                          "distzo fine-tunes AutoModelForCausalLM models")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"model.path={path!r} holds a {model_type!r} model, which this transformers release has "
                          "no causal-LM class for (AutoModelForCausalLM); upgrade transformers, or convert the "
                          "model to a supported architecture")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ConfigError(f"model.path={path!r} has no weights (*.safetensors or *.bin); save the model with "
                          "save_pretrained into that folder")
    check_weight_files(folder, shown=shown)
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(folder)  # its checks (a hidden size the heads divide, ...) before anything loads
    except CONFIG_ERRORS as exc:
        raise ConfigError(f"model.path={path!r}: its config.json is not a valid {model_type} configuration "
                          f"({config_reason(exc)}); fix it, or save the model again with save_pretrained") from None


def check_weight_files(folder: str | Path, key: str = "model.path", shown: str | None = None) -> None:
    """Every weights file of a model folder is whole, read from headers only (no tensor is loaded):
    a safetensors file holds the header its first 8 bytes announce and every tensor's bytes that
    header lists; a shard index names only files that exist. A copy cut short or overwritten then
    costs one line naming the file, not a loader's traceback."""
    folder = Path(folder)
    name = shown or str(folder)
    for index in folder.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{key}={name!r}: the shard index {index.name} is unreadable ({exc}); copy the "
                              "model folder again, or save it again with save_pretrained") from None
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise ConfigError(f"{key}={name!r}: the shard index {index.name} names {missing[:3]}, which "
                              "the folder lacks; copy the missing shards into it")
    for path in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem:
            raise ConfigError(f"{key}={name!r}: {path.name} is {problem}; copy the model folder again (or "
                              "save it again with save_pretrained)" + (_refetch(shown) if shown else ""))


def _refetch(repo_id: str) -> str:
    return (f"; for the hub's {repo_id}, delete its snapshot in the hub cache ({hub.hub_cache()}) so that the next "
            "run fetches it again")


def safetensors_problem(path: Path) -> str | None:
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


def load_tokenizer(spec: str | None, pin: hub.Pin | None = None):
    """A tokenizer from a preset name ("smollm2"), a local folder or a hub id (read from the cached
    snapshot of `pin`, or fetched here when no pin is given)."""
    from transformers import AutoTokenizer

    if spec in (None, "smollm2"):
        folder = smollm2_folder()
    elif _hub_tokenizer(spec):
        fetches = [] if pin is not None else [tokenizer_fetch(str(spec))]
        folder = _hub_folder("tokenizer", fetches, {"tokenizer": pin} if pin else None, TOKENIZER_SETTING)
    else:
        folder = os.path.expanduser(spec)
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except CONFIG_ERRORS as exc:  # a folder's config.json is read too (the tokenizer's class may come from it)
        raise ConfigError(f"cannot read a tokenizer from {folder} ({config_reason(exc)}); "
                          "the folder needs the files a tokenizer's save_pretrained writes (tokenizer.json, "
                          "or the vocabulary files and tokenizer_config.json), "
                          "or name another folder with model.tokenizer=PATH") from None
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
        on = torch.device(device)
        cuda = [on.index if on.index is not None else torch.cuda.current_device()] if on.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), on:
            torch.manual_seed(init_seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, TypeError, RuntimeError, AttributeError, StrictDataclassError) as exc:
        raise ConfigError(f"model.arch_config={overrides} does not make a valid {arch} model: "
                          f"{config_reason(exc)}") from None
    return model.eval()  # dropout off: ZO forwards must be deterministic


def model_folder(cfg: ModelConfig, pins: Mapping[str, hub.Pin] | None = None) -> Path:
    """The folder a (non-random) model configuration loads from: a wheel model's converted folder, a
    local folder, or a hub repository's cached snapshot (at the pinned commit; fetched here when
    nothing is pinned)."""
    if cfg.source in WHEEL_MODELS:
        return wheel_model_folder(cfg.source)
    if hub.is_hub_id(cfg.path):
        folder = _hub_folder("model", [] if pins and "model" in pins else model_fetches(cfg), pins, MODEL_SETTING)
        check_local_model(str(folder), shown=str(cfg.path))  # a causal LM with whole weights, as a local folder
        return folder
    return Path(os.path.expanduser(cfg.path))


def load_model(cfg: ModelConfig, pins: Mapping[str, hub.Pin] | None = None,
               device: torch.device | None = None) -> tuple[torch.nn.Module, Any]:
    """(model in eval mode with dropout off, tokenizer) for a ModelConfig. pins: the hub commits the
    run fetched (distzo.run.hub_pins), by role (model, tokenizer). device: the run's device, where a
    random model is drawn with model.init_device=device (None: cpu)."""
    from transformers import AutoModelForCausalLM

    pins = pins or {}
    dtype = getattr(torch, cfg.dtype)  # one of config.DTYPES
    if cfg.source == "random":
        tok = load_tokenizer(cfg.tokenizer, pins.get("tokenizer"))
        where = device if device is not None and str(cfg.init_device) == "device" else "cpu"
        started = time.perf_counter()
        model = random_model(cfg.arch, len(tok), dict(cfg.arch_config), cfg.init_seed, dtype, where)
        drawn = f", random weights drawn on {where} in {time.perf_counter() - started:.1f} s"
    else:
        drawn = ""
        folder = model_folder(cfg, pins)
        tok = load_tokenizer(cfg.tokenizer, pins.get("tokenizer")) if cfg.tokenizer else load_tokenizer(str(folder))
        check_weight_files(folder)
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        except (OSError, ValueError, RuntimeError, KeyError, StrictDataclassError) as exc:  # safetensors, configs
            raise ConfigError(f"cannot load the model in {folder} ({config_reason(exc)}); check that the "
                              "folder is a complete save_pretrained copy of a causal LM") from None
    # ZO forwards must be deterministic: dropout off (MeZO runs its forwards in eval mode too).
    model.eval()
    model.requires_grad_(True)
    n = sum(p.numel() for p in model.parameters())
    log.info("Model %s: %s, %.1fM parameters, %s%s", cfg.name, type(model).__name__, n / 1e6, cfg.dtype, drawn)
    return model, tok
