"""Build the model and tokenizer a config names: the embedded default, a random config, or a local folder."""

from __future__ import annotations

import logging
import os
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


def load_tokenizer(spec: str | None):
    """A tokenizer from a preset name ("smollm2") or a local folder."""
    from transformers import AutoTokenizer

    if spec in (None, "smollm2"):
        folder = smollm2_folder()
    else:
        folder = os.path.expanduser(spec)
    tok = AutoTokenizer.from_pretrained(folder)
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
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    # ZO forwards must be deterministic: dropout off (MeZO runs its forwards in eval mode too).
    model.eval()
    model.requires_grad_(True)
    n = sum(p.numel() for p in model.parameters())
    log.info("Model %s: %s, %.1fM parameters, %s", cfg.name, type(model).__name__, n / 1e6, cfg.dtype)
    return model, tok
