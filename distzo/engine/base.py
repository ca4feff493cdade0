"""The engine interface: what a driver, evaluation, snapshots and telemetry ask of an engine, and
nothing else (docs/architecture.md#engines).

    scores = engine.run_probes(shard, plan, step)   # this rank's share of the plan: {index: Scores}
    engine.apply(step, coefficients, lr, wd)      # the step's update (the optimizer's rule), identical on every rank
    with engine.materialized() as weights:        # pending work done, peers in step: read the weights
        weights.score(batch); weights.params; weights.model

How an engine runs the plan (where weights live, who draws which noise, which collectives a block
needs) is decided once, when `build_engine` builds the mode's step loop; nothing is switched
afterwards. Telemetry comes through methods every engine has (`transfer_stats`, `host_master_bytes`,
`optimizer_state_bytes`), so a caller never asks which mode runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Iterator, Sequence

import torch
from torch import nn

from ..data.batches import Batch, Packed, Scores
from ..errors import DistzoError
from ..models.adapters import DecoderAdapter
from ..zo.estimators import Probe
from ..zo.params import TrainableParams


class EngineConfigError(DistzoError):
    """An engine setting that cannot apply to this run."""


class ParametersReplaced(DistzoError):
    """The model's parameters were given new tensors (moved, cast, wrapped) while an engine held them."""


def parameter_storage(model: nn.Module) -> list[tuple[str, int]]:
    """Where each of the model's parameters keeps its values (device and address; a tensor subclass
    without storage of its own, such as a quantized weight, by its device alone): what an engine
    reads and updates, which must not change under it."""
    out = []
    for p in model.parameters():
        data = p.data
        out.append((str(data.device), data.data_ptr() if type(data) is torch.Tensor else 0))
    return out


class Materialized:
    """The master weights, current and readable (inside `Engine.materialized`): `score` runs a clean
    forward of a batch on this rank alone (no collectives, so ranks may score different numbers of
    batches); `params` and `model` are the trainable tensors and the stock model."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.params: TrainableParams = engine.params
        self.model: nn.Module = engine.model

    def score(self, batch: Batch) -> Scores:
        return self._engine.score_clean(batch)

    def generate(self, task, prompts: Sequence[Sequence[int]]) -> list[str]:
        """Greedy answers to `prompts` (token ids) under the task's stop rule, with the stock
        `generate` and its KV cache on the model's own (master) parameters, blocks kept in host memory
        streamed through the device at each forward (`Engine.stock_forward`): on this rank alone."""
        from ..data.decoding import greedy_decode
        from ..peft.prefix import has_prefix

        # Prefix tuning hands attention a cache stand-in of its own, in place of generate's KV cache.
        # Decoding in the engine's compute mode, as it scores.
        with self._engine.stock_forward(), self._engine.forward_arithmetic():
            return greedy_decode(self.model, task.tokenizer, prompts, task.max_new_tokens, task.stop, task.pad_id,
                                 use_cache=not has_prefix(self.model))


class Engine(ABC):
    """Runs a step's forward probes and its update; see the module docstring."""

    model: nn.Module
    adapter: DecoderAdapter  # how the model's layers are driven (dedicated adapter or the general path)
    params: TrainableParams
    mode = "?"  # a short name of the engine's mode, for logs and summaries

    @abstractmethod
    def run_probes(self, batch: Batch, plan: Sequence[Probe], step: int) -> dict[int, Scores]:
        """Run the probes of `plan` dealt to this rank (docs/mesh.md) on `batch` (this rank's data
        shard) at step `step`, returning their Scores by index into `plan`. A rank dealt none returns
        {} (after walking the blocks with its peers where the mode needs it)."""

    def begin_step(self, step: int) -> None:
        """Before step `step`'s probes (and before re-applying its logged update): directions that read
        the weights refresh what they read (Sparse MeZO's thresholds), on the weights as they are
        then. Collective where `materialized` is; nothing for most directions."""

    @abstractmethod
    def apply(self, step: int, coefficients: Sequence[tuple[int, float]], lr: float, weight_decay: float) -> None:
        """theta <- theta (1 - lr wd) - sum_k (lr c_k) z_k(step) (or the optimizer's rule), for every
        trainable parameter. An engine may defer the work as a pending update (fused into the next
        step's perturbation, distzo.engine.pending); it is applied before any read of the weights
        through `materialized`."""

    @abstractmethod
    @contextmanager
    def materialized(self) -> Iterator[Materialized]:
        """Every pending update applied and every peer in step: evaluation, replica checks, snapshots and
        export read the weights inside. Collective: every rank enters it together."""

    @abstractmethod
    def pack(self, batch: Batch) -> Packed:
        """The rows this engine runs a batch as (AGZO's activation capture reads which tokens are real)."""

    @abstractmethod
    def score_clean(self, batch: Batch) -> Scores:
        """Scores at the master weights, on this rank alone (called through Materialized.score)."""

    def forward_arithmetic(self) -> AbstractContextManager:
        """The context the forward passes run in (`engine.compute`): none by default."""
        return nullcontext()

    def stock_forward(self) -> AbstractContextManager:
        """Inside `materialized`: the context in which the stock model's own forward runs on the
        compute device (transformers' Trainer evaluating); offloaded blocks are streamed through it."""
        return nullcontext()

    def transfer_stats(self) -> dict[str, float]:
        """Cumulative bytes this rank moved host-to-device (`h2d_bytes`), back (`d2h_bytes`) and from
        node peers (`peer_bytes`, sliced offloading), and seconds spent in those transfers
        (`transfer_s`); {} when the engine moves no weights."""
        return {}

    def host_master_bytes(self) -> dict[str, int]:
        """Host memory of an offloaded master: `copy` (one copy of it), `resident` (what this rank
        holds resident of it: its share of a node-shared master) and `node_shared`; {} when the
        master is not offloaded."""
        return {}

    def optimizer_state(self) -> dict:
        """The optimizer's per-element state by `<slot>/<parameter>`, its host numbers by
        `scalars/<name>` (MEAZO's) and the directions' state by `directions/<name>` (read it inside
        `materialized`; empty for sgd). Snapshots write it."""
        return {}

    def load_optimizer_state(self, tensors) -> None:
        """Restore a snapshot's optimizer state before the first step (every rank calls it)."""

    def optimizer_state_bytes(self) -> dict[str, int]:
        """`copy`: bytes of one copy of the optimizer's state; `resident`: what this rank holds of it
        (its share where the node's ranks share one copy)."""
        return {"copy": 0, "resident": 0}

    def describe(self) -> str:
        """How this engine runs a step, in a few words (for the log)."""
        return type(self).__name__

    def summary(self) -> dict[str, str]:
        """What a run's summary records of its engine: the mode's short name and its description."""
        return {"engine": self.mode, "engine_description": self.describe()}

    def close(self) -> None:
        """Release threads and buffers."""
