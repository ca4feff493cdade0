"""P-RGE's batched evaluation: all of a rank's evaluations in ONE forward over LoRA-FA's B.

The packed shard is replicated once per evaluation (rows [e R, (e + 1) R) belong to evaluation e),
so the frozen weights are read once for every query and sign. Only the LoRA B matrices differ
between evaluations: each LoRA layer applies its stacked copies [E, out, r] with a batched matmul
(`distzo.peft.lora`). Each copy is computed exactly as the per-evaluation path computes its working
copy (B + eps z or B - eps z, chunk by chunk from the same directions), so the batched and separate
evaluations see bitwise the same weights; their losses differ only by GEMM shapes (float rounding).

materialize=True builds a block's copies before the block runs; False hands each layer a function
that draws its copies inside its forward and drops them after it (P-RGE §3.2's memory option).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..data.tasks import Batch
from ..peft.lora import lora_layers, stacked_b
from ..zo.directions import Directions
from ..zo.estimators import Evaluation
from ..zo.params import TrainableParam
from .weights import CleanWeights


class StackedLoRAError(ValueError):
    pass


def perturbed_copy(directions: Directions, p: TrainableParam, master: torch.Tensor, ev: Evaluation, step: int,
                   eps: float) -> torch.Tensor:
    """master + sign * eps * z_query, with the same operations as the engine's working copies."""
    if not ev.perturbed:
        return master
    z = directions.generate(p.shape, p.key, step, ev.query)
    z = z.mul_(eps) if master.dtype == torch.float32 else z.to(master.dtype).mul_(eps)
    return torch.add(master, z) if ev.sign > 0 else torch.sub(master, z)


def stack_copies(directions: Directions, p: TrainableParam, plan: Sequence[Evaluation], step: int,
                 eps: float) -> torch.Tensor:
    return torch.stack([perturbed_copy(directions, p, p.tensor, ev, step, eps) for ev in plan])


def stacked_label_logits(engine, batch: Batch, label_ids: torch.Tensor, plan: Sequence[Evaluation], step: int,
                         eps: float, materialize: bool) -> torch.Tensor:
    """Label-word logits [len(plan), B, C], every evaluation in one forward."""
    layers = {f"{name}.lora_B": module for name, module in lora_layers(engine.model)}
    others = [p.name for p in engine.params if p.name not in layers]
    if others or not layers:
        raise StackedLoRAError(f"batched evaluation perturbs LoRA-FA B matrices only; also trainable: {others[:3]}")
    engine.flush()  # the owed update (a few LoRA B matrices) before the copies are drawn from the masters
    E = len(plan)
    packed = batch.pack(engine.row_tokens).to(engine.device)
    R = packed.input_ids.shape[0]
    ctx = engine.adapter.context(packed.input_ids.repeat(E, 1), packed.position_ids.repeat(E, 1))
    clean = CleanWeights(engine.model)
    hidden = engine.adapter.stem(ctx, clean)
    for i, (prefix, _) in enumerate(engine.adapter.blocks):
        mine = [(p, layers[p.name]) for p in engine.params if p.name.startswith(prefix + ".")]
        stacks: dict = {}
        for p, module in mine:
            if materialize:
                with engine.timers("perturb"):
                    stacks[module] = stack_copies(engine.directions, p, plan, step, eps)
            else:
                stacks[module] = _on_the_fly(engine.directions, p, plan, step, eps)
        with stacked_b(stacks):
            hidden = engine.adapter.block(i, hidden, ctx, clean)
    rows = (packed.last_row[None] + R * torch.arange(E, device=engine.device)[:, None]).reshape(-1)
    cols = packed.last_col.repeat(E)
    features = engine.adapter.final(hidden[rows, cols], clean)
    out = engine.adapter.head(features, label_ids.to(engine.device), clean)
    return out.to(torch.promote_types(out.dtype, torch.float32)).view(E, batch.size, -1)


def _on_the_fly(directions: Directions, p: TrainableParam, plan: Sequence[Evaluation], step: int,
                eps: float) -> Callable[[], torch.Tensor]:
    return lambda: stack_copies(directions, p, plan, step, eps)
