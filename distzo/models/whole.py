"""The whole-model fallback: a causal LM the general path cannot split into blocks, trained through its
stock forward with every parameter perturbed at once.

The adapter has no blocks: its stem runs the stock `model(...)` (through the WeightView, so each
evaluation sees its perturbed copy of every parameter) and returns the logits of every position,
its final stage is the identity, and its head reads the scored positions' columns from those
logits. So whatever the forward does (a logit scale, a structure without a list of layers) is
reproduced, at a cost: each evaluation holds a working copy of the whole model (the engine's copies
are per stage, and here the model is one stage), the logits of every position are computed, and
nothing can be offloaded. Candidates after a shared prompt are scored unbranched (one sequence per
candidate), since distzo cannot hand the stock forward its branch masks in general.

Like the general path, it is built only if it reproduces the stock forward on a packed row of two
prompts (with the stock masks, else with distzo's 4D masks).
"""

from __future__ import annotations

import logging
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
    packed_probe,
)

log = logging.getLogger(__name__)


class WholeModelAdapter(DecoderAdapter):
    """A causal LM as one stage (see the module docstring)."""

    family = "whole-model"

    def __init__(self, model: nn.Module, self_check: bool = True):
        super().__init__(model)
        self.head_bias = None  # the stock forward applies the head, bias and all
        self.own_masks = False
        self.check_difference: float | None = None
        if self_check and next(model.parameters()).device.type != "meta":
            self._self_check()

    def describe(self) -> str:
        check = (f", self-check max |logit difference| {self.check_difference:.2g}"
                 if self.check_difference is not None else "")
        return (f"{self.arch} on the whole-model fallback (stock forward, every parameter perturbed at once, no "
                f"offloading; {'distzo' if self.own_masks else 'stock'} masks{check})")

    @property
    def attention_window(self) -> int | None:
        return 0  # every sequence with branches is scored unbranched (see the module docstring)

    def _self_check(self) -> None:
        w = CleanWeights(self.model)
        diff = tol = float("nan")
        try:
            vocab = int(getattr(self.config, "vocab_size", 0) or self.model.get_output_embeddings().weight.shape[0])
            probe = packed_probe(self.model, vocab, self.dtype, self.device)
            tol = probe.tolerance
            with torch.inference_mode():
                for own in (False, True):
                    self.own_masks = own
                    ours = self.stem(self.context(probe.ids, probe.positions), w)[0, probe.last]
                    diff = float((ours.float() - probe.stock.float()).abs().max())
                    if diff <= tol:
                        break
        except Exception as exc:  # noqa: BLE001 - any failure of an unknown model's forward is a refusal
            raise UnsupportedModelError(f"{self.arch}: its stock forward fails on a packed row of input ids "
                                        f"({type(exc).__name__}: {exc})") from None
        if not diff <= tol:
            raise UnsupportedModelError(
                f"{self.arch}: even its stock forward does not score packed prompts like each alone (largest logit "
                f"difference {diff:.3g}, tolerance {tol:.3g}): its layers do not take attention masks (a recurrent "
                "model?)")
        self.check_difference = diff

    def context(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                mask_fn: Callable | None = None) -> BatchContext:
        mask = None
        if self.own_masks or mask_fn is not None:
            from transformers.masking_utils import create_causal_mask

            shaped = torch.empty((*input_ids.shape, 1), dtype=self.dtype, device=input_ids.device)
            mask = build_mask(create_causal_mask, self.config, shaped, position_ids, mask_fn)
        return BatchContext(input_ids, position_ids, [], extra={"mask": mask})

    def stem(self, ctx: BatchContext, w: WeightView) -> torch.Tensor:
        kwargs: dict[str, Any] = dict(input_ids=ctx.input_ids, position_ids=ctx.position_ids, use_cache=False)
        if ctx.extra["mask"] is not None:
            kwargs["attention_mask"] = ctx.extra["mask"]
        return w.call("", self.model, **kwargs).logits

    def final(self, hidden: torch.Tensor, w: WeightView) -> torch.Tensor:
        return hidden  # the stem's output is already the logits

    def head(self, features: torch.Tensor, vocab_ids: torch.Tensor | None, w: WeightView) -> torch.Tensor:
        return features if vocab_ids is None else features[..., vocab_ids]
