"""The stock attention module of each decoder layer, and the keyword under which it takes a KV cache.

Prefix tuning (distzo/peft/prefix.py) and the decode cache (distzo/models/kv_cache.py) both hand a
layer's attention a stand-in for transformers' cache through that keyword, from a forward pre-hook:
the stock attention calls `cache.update(keys, values, layer_idx, ...)` after its projections and
rotary embedding and attends to what it returns.
"""

from __future__ import annotations

import inspect

from torch import nn

from ..errors import DistzoError

CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past")  # newest first


def cache_argument(module: nn.Module) -> str | None:
    """The name under which a stock module (an attention, or the model itself) takes its cache
    (None: it takes none): `cache` from transformers 5.24 on (which still accepts, but overrides, the
    older `past_key_values`), `past_key_values` before, `layer_past` in GPT-NeoX and Falcon."""
    params = inspect.signature(module.forward).parameters
    return next((name for name in CACHE_ARGUMENTS if name in params), None)


def hand_cache(kwargs: dict, argument: str, cache) -> None:
    """An attention pre-hook's keywords, with `cache` under the module's cache keyword (`argument`)
    and under no other (a stock layer may pass one it holds under an older name)."""
    for name in CACHE_ARGUMENTS:
        kwargs.pop(name, None)
    kwargs[argument] = cache


def attention_modules(model: nn.Module, what: str, fix: str) -> list[nn.Module]:
    """The stock attention module of every decoder layer, in layer order: the layer's one child
    whose forward takes a cache. what / fix: who asks and what to do instead, for the error naming a
    layer with none or several."""
    from .generic import find_blocks

    out = []
    for layer in find_blocks(model)[1]:
        found = [child for _, child in layer.named_children() if cache_argument(child) is not None]
        if len(found) != 1:
            raise DistzoError(f"{what}: a {type(layer).__name__} layer of {model.config.model_type!r} has "
                              f"{len(found)} submodules that take a KV cache, not one attention to hand it to; {fix}")
        out.append(found[0])
    return out
