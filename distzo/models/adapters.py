"""Adapters that expose a stock transformers causal LM as stages: stem -> blocks -> final -> head.

A ZO step perturbs one stage at a time (and ZO2-style offloading streams one block at a time), so
the engine must drive the layer loop itself. The adapters do that with the model's own submodules
and the library's own mask and rotary helpers, mirroring the stock `forward` in a dozen lines per
family; nothing is copied or patched. `tests/unit/test_adapters.py` checks each family against the
stock forward.

Weights reach the adapter through a `WeightView` (implemented in `distzo.engine.weights`), so the
same code computes clean and perturbed forwards, resident or offloaded:
  view.rows(name, index)                 rows of an embedding-like table (lookup or label head)
  view.call(prefix, module, *args, **kw) run a submodule with its (possibly perturbed) parameters

Inputs are packed (see `distzo.data.tasks.Packed`): several prompts share a row and their position
ids restart at 0, from which the library's mask helpers build a block-causal mask, so no prompt
attends to another and padding costs almost nothing.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol
from weakref import WeakKeyDictionary

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import DistzoError


class UnsupportedModelError(DistzoError):
    """The model's architecture has no adapter."""


class WeightView(Protocol):
    """How an adapter reads a stage's weights: the model's own (`CleanWeights`) or an evaluation's
    working copies (distzo.engine.weights)."""

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor: ...

    def call(self, prefix: str, module: nn.Module, *args: Any, **kwargs: Any) -> Any: ...


def full_name(prefix: str, rel: str) -> str:
    """A submodule's parameter name in the model (prefix "": the model itself)."""
    return f"{prefix}.{rel}" if prefix else rel


# A module's parameter slots: its own name of each parameter (tied ones under every name) -> (the
# submodule that holds it, its attribute). Read once per module: the structure of a stage does not
# change during a run, and walking it per call cost more than the call's small kernels on a GPU.
_SLOTS: WeakKeyDictionary[nn.Module, dict[str, tuple[nn.Module, str]]] = WeakKeyDictionary()


