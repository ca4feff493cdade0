"""Low-rank directions: z of a matrix parameter is A B^T, a product of two thin factors (LOZO, SubZero).

For a parameter of two or more dimensions, seen as m rows of n elements, the direction of query k
at step t is z = A_{t,k} B_j^T: A [m, r] changes every step, B [n, r] only every `interval` steps
(window j = step // interval). Parameters of one dimension (biases, norms) keep MeZO's dense z.

- LOZO (Chen et al., ICLR 2025): A = U_{t,k}, B = V_j, both Gaussian, no normalisation (each
  element's perturbation has variance r; the authors' code, whose learning rates are the paper's
  divided by r).
- SubZero (Yu et al., ICCV 2025): U_j [m, r] and V_j [n, r] orthonormal (the Q of a QR of Gaussian
  draws, computed in float64 on the CPU with diag(R) > 0, so every rank and device gets the same
  bits), a Gaussian core Z_{t,k} [r, r] each step, A = s U_j Z_{t,k} with s = sqrt(m n) / r (so that
  E|z|^2 = m n, as for a dense Gaussian) and B = V_j.

Every factor comes from a CPU generator seeded from the run's counters ((seed, step, query,
parameter) for A and Z, (seed, window, parameter) for U and V), so z is the same whichever rank,
mode or device draws it, and never depends on what was drawn before. A chunk of z (whole rows) is
sum_a A[rows, a] * B[:, a], one rounded multiply and one rounded add per term, in a fixed order: the
rows an embedding's lookup reads (`rows`) get bitwise the values a chunk pass writes, and z is never
formed for a whole weight.

LOZO-M (`estimator.factor_momentum` > 0) moves the weights along M_t B_j^T instead of the step's estimate, where the
factor M [m, r] is a momentum of the estimates' factors: M_t = beta M_{t-1} + (1 - beta) sum_k c_k
A_{t,k} (M at the first step: sum_k c_k A), and where the window changes, the old factor is first
carried into the new row space: M <- M (B_old^T B_new) / n. One-dimensional parameters keep a dense
momentum buffer, mom_t = beta mom_{t-1} + (1 - beta) sum_k c_k z_k. The factors are this object's
state (`state`, `load_state`: snapshots carry them), advanced once per step and parameter, in step
order, however the engine walks (`update_terms` records each step's coefficients).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from .directions import ChunkRef, Directions, row_numel
from .params import TrainableParams
from .streams import Stream, mix64

_A_SALT, _B_SALT, _U_SALT = 0x10_20A, 0x10_20B, 0x10_20C  # keep the factors' streams apart
UPDATE_QUERY = -5  # the update of a step with factor momentum: M_t B^T, in place of the step's terms


@dataclass(frozen=True)
class LowRankRule:
    """orthonormal: SubZero's factors (orthonormal U and V, a Gaussian core scaled by sqrt(m n) / r)
    rather than LOZO's Gaussian U and V; rank: r; interval: steps per window of B (and U)."""

    orthonormal: bool
    rank: int
    interval: int


