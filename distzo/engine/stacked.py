"""P-RGE's stacked probes: all of a rank's probes in ONE forward over stacked copies of LoRA-FA's B.

The packed shard is replicated once per probe (rows [e R, (e + 1) R) belong to probe e),
so the frozen weights are read once for every query and sign. Only the LoRA B matrices differ
between probes: each LoRA layer applies its stacked copies [E, out, r] with a batched matmul
(`distzo.peft.lora`). Each copy is computed exactly as the per-probe path computes its working
copy (B + eps z or B - eps z, chunk by chunk from the same directions), so the batched and separate
probes see bitwise the same weights; their losses differ only by GEMM shapes (float rounding).

materialize=True builds a block's copies before the block runs; False hands each layer a function
that draws its copies inside its forward and drops them after it (P-RGE §3.2's memory option).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..data.batches import Packed, Scores
from ..peft.lora import lora_layers, stacked_b
from ..registry import register
from ..zo.directions import Directions
from ..zo.estimators import Probe
from ..zo.optimizers import SGD, Optimizer
from ..zo.params import TrainableParam
from .build import EngineMode, EngineSetup
from .loop import StageLoop, join_scores
from .stores import ResidentStore
from .weights import CleanWeights


class StackedLoRAError(ValueError):
    pass


def perturbed_copy(directions: Directions, p: TrainableParam, master: torch.Tensor, ev: Probe, step: int,
                   eps: float) -> torch.Tensor:
    """master + sign * eps * z_query, with the same operations as the engine's working copies."""
    if not ev.perturbed:
        return master
    z = directions.generate(p.shape, p.key, step, ev.query)
    z = z.mul_(eps) if master.dtype == torch.float32 else z.to(master.dtype).mul_(eps)
    return torch.add(master, z) if ev.sign > 0 else torch.sub(master, z)


def stack_copies(directions: Directions, p: TrainableParam, plan: Sequence[Probe], step: int,
                 eps: float) -> torch.Tensor:
    return torch.stack([perturbed_copy(directions, p, p.tensor, ev, step, eps) for ev in plan])


class StackedProbes:
    """P-RGE: a rank's perturbed probes run as one batched forward over stacked LoRA-FA B copies
    (the step loop hands them here; clean forwards take the ordinary stage loop)."""

    def __init__(self, model, params, materialize: bool = True):
        self.materialize = materialize
        self.params = params
        self.layers = {f"{name}.lora_B": module for name, module in lora_layers(model)}
        others = [p.name for p in params if p.name not in self.layers]
        if others or not self.layers:
            raise StackedLoRAError(f"stacked probes perturb LoRA-FA B matrices only; also trainable: {others[:3]}")

    def describe(self) -> str:
        how = "materialised" if self.materialize else "drawn inside each layer"
        return f"each rank's probes in one batched forward over stacked LoRA B copies ({how})"

    def run(self, loop, parts: Sequence[Sequence[Packed]], plan: Sequence[Probe], step: int) -> list[Scores]:
        # Every probe scores the same micro-batches here; one batched forward per micro-batch.
        per_part = [self._stacked(loop, packed, plan, step) for packed in parts[0]]
        return [join_scores([scores[e] for scores in per_part]) for e in range(len(plan))]

    def _stacked(self, loop, packed: Packed, plan: Sequence[Probe], step: int) -> list[Scores]:
        """Scores of every probe of the plan, in one forward: rows [e R, (e + 1) R) of the
        replicated batch belong to probe e."""
        loop.flush()  # the pending update (a few LoRA B matrices) before the copies are drawn from the masters
        E, R = len(plan), packed.input_ids.shape[0]
        replicated = packed.replicate(E)
        adapter = loop.adapter
        ctx = adapter.context(replicated.input_ids, replicated.position_ids, mask_fn=replicated.mask_fn())
        clean = CleanWeights(loop.model)
        hidden = adapter.stem(ctx, clean)
        for i, (prefix, _) in enumerate(adapter.blocks):
            mine = [(p, self.layers[p.name]) for p in self.params if p.name.startswith(prefix + ".")]
            stacks: dict = {}
            for p, module in mine:
                if self.materialize:
                    with loop.timers("perturb"):
                        stacks[module] = stack_copies(loop.directions, p, plan, step, loop.eps)
                else:
                    stacks[module] = _on_the_fly(loop.directions, p, plan, step, loop.eps)
            # The store hands over the block's frozen tensors where it streams them (offload=cpu).
            with loop.store.block(i) as block, stacked_b(stacks):
                hidden = adapter.block(i, hidden, ctx, CleanWeights(loop.model, block.sources))
        hidden = hidden.view(E, R, *hidden.shape[1:])
        return [loop.head(hidden[e], packed, clean) for e in range(E)]


def _on_the_fly(directions: Directions, p: TrainableParam, plan: Sequence[Probe], step: int,
                eps: float) -> Callable[[], torch.Tensor]:
    return lambda: stack_copies(directions, p, plan, step, eps)


def stacked_lora_engine(model, adapter, params, directions, *, materialize: bool = True,
                        optimizer: Optimizer | None = None, **kwargs) -> StageLoop:
    """P-RGE: a rank's probes in one batched forward over stacked LoRA-FA B copies."""
    optimizer = optimizer or SGD()
    store = ResidentStore(adapter, params, optimizer, directions.device)
    return StageLoop(model, adapter, params, directions, store, stacked=StackedProbes(model, params, materialize),
                     optimizer=optimizer, mode="stacked-lora", **kwargs)


@register("engine_mode", "stacked-lora")
class StackedLoRAMode(EngineMode):
    """A stacked estimator (P-RGE) with resident weights."""

    precedence = 20

    @classmethod
    def applies(cls, s: EngineSetup) -> bool:
        return s.estimator.stacked and s.offload.mode == "none"

    @classmethod
    def build(cls, s: EngineSetup) -> StageLoop:
        s.model.to(s.device)
        return stacked_lora_engine(s.model, s.adapter, s.params, s.directions,
                                   materialize=getattr(s.estimator, "materialize", True), **s.loop_options())