def parameter_slots(module: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """{name within `module`: (owning submodule, attribute)} of every parameter, tied ones under each
    of their names (`named_parameters(remove_duplicate=False)`'s names)."""
    slots = _SLOTS.get(module)
    if slots is None:
        slots = {full_name(sub_name, attr): (sub, attr)
                 for sub_name, sub in module.named_modules(remove_duplicate=False)
                 for attr, t in sub._parameters.items() if t is not None}
        _SLOTS[module] = slots
    return slots


def call_with(module: nn.Module, tensors: Mapping[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
    """module(*args, **kwargs) with the parameters named in `tensors` (by the module's own names)
    replaced for the call, as `torch.func.functional_call(..., tie_weights=False, strict=False)`
    does, without walking the module on every call: each slot is swapped and put back afterwards."""
    slots = parameter_slots(module)
    saved = []
    try:
        for rel, t in tensors.items():
            sub, attr = slots[rel]
            saved.append((sub, attr, sub._parameters[attr]))
            sub._parameters[attr] = t
        return module(*args, **kwargs)
    finally:
        for sub, attr, old in reversed(saved):
            sub._parameters[attr] = old


def module_sources(prefix: str, module: nn.Module, sources: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of `sources` (by full parameter name) that belong to `module`, by its own names."""
    if not sources:
        return {}
    names = ((rel, full_name(prefix, rel)) for rel in parameter_slots(module))
    return {rel: sources[name] for rel, name in names if name in sources}


class CleanWeights:
    """The master weights, unperturbed (read from `sources` where a stage provides them)."""

    def __init__(self, model: nn.Module, sources: Mapping[str, torch.Tensor] | None = None):
        self.model, self.sources = model, sources or {}

    def rows(self, name: str, index: torch.Tensor | None) -> torch.Tensor:
        """Rows `index` of a table (index None: the whole table)."""
        table = self.sources[name] if name in self.sources else self.model.get_parameter(name)
        if index is None:
            return table
        return table[index] if table.dim() == 1 else F.embedding(index, table)  # a vector: a head's bias

    def call(self, prefix: str, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        local = module_sources(prefix, module, self.sources)
        if not local:
            return module(*args, **kwargs)
        return call_with(module, local, args, kwargs)



@dataclass
class BatchContext:
    """Per-batch tensors shared by every evaluation of a step (they do not depend on weights)."""

    input_ids: torch.Tensor  # [R, T] packed rows
    position_ids: torch.Tensor  # [R, T] restarting at 0 for every prompt
    layer_kwargs: list[dict[str, Any]] = field(default_factory=list)
    layer_args: list[tuple] = field(default_factory=list)  # positional arguments after the hidden state, if any
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific (e.g. OPT's position rows)


def build_mask(helper: Callable, config: Any, shaped: torch.Tensor, position_ids: torch.Tensor,
               mask_fn: Callable | None = None) -> Any:
    """Call a transformers mask helper (create_causal_mask and friends) for packed prompts: no padding
    mask, no cache. Without `mask_fn`, position ids restarting per prompt make the helper build a
    block-causal mask. With `mask_fn` (rows whose sequences have branches, `Packed.mask_fn`), position
    ids no longer say where sequences start, so the helper gets none and intersects its causal mask
    with `mask_fn`, which separates the sequences and the branches. transformers 5.0 names the
    embeddings `input_embeds` and the cache `past_key_values` and requires `cache_position`; later
    releases take `inputs_embeds` and `cache`."""
    params = inspect.signature(helper).parameters
    kwargs: dict[str, Any] = dict(config=config, attention_mask=None,
                                  position_ids=position_ids if mask_fn is None else None)
    kwargs["cache" if "cache" in params else "past_key_values"] = None
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = shaped
    if mask_fn is not None:
        kwargs["and_mask_function"] = mask_fn
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(shaped.shape[1], device=shaped.device)
    return helper(**kwargs)


@dataclass
class PackedProbe:
    """What the general path and the whole-model fallback check themselves on when they are built:
    two short prompts packed into one row (positions restarting at 0), the stock forward's logits at
    each prompt's last token with the prompt run alone, and the tolerance a faithful path meets (a
    few ulps of the logits' scale in float32; a missed transform or a leaking mask is orders of
    magnitude above it)."""

    ids: torch.Tensor  # [1, 7]
    positions: torch.Tensor  # [1, 7]
    last: list[int]  # each prompt's last offset in the row
    stock: torch.Tensor  # [2, vocab]
    tolerance: float


def packed_probe(model: nn.Module, vocab: int, dtype: torch.dtype, device: torch.device) -> PackedProbe:
    n = min(vocab, 7)
    first = (torch.arange(4, device=device) * 3 + 1) % n
    second = (torch.arange(3, device=device) * 5 + 2) % n
    with torch.inference_mode():
        stock = torch.cat([model(input_ids=s[None], use_cache=False).logits[0, -1][None] for s in (first, second)])
    rel = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
    return PackedProbe(torch.cat([first, second])[None], torch.cat([torch.arange(4), torch.arange(3)]).to(device)[None],
                       [3, 6], stock, rel * (float(stock.abs().max()) + 1.0))


def adapted_layer(module: nn.Module | None) -> str | None:
    """What a PEFT adapter put in place of an embedding or the LM head, or None: a tuner layer (LoRA,
    IA3, ...) keeps the layer as `base_layer` and adds a computation of its own, trainable tokens add
    rows of their own; reading the layer's weight by rows would leave either out. (modules_to_save's
    wrapper is none of these: its `weight` is the trained copy's.)"""
    if module is None:
        return None
    if getattr(module, "base_layer", None) is not None:
        return f"wrapped by a PEFT adapter layer ({type(module).__module__}.{type(module).__name__})"
    if getattr(module, "token_adapter", None) is not None:
        return "wrapped by PEFT's trainable tokens (trainable_token_indices)"
    return None


def check_plain_embeddings(model: nn.Module, arch: str, path: str) -> None:
    """UnsupportedModelError where the input embedding or the LM head is `adapted_layer`: `path` (the
    dedicated adapter, the general path) reads them by rows, so the ZO loss would not see the adapter
    there while it is perturbed and updated."""
    for which, get in (("input embedding", "get_input_embeddings"), ("LM head", "get_output_embeddings")):
        try:
            what = adapted_layer(getattr(model, get)())
        except (NotImplementedError, AttributeError):
            continue
        if what is not None:
            raise UnsupportedModelError(f"{arch}: its {which} is {what}, which {path} reads as a plain weight")


class DecoderAdapter:
    """Base class: a decoder-only LM as stem, blocks, final and a (row-indexed) head."""

    family = "?"

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config
        self.blocks: list[tuple[str, nn.Module]] = []
        self.head_weight = "lm_head.weight"
        self.arch = f"{type(model).__name__} ({getattr(self.config, 'model_type', '?')!r})"
        head = getattr(model, "lm_head", None)
        self.head_bias = "lm_head.bias" if head is not None and getattr(head, "bias", None) is not None else None

    def describe(self) -> str:
        """Which path drives the model (for the log)."""
        return f"{self.arch} on the dedicated {self.family} adapter"

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def context(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                mask_fn: Callable | None = None) -> BatchContext:
        """Per-batch inputs of every block: masks (block-causal, intersected with `mask_fn` when
        given: `build_mask`), positions, rotary embeddings."""
        raise NotImplementedError

    @property
    def attention_window(self) -> int | None:
        """The smallest sliding window of any layer (None: every layer attends to the whole
        sequence). A sequence with branches longer than it is scored unbranched (`Batch.pack`): the
        mask helpers measure the window in row offsets, which for a later branch overstate its
        distance to the prefix."""
        window = getattr(self.config, "sliding_window", None)
        layer_types = getattr(self.config, "layer_types", None) or []
        uses_window = "sliding_attention" in layer_types or (not layer_types and window)
        return int(window) if uses_window and window else None

    def stem(self, ctx: BatchContext, w: WeightView) -> torch.Tensor:
        raise NotImplementedError

    def block(self, i: int, hidden: torch.Tensor, ctx: BatchContext, w: WeightView) -> torch.Tensor:
        prefix, module = self.blocks[i]
        args = ctx.layer_args[i] if ctx.layer_args else ()
        out = w.call(prefix, module, hidden, *args, **ctx.layer_kwargs[i])
        return out[0] if isinstance(out, tuple) else out  # some releases return (hidden_states, ...)

    def final(self, hidden: torch.Tensor, w: WeightView) -> torch.Tensor:
        raise NotImplementedError

    def head(self, features: torch.Tensor, vocab_ids: torch.Tensor, w: WeightView) -> torch.Tensor:
        """Logits of `vocab_ids` only (None: the whole vocabulary): the classification loss reads no
        other column. A head with a bias (Phi) adds the same entries of it."""
        logits = features @ w.rows(self.head_weight, vocab_ids).T
        return logits if self.head_bias is None else logits + w.rows(self.head_bias, vocab_ids)


class RotaryDecoderAdapter(DecoderAdapter):
    """Llama, Mistral, Qwen2 and Qwen3: token embedding, rotary positions, causal (or sliding
    window) masks chosen per layer type (Qwen's `layer_types`) or for every layer (Mistral's
    `sliding_window`), decoder layers, final norm."""

    family = "rotary-decoder"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        check_plain_embeddings(model, self.arch, f"the dedicated {self.family} adapter")
        base = model.model
        self.base = base
        self.blocks = [(f"model.layers.{i}", layer)
                       for i, layer in enumerate(base.layers[: self.config.num_hidden_layers])]
        self.embed_weight = "model.embed_tokens.weight"

    def context(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                mask_fn: Callable | None = None) -> BatchContext:
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        batch, seq = input_ids.shape
        # Mask helpers and rotary read only shape, dtype and device from the embeddings.
        shaped = torch.empty((batch, seq, self.config.hidden_size), dtype=self.dtype, device=input_ids.device)
        layer_types = getattr(self.config, "layer_types", None)
        every_layer = "full_attention"
        if not layer_types and self.config.model_type == "mistral" and getattr(self.config, "sliding_window", None):
            every_layer = "sliding_attention"
        masks = {"full_attention": build_mask(create_causal_mask, self.config, shaped, position_ids, mask_fn)}
        if (layer_types and "sliding_attention" in layer_types) or every_layer == "sliding_attention":
            masks["sliding_attention"] = build_mask(create_sliding_window_causal_mask, self.config, shaped,
                                                    position_ids, mask_fn)
        position_embeddings = self.base.rotary_emb(shaped, position_ids)
        kwargs = []
        for i in range(len(self.blocks)):
            kind = layer_types[i] if layer_types else every_layer
            kwargs.append(dict(attention_mask=masks[kind], position_embeddings=position_embeddings,
                               position_ids=position_ids, use_cache=False))
        return BatchContext(input_ids, position_ids, kwargs)

    def stem(self, ctx: BatchContext, w: WeightView) -> torch.Tensor:
        return w.rows(self.embed_weight, ctx.input_ids)

    def final(self, hidden: torch.Tensor, w: WeightView) -> torch.Tensor:
        return w.call("model.norm", self.base.norm, hidden)


class OPTAdapter(DecoderAdapter):
    """OPT: token and learned position embeddings (offset 2), optional project_in / project_out,
    pre- or post-norm decoder layers, optional final layer norm."""

    family = "opt"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        check_plain_embeddings(model, self.arch, f"the dedicated {self.family} adapter")
        dec = model.model.decoder
        self.dec = dec
        self.blocks = [(f"model.decoder.layers.{i}", layer) for i, layer in enumerate(dec.layers)]
        self.embed_weight = "model.decoder.embed_tokens.weight"

    def context(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                mask_fn: Callable | None = None) -> BatchContext:
        from transformers.masking_utils import create_causal_mask

        batch, seq = input_ids.shape
        shaped = torch.empty((batch, seq, self.config.hidden_size), dtype=self.dtype, device=input_ids.device)
        # Stock OPT passes no position ids here; ours make the packed prompts block-causal.
        mask = build_mask(create_causal_mask, self.config, shaped, position_ids, mask_fn)
        kwargs = [dict(attention_mask=mask, position_ids=position_ids, use_cache=False)
                  for _ in self.blocks]
        rows = position_ids + self.dec.embed_positions.offset  # OPT's learned positions start at row 2
        return BatchContext(input_ids, position_ids, kwargs, extra={"position_rows": rows})

    def stem(self, ctx: BatchContext, w: WeightView) -> torch.Tensor:
        tokens = w.rows(self.embed_weight, ctx.input_ids)
        if self.dec.project_in is not None:
            tokens = w.call("model.decoder.project_in", self.dec.project_in, tokens)
        positions = w.rows("model.decoder.embed_positions.weight", ctx.extra["position_rows"])
        return tokens + positions

    def final(self, hidden: torch.Tensor, w: WeightView) -> torch.Tensor:
        if self.dec.final_layer_norm is not None:
            hidden = w.call("model.decoder.final_layer_norm", self.dec.final_layer_norm, hidden)
        if self.dec.project_out is not None:
            hidden = w.call("model.decoder.project_out", self.dec.project_out, hidden)
        return hidden


ADAPTERS: dict[str, type[DecoderAdapter]] = {
    "llama": RotaryDecoderAdapter,
    "mistral": RotaryDecoderAdapter,
    "qwen2": RotaryDecoderAdapter,
    "qwen3": RotaryDecoderAdapter,
    "opt": OPTAdapter,
}
