"""The general path: any transformers decoder-only causal LM as stem -> blocks -> final -> head, read
from the stock model's own structure.

The dedicated adapters (`distzo.models.adapters`) mirror a family's forward by hand. This one needs no
family knowledge; it finds the pieces and lets the stock forward do everything between them:
  blocks   the largest `nn.ModuleList` of same-class modules (the decoder layers); the module that
           holds it is the base model ("model", "transformer", "gpt_neox", ...)
  stem     everything the base model's stock forward does before the first layer (position
           embeddings, embedding scaling, dropout), run on a *shell*: a shallow copy of the base model
           whose layer list is replaced by recorders and whose input embedding is left out, so the
           table is never perturbed whole; the token embedding itself goes through the stock
           embedding module applied to only the rows the batch reads
  layers   each called with exactly the arguments the stock forward passes it (masks, rotary
           embeddings, position ids), captured once per batch by the recorders
  final    the base model's submodules the stock forward calls after the last layer (final norm)
  head     `get_output_embeddings()`, rows of the scored tokens only, with Gemma's final logit
           soft-capping when the config asks for it

At construction a self-check compares this path's logits with the stock forward on a few tokens; a
model it does not reproduce is refused with the architecture and the difference named, never
trained on a wrong forward. `tests/unit/test_generic_adapter.py` checks it against the stock forward
for GPT-2, GPT-NeoX, Phi-3, Gemma 3, Falcon, StableLM and today's families.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn

from .adapters import (
    BatchContext,
    CleanWeights,
    DecoderAdapter,
    UnsupportedModelError,
    WeightView,
    build_mask,
    call_with,
    check_plain_embeddings,
    packed_probe,
)

log = logging.getLogger(__name__)


class _Stop(Exception):
    """Ends a shell forward early (the recorders have what they need)."""

    def __init__(self, hidden: torch.Tensor | None = None):
        super().__init__()
        self.hidden = hidden


class _Recorder(nn.Module):
    """Stands in for decoder layer `index` inside a shell: hands the hidden state and the arguments
    the stock forward passes that layer to the shell's current sink, and returns the hidden state
    shaped like the real layer's output (a tensor or a 1-tuple). Attribute reads fall through to the
    real layer, which some stock forwards consult (e.g. a layer's attention type)."""

    def __init__(self, index: int, layer: nn.Module, shell_state: dict[str, Any]):
        super().__init__()
        object.__setattr__(self, "_layer", layer)  # not a submodule: its parameters stay out of the shell
        object.__setattr__(self, "_state", shell_state)
        self.index = index

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_layer"), name)

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._state["sink"](self.index, hidden, args, kwargs)
        return (hidden,) if self._state["tuple_out"] else hidden


class _Absent(nn.Module):
    """The input embedding's place in a shell: the shell always receives `inputs_embeds`."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("internal error: the shell's stock forward looked up token embeddings itself")


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(path, list) of the largest ModuleList whose entries share one class: the decoder layers."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size and (best is None or size > best[0]):
            best = (size, path, module)
    if best is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} ({model.config.model_type!r}) has no list of decoder layers (an nn.ModuleList "
            "of identical blocks) for the general path to stream; distzo fine-tunes decoder-only causal LMs")
    return best[1], best[2]


def _path_of(model: nn.Module, target: nn.Module, what: str) -> str:
    for path, module in model.named_modules(remove_duplicate=False):
        if module is target:
            return path
    raise UnsupportedModelError(f"{type(model).__name__}: its {what} is not a submodule of the model")


class GenericDecoderAdapter(DecoderAdapter):
    """Any decoder-only causal LM, driven through its stock modules (see the module docstring)."""

    family = "general"

    def __init__(self, model: nn.Module, self_check: bool = True):
        super().__init__(model)
        arch = self.arch
        layers_path, layers = find_blocks(model)
        if "." not in layers_path:
            raise UnsupportedModelError(f"{arch}: its decoder layers ({layers_path}) sit on the causal-LM class "
                                        "itself, not in a base model the general path can run up to them")
        self.base_path, self.layers_attr = layers_path.rsplit(".", 1)
        self.base = model.get_submodule(self.base_path)
        try:
            embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        except (NotImplementedError, AttributeError) as exc:
            raise UnsupportedModelError(f"{arch}: cannot find its input or output embeddings ({exc})") from None
        check_plain_embeddings(model, arch, "the general path")
        if not isinstance(embed, nn.Embedding):
            raise UnsupportedModelError(f"{arch}: its input embedding is a {type(embed).__name__}, not an "
                                        "nn.Embedding (or subclass) the general path can read by rows")
        if not isinstance(head, nn.Linear):
            raise UnsupportedModelError(f"{arch}: it has no linear LM head (get_output_embeddings() returned "
                                        f"{type(head).__name__})")
        self.embed = embed
        embed_path = _path_of(model, embed, "input embedding")
        self.embed_weight = f"{embed_path}.weight"
        head_path = _path_of(model, head, "output embedding")
        self.head_weight = f"{head_path}.weight"
        self.head_bias = f"{head_path}.bias" if head.bias is not None else None
        embed_child = embed_path[len(self.base_path) + 1:] if embed_path.startswith(self.base_path + ".") else None
        if embed_child is None or "." in embed_child:
            raise UnsupportedModelError(f"{arch}: its input embedding ({embed_path}) is not a direct submodule of "
                                        f"the base model ({self.base_path})")
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        # Packed prompts need block-causal masks. Most stock forwards build them from the position
        # ids; for one that does not (OPT), the self-check fails and distzo passes its own masks.
        self.own_masks = False
        self.check_difference: float | None = None  # set by the self-check

        # The shell: the base model's forward with recorders for layers and no token embedding.
        self._state: dict[str, Any] = {"sink": None, "tuple_out": False}
        self.shell = copy.copy(self.base)
        self.shell.__dict__ = dict(self.base.__dict__)
        self.shell._modules = OrderedDict(self.base._modules)
        self.shell._modules[self.layers_attr] = nn.ModuleList(
            _Recorder(i, layer, self._state) for i, layer in enumerate(layers))
        self.shell._modules[embed_child] = _Absent()
        self._layers = layers
        self.blocks = [(f"{layers_path}.{i}", layer) for i, layer in enumerate(layers)]
        self.final_modules: list[tuple[str, nn.Module]] = []
        try:
            self._discover()
            if self_check:
                self._self_check()
        except UnsupportedModelError:
            raise
        except Exception as exc:  # noqa: BLE001 - an unknown model's forward may fail in any way: a refusal
            raise UnsupportedModelError(f"{arch}: its stock forward fails when the general path drives it "
                                        f"({type(exc).__name__}: {exc})") from None

    # --- what the stock forward does around the layers ---------------------------------------------

    def _shell_forward(self, sink: Callable, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                       attention_mask: Any, call: Callable | None = None) -> torch.Tensor | None:
        self._state["sink"] = sink
        kwargs = dict(inputs_embeds=inputs_embeds, position_ids=position_ids, attention_mask=attention_mask,
                      use_cache=False)
        try:
            if call is None:
                self.shell(**kwargs)
            else:
                call(self.shell, **kwargs)
        except _Stop as stop:
            return stop.hidden
        finally:
            self._state["sink"] = None
        raise RuntimeError("internal error: the shell forward ran past its recorders")

    def _discover(self) -> None:
        """Two forwards on a few tokens: the stock one tells whether a layer returns a tuple; the
        shell's tells which layers the forward calls, in which order, and which of the base model's
        submodules run after the last one (the final stage)."""
        if next(self.model.parameters()).device.type == "meta":
            self._final_children_from_names()
            return
        ids = torch.arange(1, 5, device=self.device)[None] % self.embed.num_embeddings
        outputs: list[Any] = []
        order: list[str] = []
        hook = self._layers[0].register_forward_hook(lambda m, a, out: outputs.append(out))
        try:
            with torch.inference_mode():
                self.model(input_ids=ids, use_cache=False)
        finally:
            hook.remove()
        self._state["tuple_out"] = isinstance(outputs[0], tuple) if outputs else False
        hooks = [child.register_forward_pre_hook(lambda m, a, n=name: order.append(n))
                 for name, child in self.shell.named_children() if name != self.layers_attr]
        try:
            with torch.inference_mode():
                self._state["sink"] = lambda i, h, a, k: order.append(i)
                self.shell(inputs_embeds=self.embed(ids), position_ids=torch.arange(4, device=self.device)[None],
                           use_cache=False)
        finally:
            self._state["sink"] = None
            for h in hooks:
                h.remove()
        seen = [i for i in order if isinstance(i, int)]
        if not seen or seen != list(range(len(seen))):
            raise UnsupportedModelError(f"{self.arch}: its forward does not call its decoder layers once each, in "
                                        f"order (called {seen[:8]})")
        self.blocks = self.blocks[:len(seen)]
        after = order[order.index(len(seen) - 1) + 1:]
        self.final_modules = [(f"{self.base_path}.{n}", self.base.get_submodule(n)) for n in dict.fromkeys(after)
                              if any(True for _ in self.base.get_submodule(n).parameters())]

    def _final_children_from_names(self) -> None:
        """On the meta device nothing can run: the final stage is the base model's norm-like children."""
        self.final_modules = [(f"{self.base_path}.{n}", m) for n, m in self.base.named_children()
                              if "norm" in type(m).__name__.lower() or n in ("ln_f", "norm", "final_layer_norm")]

    def _self_check(self) -> None:
        """The general path's logits against the stock forward's on a few tokens (one packed row holding
        two prompts), first with the stock forward's masks, then with distzo's own; a model neither
        reproduces is refused."""
        if next(self.model.parameters()).device.type == "meta":
            return
        diff, tol = self._check_difference()
        if not diff <= tol:
            self.own_masks = True
            diff, tol = self._check_difference()
        if not diff <= tol:
            raise UnsupportedModelError(
                f"{self.arch}: the general path does not reproduce the stock forward (largest logit difference "
                f"{diff:.3g}, tolerance {tol:.3g}); its forward does something between or around the layers "
                "the general path cannot see (e.g. a logit transform)")
        self.check_difference = diff

    def _check_difference(self) -> tuple[float, float]:
        probe = packed_probe(self.model, self.embed.num_embeddings, self.dtype, self.device)
        vocab = torch.arange(min(self.embed.num_embeddings, 64), device=self.device)
        w = CleanWeights(self.model)
        with torch.inference_mode():
            ctx = self.context(probe.ids, probe.positions)
            h = self.stem(ctx, w)
            for i in range(len(self.blocks)):
                h = self.block(i, h, ctx, w)
            ours = self.head(self.final(h[0, probe.last], w), vocab, w)
        stock = probe.stock[:, :vocab.numel()]
        return float((ours.float() - stock.float()).abs().max()), probe.tolerance

    # --- the adapter interface ---------------------------------------------------------------------

    def describe(self) -> str:
        check = (f", self-check max |logit difference| {self.check_difference:.2g}"
                 if self.check_difference is not None else "")
        return (f"{self.arch} on the general path ({len(self.blocks)} blocks, "
                f"{'distzo' if self.own_masks else 'stock'} masks{check})")

    def context(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                mask_fn: Callable | None = None) -> BatchContext:
        batch, seq = input_ids.shape
        shaped = torch.zeros((batch, seq, self.config.hidden_size), dtype=self.dtype, device=input_ids.device)
        mask = self._masks(shaped, position_ids, mask_fn) if mask_fn is not None or self.own_masks else None
        args: list[tuple] = [()] * len(self.blocks)
        kwargs: list[dict[str, Any]] = [{}] * len(self.blocks)

        def sink(index, hidden, a, k):
            args[index], kwargs[index] = a, k
            if index == len(self.blocks) - 1:
                raise _Stop()

        self._shell_forward(sink, shaped, position_ids, mask)
        unique, inverse = torch.unique(input_ids, return_inverse=True)
        return BatchContext(input_ids, position_ids, kwargs, layer_args=args,
                            extra={"unique": unique, "inverse": inverse, "mask": mask})

    def _masks(self, shaped: torch.Tensor, position_ids: torch.Tensor, mask_fn: Callable | None) -> Any:
        """distzo's own masks (`build_mask`: block-causal for packed prompts, intersected with
        `mask_fn` for branches), in the form a stock forward accepts instead of building its own: one
        4D mask, or a mapping per layer type."""
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        full = build_mask(create_causal_mask, self.config, shaped, position_ids, mask_fn)
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types:
            masks = {"full_attention": full}
            if "sliding_attention" in layer_types:
                masks["sliding_attention"] = build_mask(create_sliding_window_causal_mask, self.config, shaped,
                                                        position_ids, mask_fn)
            return masks
        if self.attention_window is not None:
            return build_mask(create_sliding_window_causal_mask, self.config, shaped, position_ids, mask_fn)
        return full

    def stem(self, ctx: BatchContext, w: WeightView) -> torch.Tensor:
        # The stock embedding module (it may scale, as Gemma's does) over just the rows the batch reads.
        table = w.rows(self.embed_weight, ctx.extra["unique"])
        embeds = call_with(self.embed, {"weight": table}, (ctx.extra["inverse"],), {})

        def sink(index, hidden, a, k):
            raise _Stop(hidden)

        return self._shell_forward(sink, embeds, ctx.position_ids, ctx.extra["mask"],
                                   call=lambda shell, **kw: w.call(self.base_path, shell, **kw))

    def final(self, hidden: torch.Tensor, w: WeightView) -> torch.Tensor:
        for prefix, module in self.final_modules:
            hidden = w.call(prefix, module, hidden)
        return hidden

    def head(self, features: torch.Tensor, vocab_ids: torch.Tensor | None, w: WeightView) -> torch.Tensor:
        logits = super().head(features, vocab_ids, w)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
