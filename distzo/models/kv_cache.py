"""Keys and values kept across the walks that decode a step's answers (objective=f1, exact_match).

A decoding objective generates each evaluation's answers token by token through the engine: one
walk of the model per token, every walk under the step's perturbations. Without a cache each walk
runs the whole prompt and what was generated so far again. With one, the first walk runs the
prompts (packed rows, as every walk did) and keeps every attention layer's keys and values; each
later walk runs only the newest token of each sequence, in the row its prompt has, and attends to
the kept columns of its own sequence. The logits differ from decoding without the cache at rounding
level (the same products over differently shaped keys), so the tokens are the same up to a near tie;
the engine checks it on the first decode of a run (`distzo.engine.decoding.Decoder`).

The cache reaches the stock attention as prefix tuning's does (distzo/models/attention.py): a
forward pre-hook on each decoder layer's attention hands it `LayerKV`, a stand-in whose `update`
appends the walk's keys and values and returns all of them, and replaces the attention mask of a
later walk with one built from where each kept column belongs: same sequence, not after the query,
within the layer's sliding window if it has one (as transformers' `sliding_window_overlay`:
query position - key position < window). Nothing is patched; the hooks do nothing outside a walk
that uses a cache.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..errors import DistzoError
from .attention import attention_modules, cache_argument, hand_cache

ATTENTIONS = ("sdpa", "eager")  # implementations that take an explicit [rows, 1, q, kv] mask tensor
LAYER_KINDS = ("full_attention", "sliding_attention")
# Windows described other than by `sliding_window` (GPT-Neo's local layers, Longformer-style configs).
UNMODELLED_WINDOWS = ("window_size", "attention_window", "local_window_size")


class LayerKV:
    """One attention layer's kept keys and values for one evaluation's rows ([rows, kv heads,
    columns, head dim]), in the place of transformers' cache."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self.keys is None:
            self.keys, self.values = key_states, value_states
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values


class DecodeKV:
    """One evaluation's cache across its decode walks: a `LayerKV` per attention layer, and for each
    kept column the sequence it belongs to and its position, from which each later walk's masks
    are built (`extend`). windows: each layer's sliding window (None: it attends to all of its
    sequence); additive: the dtype of an additive mask where the attention adds its mask to the
    scores (eager), for a call whose stock mask is None (None: boolean, sdpa's)."""

    def __init__(self, windows: Sequence[int | None], additive: torch.dtype | None = None):
        self.windows, self.additive = list(windows), additive
        self.layers = [LayerKV() for _ in self.windows]
        self.key_seq: torch.Tensor | None = None  # [rows, columns] sequence of each kept column (< 0: none)
        self.key_pos: torch.Tensor | None = None  # [rows, columns] its position
        self._visible: dict[int | None, torch.Tensor] = {}  # window -> [rows, 1, q, columns] bool, this walk's
        self._masks: dict[tuple, torch.Tensor] = {}
        self.forms: dict[int, str] = {}  # layer -> its stock mask's form (`mask_form`), from the first walk
        self.first = True

    @property
    def columns(self) -> int:
        return 0 if self.key_seq is None else self.key_seq.shape[1]

    def extend(self, seq: torch.Tensor, pos: torch.Tensor, first: bool) -> None:
        """The walk about to run: its columns' sequences (< 0: none; a padding column must have an id
        of its own, which only it matches) and positions [rows, q]. The first walk (the prompts)
        keeps the stock mask; a later one gets masks over every kept column and its own."""
        self.key_seq = seq if self.key_seq is None else torch.cat([self.key_seq, seq], dim=1)
        self.key_pos = pos if self.key_pos is None else torch.cat([self.key_pos, pos], dim=1)
        self._visible, self._masks, self.first = {}, {}, first
        if first:
            return
        same = self.key_seq[:, None, :] == seq[:, :, None]  # [rows, q, columns]
        behind = pos[:, :, None] - self.key_pos[:, None, :]  # query position - key position
        causal = same & (behind >= 0)
        for window in set(self.windows):
            visible = causal if window is None else causal & (behind < window)
            self._visible[window] = visible[:, None]

    def note_stock_mask(self, layer: int, like: Any) -> None:
        """The first walk's stock mask of `layer`, for the form of the later walks' (`mask_form`)."""
        if layer not in self.forms:
            self.forms[layer] = mask_form(like)

    def mask(self, layer: int, like: Any) -> Any:
        """Layer `layer`'s mask for this walk, in the form of the stock mask the first walk had
        (boolean, True attending or True masking; additive floats, 0 attending; None: boolean where
        the attention takes sdpa's masks, additive in `additive` where it adds its mask)."""
        window = self.windows[layer]
        visible = self._visible.get(window)
        if visible is None:
            return like
        form = self.forms.get(layer, "none")
        if form == "none":
            form = "additive" if self.additive is not None else "bool"
        dtype = like.dtype if isinstance(like, torch.Tensor) and form == "additive" else self.additive
        key = (window, form, dtype)
        if key not in self._masks:
            if form == "bool":
                self._masks[key] = visible
            elif form == "inverted":
                self._masks[key] = ~visible
            else:
                dtype = dtype or torch.float32
                zero = torch.zeros((), dtype=dtype, device=visible.device)
                self._masks[key] = zero.masked_fill(~visible, torch.finfo(dtype).min)
        return self._masks[key]


