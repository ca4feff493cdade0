"""Prefix tuning as forward pre-hooks on the stock attention modules (MeZO appendix E.5), on any
decoder whose attention takes a KV cache and an attention mask as keywords.

Every attention module gains `prefix_keys` and `prefix_values` [kv_heads, m, head_dim]: m trainable
key/value vectors that every query attends to before the prompt's own tokens. A pre-hook hands the
module a two-method stand-in for a KV cache whose `update` prepends them (the stock attention calls
`past_key_values.update(k, v, layer_idx)` after its projections and rotary embedding), and widens
the attention mask by m always-visible columns.

Initialisation from real activations, which MeZO found crucial for stable ZO prefix tuning: m random
vocabulary tokens go through the frozen model once and their keys and values at every layer become
the prefix. Rotary models compute them at positions -m..-1, so a prompt token at position t sees
prefix j at relative distance t + m - j > 0, exactly as if the prompt followed the m tokens (the
packed prompts keep their positions from 0). Models with learned absolute positions (OPT, GPT-2)
compute them at 0..m-1, the positions they hold in that forward.

The attention modules are found from the model's structure: in each decoder layer (the general
path's `find_blocks`), the one child whose forward takes a cache (`cache`, `past_key_values` or
`layer_past`). When it is attached, the hooked model is checked against the stock forward given a
real cache of the prefix: an architecture whose attention builds on anything else (ALiBi biases
sized to the prompt, a mask passed positionally, a cache method the stand-in lacks) is refused by
name instead of training a wrong forward.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..errors import DistzoError
from ..models.attention import attention_modules, cache_argument, hand_cache

TOLERANCE = 1e-4  # float32 logits of O(1-10): the stand-in and a real cache run the same products


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


def _prefix_pre_hook(module: nn.Module, args, kwargs):
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    m = module.prefix_keys.shape[1]
    hand_cache(kwargs, module.prefix_cache_argument, _PrefixKV(module.prefix_keys, module.prefix_values))
    kwargs["attention_mask"] = _widen_mask(kwargs.get("attention_mask"), hidden.shape[0], hidden.shape[1], m,
                                           hidden.dtype, hidden.device)
    return args, kwargs


@torch.no_grad()
def attach_prefix(model: nn.Module, m: int, init_seed: int) -> None:
    """Give every attention layer m trainable key/value vectors from the real activations of m random
    tokens (seeded: every rank builds the same prefix), then check the hooked forward against the
    stock forward given those activations as a real cache."""
    gen = torch.Generator().manual_seed(init_seed)
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    tokens = torch.randint(0, vocab, (1, m), generator=gen).to(device)
    rotary = any(name.rsplit(".", 1)[-1] == "rotary_emb" for name, _ in model.named_modules())
    positions = torch.arange(-m, 0, device=device)[None] if rotary else None
    attentions = attention_modules(model, "peft=prefix", "use peft=lora or peft=lora_fa")
    cache = model(input_ids=tokens, position_ids=positions, use_cache=True).past_key_values
    # The prefix is visible to every token, also past a sliding window; the reference applies the
    # window to its cache, so the probe stays inside it.
    window = getattr(model.config, "sliding_window", None) or 0
    length = min(6, window - m) if window else 6
    if length < 1:
        raise DistzoError(f"peft.prefix_tokens={m} does not fit {model.config.model_type!r}'s sliding window of "
                          f"{window} tokens; use fewer prefix tokens")
    probe = torch.randint(0, vocab, (1, length), generator=gen).to(device)
    probe_positions = torch.arange(probe.shape[1], device=device)[None]
    try:  # the reference: the prompt after the m tokens, through a real cache
        expected = model(input_ids=probe, position_ids=probe_positions, use_cache=True,
                         **{cache_argument(model): copy.deepcopy(cache)}).logits
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure means the reference cannot be formed
        raise DistzoError(f"peft=prefix: {model.config.model_type!r} cannot continue a prompt from a KV cache "
                          f"({type(exc).__name__}: {exc}); use peft=lora or peft=lora_fa") from exc
    if len(getattr(cache, "layers", ())) != len(attentions):
        raise DistzoError(f"peft=prefix: {model.config.model_type!r}'s cache holds "
                          f"{len(getattr(cache, 'layers', ()))} layers for {len(attentions)} attention modules; "
                          "use peft=lora or peft=lora_fa")
    for i, attn in enumerate(attentions):
        layer = cache.layers[i]
        attn.register_parameter("prefix_keys", nn.Parameter(layer.keys[0].clone().contiguous()))
        attn.register_parameter("prefix_values", nn.Parameter(layer.values[0].clone().contiguous()))
        attn.prefix_cache_argument = cache_argument(attn)
        attn.register_forward_pre_hook(_prefix_pre_hook, with_kwargs=True)
    _check(model, probe, probe_positions, expected)


def _check(model: nn.Module, probe: torch.Tensor, positions: torch.Tensor, expected: torch.Tensor) -> None:
    """The hooked forward (the prefix through distzo's stand-in) against the stock forward through a
    real cache holding the same keys and values."""
    arch = model.config.model_type
    try:
        got = model(input_ids=probe, position_ids=positions, use_cache=False).logits
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - the attention relies on something the stand-in lacks
        raise DistzoError(f"peft=prefix: {arch!r} attention does not run with distzo's prefix stand-in "
                          f"({type(exc).__name__}: {exc}); use peft=lora or peft=lora_fa") from exc
    worst = float((got - expected).abs().max())
    if not worst <= TOLERANCE * max(1.0, float(expected.abs().max())):
        raise DistzoError(f"peft=prefix: on {arch!r} the hooked attention does not reproduce the stock forward "
                          f"after a cache of the prefix (largest logit difference {worst:.3g}); use peft=lora or "
                          "peft=lora_fa")


def prefix_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules carrying distzo's prefix (`attach_prefix`'s: prefix_keys beside the
    cache argument its hook fills)."""
    return [m for m in model.modules() if hasattr(m, "prefix_keys") and hasattr(m, "prefix_cache_argument")]


def has_prefix(model: nn.Module) -> bool:
    """Whether prefix tuning's hooks are attached (generation then decodes without a KV cache)."""
    return bool(prefix_modules(model))
