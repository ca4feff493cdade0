"""Prefix tuning as forward pre-hooks on the stock attention modules (MeZO appendix E.5).

Every attention module gains `prefix_keys` and `prefix_values` [kv_heads, m, head_dim]: m trainable
key/value vectors that every query attends to before the prompt's own tokens. A pre-hook hands the
module a two-method stand-in for a KV cache whose `update` prepends them (the stock attention calls
`past_key_values.update(k, v, layer_idx)` after its projections and rotary embedding), and widens
the attention mask by m always-visible columns.

Initialisation from real activations, which MeZO found crucial for stable ZO prefix tuning: m random
vocabulary tokens go through the frozen model once and their keys and values at every layer become
the prefix. Rotary models compute them at positions -m..-1, so a prompt token at position t sees
prefix j at relative distance t + m - j > 0, exactly as if the prompt followed the m tokens (the
packed prompts keep their positions from 0). Models with learned absolute positions (OPT) compute
them at 0..m-1, the positions they hold in that forward.
"""

from __future__ import annotations

import torch
from torch import nn


class _PrefixKV:
    """What the attention module sees as its cache: prepends the prefix to the keys and values."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx=None, *args, **kwargs):
        R = key_states.shape[0]
        k = self.keys.to(key_states.dtype).unsqueeze(0).expand(R, -1, -1, -1)
        v = self.values.to(value_states.dtype).unsqueeze(0).expand(R, -1, -1, -1)
        return torch.cat([k, key_states], dim=2), torch.cat([v, value_states], dim=2)


def _widen_mask(mask, rows: int, length: int, m: int, dtype: torch.dtype, device: torch.device):
    """The attention mask with m leading columns every query may attend to (bool: True attends;
    float: additive, 0 attends). No mask means plain causal attention."""
    if mask is None:
        mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None].expand(rows, 1, -1, -1)
    lead_shape = (*mask.shape[:-1], m)
    lead = torch.ones(lead_shape, dtype=torch.bool, device=mask.device) if mask.dtype == torch.bool \
        else torch.zeros(lead_shape, dtype=mask.dtype, device=mask.device)
    return torch.cat([lead, mask], dim=-1)


def cache_argument(attention: nn.Module) -> str:
    """The name under which the stock attention takes its cache: `cache` from transformers 5.24 on
    (which still accepts, but overrides, the older `past_key_values`), `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(attention.forward).parameters else "past_key_values"


def _prefix_pre_hook(module: nn.Module, args, kwargs):
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    m = module.prefix_keys.shape[1]
    for name in ("cache", "past_key_values"):
        kwargs.pop(name, None)
    kwargs[module.prefix_cache_argument] = _PrefixKV(module.prefix_keys, module.prefix_values)
    kwargs["attention_mask"] = _widen_mask(kwargs.get("attention_mask"), hidden.shape[0], hidden.shape[1], m,
                                           hidden.dtype, hidden.device)
    return args, kwargs


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The stock attention module of every decoder layer, in layer order."""
    base = model.model.decoder if hasattr(model.model, "decoder") else model.model
    return [layer.self_attn for layer in base.layers]


@torch.no_grad()
def attach_prefix(model: nn.Module, m: int, init_seed: int) -> None:
    """Give every attention layer m trainable key/value vectors from the real activations of m random
    tokens (seeded: every rank builds the same prefix)."""
    gen = torch.Generator().manual_seed(init_seed)
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    tokens = torch.randint(0, vocab, (1, m), generator=gen).to(device)
    rotary = hasattr(model.model, "rotary_emb")
    positions = torch.arange(-m, 0, device=device)[None] if rotary else None
    cache = model(input_ids=tokens, position_ids=positions, use_cache=True).past_key_values
    for i, attn in enumerate(attention_modules(model)):
        layer = cache.layers[i]
        attn.register_parameter("prefix_keys", nn.Parameter(layer.keys[0].clone().contiguous()))
        attn.register_parameter("prefix_values", nn.Parameter(layer.values[0].clone().contiguous()))
        attn.prefix_cache_argument = cache_argument(attn)
        attn.register_forward_pre_hook(_prefix_pre_hook, with_kwargs=True)


def has_prefix(model: nn.Module) -> bool:
    """Whether prefix tuning's hooks are attached (generation then decodes without a KV cache)."""
    return any(hasattr(m, "prefix_keys") for m in model.modules())
