"""AGZO's activation-guided directions: for a linear layer's weight, z = R A^T (AGZO Eq. 7).

A [in, r] is an orthonormal basis of the top-r left singular subspace of the layer's input
activations H [in, m] (every real token of the step's batch), found by K block power iterations
(AGZO Algorithm 1) in a forward pre-hook during the clean forward, then kept until the step's
update has been applied. R [out, r] is Gaussian, drawn from a counter-derived seed like every other
direction, so it is regenerated, never stored, and the same on every rank. Parameters without a
captured basis (embeddings, norms, biases, LoRA matrices, prefixes, a head read by rows) get the
ordinary dense direction.

`SubspaceDirections` is a `Directions` whose `fill_chunk` knows the bases, so the engine's
perturbation and update code (chunked, fused, threaded) serves AGZO unchanged.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from .directions import ChunkRef, Directions
from .params import TrainableParams
from .streams import Stream, mix64

_R_SALT = 0x5A67D0_A620  # keeps R's stream apart from a dense z of the same parameter
_OMEGA_QUERY = -2  # the power iteration's test matrix: its own coordinate in the seed hash


def top_subspace(x: torch.Tensor, rank: int, iters: int, gen: torch.Generator) -> torch.Tensor:
    """AGZO Algorithm 1 on H = x^T (x: [m tokens, d_in]): an orthonormal [d_in, r] basis of H's top-r
    left singular subspace. Un-centred, as in the paper; computed in at least float32."""
    with torch.autocast(x.device.type, enabled=False):  # float32 even inside a bfloat16 forward
        return _top_subspace(x.to(torch.promote_types(x.dtype, torch.float32)), rank, iters, gen)


def _top_subspace(x: torch.Tensor, rank: int, iters: int, gen: torch.Generator) -> torch.Tensor:
    r = max(1, min(rank, x.shape[0], x.shape[1]))
    # Omega comes from a CPU generator (the same draw on every device), then joins x on its device.
    omega = torch.randn(x.shape[0], r, generator=gen, dtype=x.dtype).to(x.device)
    y = x.T @ omega  # H Omega
    for _ in range(iters):
        q, _ = torch.linalg.qr(y)
        y = x.T @ (x @ q)  # (H H^T) Q
    a, _ = torch.linalg.qr(y)
    return a.contiguous()


class SubspaceDirections(Directions):
    """Directions with AGZO's rule for the weights of linear layers that have a basis at a step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bases: dict[tuple[int, int], torch.Tensor] = {}  # (param key, step) -> A [in, r]
        self._r: dict[tuple[int, int, int], torch.Tensor] = {}  # (key, step, query) -> R [out, r]
        self.out_features: dict[int, int] = {}  # param key -> rows of the linear weight
        self._lock = threading.Lock()

    def set_basis(self, key: int, step: int, basis: torch.Tensor) -> None:
        with self._lock:
            self.bases[(key, step)] = basis

    def forget_before(self, step: int) -> None:
        """Drop bases (and cached R) of steps before `step` (their updates are applied)."""
        with self._lock:
            for k in [k for k in self.bases if k[1] < step]:
                del self.bases[k]
            for k in [k for k in self._r if k[1] < step]:
                del self._r[k]

    def omega_generator(self, key: int, step: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.chunk_seed(step, _OMEGA_QUERY, key, 0))

    def coefficients_r(self, key: int, out_features: int, rank: int, step: int, query: int) -> torch.Tensor:
        """R [out, r] of one layer, query and step (Gaussian; cached while the step is live)."""
        cached = self._r.get((key, step, query))
        if cached is None:
            # A CPU generator, like Omega's: torch's CUDA randn depends on the GPU's SM count.
            gen = torch.Generator().manual_seed(self.chunk_seed(step, query, mix64(key ^ _R_SALT), 0))
            cached = torch.randn(out_features, rank, generator=gen).to(self.device)
            with self._lock:
                self._r[(key, step, query)] = cached
        return cached

    def stream(self, step: int, query: int, ref: ChunkRef, scale: float = 1.0) -> Stream | None:
        if (ref.key, step) in self.bases:
            return None  # R A^T, drawn by fill_chunk
        return super().stream(step, query, ref, scale)

    def fill_chunk(self, out: torch.Tensor, step: int, query: int, ref: ChunkRef, scale: float = 1.0) -> torch.Tensor:
        basis = self.bases.get((ref.key, step))
        if basis is None:
            return super().fill_chunk(out, step, query, ref, scale)
        d_in, rank = basis.shape
        first, last = ref.start // d_in, ref.stop // d_in  # chunks of 2-d tensors are whole rows
        r = self.coefficients_r(ref.key, self.out_features[ref.key], rank, step, query)
        with torch.autocast(out.device.type, enabled=False):  # z is float32 wherever it is drawn
            torch.matmul(r[first:last], basis.T.to(r.dtype), out=out.view(last - first, d_in))
        return out.mul_(scale) if scale != 1.0 else out


class ActivationCapture:
    """Forward pre-hooks on every linear layer whose weight trains: while `capture(step, valid)` is
    active, each layer's input (real tokens only) yields that layer's basis for `step`."""

    def __init__(self, model: nn.Module, params: TrainableParams, directions: SubspaceDirections,
                 rank: int, iters: int):
        self.directions, self.rank, self.iters = directions, rank, iters
        self.layers: list[tuple[nn.Linear, int]] = []
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                p = params.get(f"{name}.weight")
                # A weight trained under another name (an LM head tied to the embedding) follows
                # that name's rule: the tied-embedding policy decides, not this layer.
                if p is not None and p.name == f"{name}.weight":
                    self.layers.append((module, p.key))
                    directions.out_features[p.key] = module.out_features
        self._active: tuple[int, torch.Tensor] | None = None
        self._keys = {id(m): k for m, k in self.layers}
        for module, _ in self.layers:
            module.register_forward_pre_hook(self._hook)

    def _hook(self, module: nn.Module, args) -> None:
        if self._active is None:
            return
        step, valid = self._active
        x = args[0]
        tokens = x.reshape(-1, x.shape[-1])
        if valid is not None and valid.numel() == tokens.shape[0]:
            tokens = tokens[valid.view(-1)]
        key = self._keys[id(module)]
        self.directions.set_basis(key, step, top_subspace(tokens, self.rank, self.iters,
                                                          self.directions.omega_generator(key, step)))

    @contextmanager
    def capture(self, step: int, valid: torch.Tensor | None) -> Iterator[None]:
        """valid: [rows, cols] bool, True at the packed batch's real tokens (padding is not data)."""
        self.directions.forget_before(step - 1)  # step - 1's bases serve the update still pending
        self._active = (step, valid)
        try:
            yield
        finally:
            self._active = None