class LowRankDirections(Directions):
    """Directions with low-rank z for the matrices of `params` (see the module docstring)."""

    def __init__(self, *args, params: TrainableParams, rule: LowRankRule, momentum: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.rule, self.momentum = rule, float(momentum)
        self.matrices = {p.key: (int(p.shape[0]), row_numel(p.shape)) for p in params if len(p.shape) >= 2}
        self.vectors = {p.key: p.name for p in params if len(p.shape) < 2}
        self.names = {p.key: p.name for p in params}
        self.shapes = {p.key: tuple(p.shape) for p in params}
        self._cache: dict[tuple, torch.Tensor] = {}
        self._lock = threading.RLock()  # the momentum's recursion draws factors while it holds it
        self._steps: dict[int, tuple[tuple[int, float], ...]] = {}  # step -> its coefficients (momentum)
        self._factor: dict[int, tuple[int, torch.Tensor]] = {}  # key -> (last step folded in, M or mom)

    # --- the factors --------------------------------------------------------------------------------

    def _generator(self, coordinate: int, query: int, key: int, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.chunk_seed(coordinate, query, mix64(key ^ salt), 0))

    def _cached(self, name: tuple, make) -> torch.Tensor:
        value = self._cache.get(name)
        if value is None:
            value = make()
            with self._lock:
                self._cache[name] = value
        return value

    def _orthonormal(self, rows: int, window: int, key: int, salt: int) -> torch.Tensor:
        """The Q [rows, r] of a QR of a Gaussian matrix, float64 on the CPU, signs with diag(R) > 0."""
        gen = self._generator(window, 0, key, salt)
        q, r = torch.linalg.qr(torch.randn(rows, self.rule.rank, generator=gen, dtype=torch.float64))
        return q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)

    def right(self, key: int, window: int) -> torch.Tensor:
        """B_j [n, r] (float32, on the device)."""
        def make() -> torch.Tensor:
            m, n = self.matrices[key]
            if self.rule.orthonormal:
                return self._orthonormal(n, window, key, _B_SALT).to(torch.float32).to(self.device)
            gen = self._generator(window, 0, key, _B_SALT)
            return torch.randn(n, self.rule.rank, generator=gen).to(self.device)
        return self._cached(("B", key, window), make)

    def left(self, key: int, step: int, query: int) -> torch.Tensor:
        """A_{t,k} [m, r] (float32, on the device)."""
        def make() -> torch.Tensor:
            m, n = self.matrices[key]
            r = self.rule.rank
            if self.rule.orthonormal:
                window = step // self.rule.interval
                u = self._cached(("U", key, window), lambda: self._orthonormal(m, window, key, _U_SALT))
                core = torch.randn(r, r, generator=self._generator(step, query, key, _A_SALT), dtype=torch.float64)
                return (u @ core * (math.sqrt(m * n) / r)).to(torch.float32).to(self.device)
            return torch.randn(m, r, generator=self._generator(step, query, key, _A_SALT)).to(self.device)
        return self._cached(("A", key, step, query), make)

    def forget_before(self, step: int) -> None:
        """Drop cached factors no longer needed: A of steps before `step - 1`, B of windows before
        the window of `step - 1` (the update pending at `step` still reads them)."""
        oldest = max(0, step - 1)
        window = oldest // self.rule.interval - 1  # the carry from one window to the next reads the last one
        with self._lock:
            for name in [n for n in self._cache if (n[0] == "A" and n[2] < oldest) or (n[0] in "BU" and n[2] < window)]:
                del self._cache[name]

    # --- z ------------------------------------------------------------------------------------------

    def _product(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """out [rows, n] = sum_a a[:, a] b[:, a]^T, term by term in a fixed order, each term one
        element-wise op over the rows (out += a_a b_a^T): element (i, j) gets the same operations
        whichever rows a caller asks for, so its bits do not depend on them."""
        torch.mul(a[:, 0:1], b[:, 0], out=out)
        for i in range(1, a.shape[1]):
            out.addcmul_(a[:, i:i + 1], b[:, i])
        return out

    def factors(self, key: int, step: int, query: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of z_{step, query} of a matrix; for the update query, (M_step, B)."""
        b = self.right(key, step // self.rule.interval)
        if query == UPDATE_QUERY:
            return self._momentum_factor(key, step), b
        return self.left(key, step, query), b

    def stream(self, step: int, query: int, ref: ChunkRef, scale: float = 1.0) -> Stream | None:
        if ref.key in self.matrices or query == UPDATE_QUERY:
            return None  # drawn by fill_chunk
        return super().stream(step, query, ref, scale)

    def fill_chunk(self, out: torch.Tensor, step: int, query: int, ref: ChunkRef, scale: float = 1.0) -> torch.Tensor:
        if ref.key in self.matrices:
            n = self.matrices[ref.key][1]
            first, last = ref.start // n, ref.stop // n  # chunks of matrices are whole rows
            a, b = self.factors(ref.key, step, query)
            with torch.autocast(out.device.type, enabled=False):  # z is float32 wherever it is drawn
                self._product(out.view(last - first, n), a[first:last], b)
        elif query == UPDATE_QUERY:
            out.copy_(self._momentum_factor(ref.key, step).view(-1)[ref.start:ref.stop])
        else:
            return super().fill_chunk(out, step, query, ref, scale)
        return out.mul_(scale) if scale != 1.0 else out

    def rows(self, shape: Sequence[int], key: int, step: int, query: int, rows: torch.Tensor) -> torch.Tensor:
        if key not in self.matrices:
            return super().rows(shape, key, step, query, rows)
        a, b = self.factors(key, step, query)
        out = torch.empty((rows.numel(), b.shape[0]), dtype=torch.float32, device=self.device)
        return self._product(out, a[rows.to(a.device)], b)

    # --- LOZO-M: the update along a momentum of the estimates' factors ------------------------------

    def update_terms(self, step: int, coefficients: Sequence[tuple[int, float]],
                     terms: list[tuple[int, float]], unit: float) -> list[tuple[int, float]]:
        self.forget_before(step)  # the update of `step` is the oldest that will read factors again
        if self.momentum == 0.0:
            return terms
        with self._lock:
            self._steps[step] = tuple(coefficients)
            if len(self._factor) == len(self.names):  # every factor exists: drop the steps all have folded in
                oldest = min(done for done, _ in self._factor.values())
                for t in [t for t in self._steps if t < oldest]:
                    del self._steps[t]
        return [(UPDATE_QUERY, unit)]  # the update is M_t B^T (or mom_t) scaled by the rule's unit term

    def _momentum_factor(self, key: int, step: int) -> torch.Tensor:
        """M_step of a matrix, or mom_step of a vector, advanced from the last step folded in."""
        with self._lock:
            done, factor = self._factor.get(key, (-1, None))
            for t in sorted(s for s in self._steps if done < s <= step):
                factor = self._fold(key, t, done, factor)
                done = t
            self._factor[key] = (done, factor)
            return factor

    def _fold(self, key: int, step: int, previous: int, factor: torch.Tensor | None) -> torch.Tensor:
        """One step of the momentum recursion (the module docstring), in float32."""
        beta = self.momentum
        coefficients = [(k, c) for k, c in self._steps[step] if c != 0.0]
        if key in self.matrices:
            m, n = self.matrices[key]
            estimate = torch.zeros(m, self.rule.rank, device=self.device)
            for k, c in coefficients:
                estimate.add_(self.left(key, step, k), alpha=c)
            if factor is not None and previous // self.rule.interval != step // self.rule.interval:
                carry = self.right(key, previous // self.rule.interval).T @ self.right(key, step // self.rule.interval)
                factor = factor @ (carry / n)
        else:  # a vector's dense z, chunk by chunk on this thread (it may be a worker of the pool)
            estimate = torch.zeros(self.shapes[key], device=self.device)
            flat = estimate.view(-1)
            for k, c in coefficients:
                for ref, _ in self.units(key, self.shapes[key]):
                    z = Directions.fill_chunk(self, torch.empty(ref.stop - ref.start, device=self.device), step, k,
                                              ref)
                    flat[ref.start:ref.stop].add_(z, alpha=c)
        if factor is None:
            return estimate
        return factor.mul(beta).add_(estimate, alpha=1.0 - beta)

    def state(self) -> dict[str, torch.Tensor]:
        """The momentum factors, every one advanced to the last recorded step (snapshots)."""
        if self.momentum == 0.0 or not self._steps:
            return {}
        last = max(self._steps)
        out = {f"lozo_momentum/{self.names[key]}": self._momentum_factor(key, last).detach().cpu().clone()
               for key in self.names}
        out["lozo_momentum_step"] = torch.tensor(last)
        return out

    def state_keys(self) -> set[str]:
        return set() if self.momentum == 0.0 else {f"lozo_momentum/{n}" for n in self.names.values()} | {
            "lozo_momentum_step"}

    def load_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if self.momentum == 0.0 or "lozo_momentum_step" not in tensors:
            return
        step = int(tensors["lozo_momentum_step"])
        with self._lock:
            self._factor = {key: (step, tensors[f"lozo_momentum/{name}"].to(self.device).clone())
                            for key, name in self.names.items()}
            self._steps[step] = ()

    def memory_bytes(self) -> int:
        return self.state_bytes() + sum(t.numel() * t.element_size() for t in list(self._cache.values()))

    def state_bytes(self) -> int:
        if self.momentum == 0.0:
            return 0
        return 4 * sum(m * self.rule.rank for m, _ in self.matrices.values()) + 4 * sum(
            math.prod(self.shapes[k]) for k in self.vectors)