def mask_form(like: Any) -> str:
    """How a stock attention mask says "attend": "bool" (True), "inverted" (a boolean where True
    masks, as MPT's), "additive" (floats, 0), or "none" (no mask). Read at row 0's first token
    attending to itself, which every causal mask allows (a packed row starts with a sequence)."""
    if like is None:
        return "none"
    if not isinstance(like, torch.Tensor):
        raise TypeError(f"a {type(like).__name__} attention mask, not a [rows, heads, queries, keys] tensor")
    if like.dim() < 2:
        raise TypeError(f"an attention mask of {like.dim()} dimension(s), not [rows, heads, queries, keys]")
    first = like[(0,) * (like.dim() - 2) + (0, 0)]
    if like.dtype == torch.bool:
        return "bool" if bool(first) else "inverted"
    if like.is_floating_point() and float(first) == 0.0:
        return "additive"
    raise TypeError(f"an attention mask of {like.dtype} whose first token does not attend to itself")


class KVHooks:
    """The pre-hooks on every decoder layer's attention that hand it the active `DecodeKV`'s layer
    (`using`); outside `using` they return at once."""

    def __init__(self, attentions: Sequence[nn.Module], windows: Sequence[int | None],
                 additive: torch.dtype | None = None):
        self.windows, self.additive = list(windows), additive
        self.active: DecodeKV | None = None
        self._handles = []
        for i, attention in enumerate(attentions):
            argument = cache_argument(attention)
            self._handles.append(attention.register_forward_pre_hook(
                lambda m, a, kw, i=i, argument=argument: self._hand_over(i, argument, a, kw), with_kwargs=True))

    def _hand_over(self, layer: int, argument: str, args, kwargs):
        kv = self.active
        if kv is None:
            return None
        hand_cache(kwargs, argument, kv.layers[layer])
        if kv.first:
            kv.note_stock_mask(layer, kwargs.get("attention_mask"))
        else:
            kwargs["attention_mask"] = kv.mask(layer, kwargs.get("attention_mask"))
        return args, kwargs

    def new(self) -> DecodeKV:
        return DecodeKV(self.windows, self.additive)

    @contextmanager
    def using(self, kv: DecodeKV) -> Iterator[None]:
        self.active = kv
        try:
            yield
        finally:
            self.active = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def layer_windows(config: Any, layers: int) -> list[int | None]:
    """Each layer's sliding window, as the adapters read it: `layer_types` where the config has them,
    else `sliding_window` for every layer where it is set."""
    window = getattr(config, "sliding_window", None)
    window = int(window) if window else None
    types = getattr(config, "layer_types", None)
    if types:
        return [window if kind == "sliding_attention" else None for kind in list(types)[:layers]]
    return [window] * layers


def unsupported_reason(model: nn.Module, blocks: int) -> str | None:
    """Why the decode cache cannot run on this model's structure (None: it can). The engine also
    rules out attention modules that take another stand-in (peft=prefix's)."""
    config = model.config
    arch = getattr(config, "model_type", type(model).__name__)
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if attn not in ATTENTIONS:
        return f"{arch!r} runs attention implementation {attn!r}; the cache's masks are for {' or '.join(ATTENTIONS)}"
    for name in UNMODELLED_WINDOWS:
        if getattr(config, name, None):
            return f"{arch!r} has local attention ({name}={getattr(config, name)!r}) the cache's masks do not model"
    kinds = set(getattr(config, "layer_types", None) or [])
    if kinds - set(LAYER_KINDS):
        return f"{arch!r} has layers of kind {sorted(kinds - set(LAYER_KINDS))}, whose masks the cache does not build"
    try:
        attentions = attention_modules(model, "engine.decode_cache", "use engine.decode_cache=false")
    except DistzoError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - a structure without a list of decoder layers
        return f"{arch!r}: no attention module per decoder layer found ({exc})"
    if blocks and len(attentions) != blocks:
        return f"{arch!r} has {len(attentions)} attention modules for {blocks} decoder blocks"
    return None


def install(model: nn.Module) -> KVHooks:
    """The hooks on `model`'s attention modules (call `unsupported_reason` first)."""
    attentions = attention_modules(model, "engine.decode_cache", "use engine.decode_cache=false")
    eager = getattr(model.config, "_attn_implementation", None) in (None, "eager")
    dtype = next(model.parameters()).dtype
    return KVHooks(attentions, layer_windows(model.config, len(attentions)), dtype if eager else None)
