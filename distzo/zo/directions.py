"""Counter-based perturbation directions: z is a pure function of (run seed, step, query, parameter, chunk).

MeZO (and ZO2 after it) regenerate z by re-seeding one global RNG and drawing parameters in a fixed
order, so which z a tensor receives depends on everything drawn before it. Here every chunk of
every parameter has its own generator seed, derived by hashing the coordinates above. Block order,
offloading, slicing, the mesh shape and the number of threads therefore cannot change which z a
parameter sees, and any chunk can be regenerated on its own, on any rank, in any order.

Chunks: a parameter is cut into chunks of whole rows (for tensors with two or more dimensions) of
about `CHUNK_NUMEL` elements.

On the CPU both distributions are counter streams of the chunk's seed (`distzo.zo.streams`, their one
definition), so any element range of a chunk can be drawn on its own (embedding rows, a rank's
slice), and the fused kernels generate z inside their pass over the weights. Rademacher z is the same
on every device; Gaussian z is the same on every CPU (its ln, cos and sin are float32 arithmetic, not
a maths library's). On CUDA both are counter streams drawn by one Triton kernel (`distzo.zo.cuda_draws`)
for a whole span of chunks per launch: the step's host work then grows with the number of
parameters, not of chunks.

This module says which z a chunk has. Where the work runs (threads, scratch buffers, the bench's
clock) is `distzo.zo.workers`, which `Directions` delegates to.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, Sequence

import torch

from . import cuda_draws
from .streams import GAUSSIAN_SCHEME, Stream, as_int64, mix64, stream_rows, stream_values
from .workers import CHUNK_NUMEL, ChunkWorkers

if TYPE_CHECKING:
    from ..telemetry.timing import WorkClock
    from .params import TrainableParams as TrainableParams


class StreamKernels(Protocol):
    """What directions ask of the fused CPU kernels (`distzo.native.Kernels`, a layer above): the
    streams drawn in C, bitwise their definitions in `streams`."""

    def stream_fill(self, out: torch.Tensor, stream: Stream, offset: int = 0) -> torch.Tensor: ...

    def stream_rows(self, out: torch.Tensor, seeds: Sequence[int], offsets: Sequence[int], scale: float,
                    gaussian: bool = False) -> torch.Tensor: ...

# Bump when the seed -> z mapping changes; snapshots and run summaries record it.
# 2: Rademacher signs unpacked from random bytes (8 per byte) instead of one draw per element.
# 3: Rademacher signs are the bits of a SplitMix64 counter stream per chunk (Gaussian z unchanged).
# 4: CUDA Gaussian z is a counter stream (Box-Muller of SplitMix64 words, `cuda_draws`) instead of
#    torch's CUDA normal_; CPU z unchanged. Which GPU drew it is `gaussian_generator_id`'s business.
# 5: CUDA Gaussian z takes both Box-Muller outputs of each word and the GPU's approximate ln, cos and
#    sin (`cuda_draws.GAUSSIAN_SCHEME`, in `gaussian_generator_id`); CPU z unchanged.
# 6: CPU Gaussian z is a counter stream (Box-Muller of SplitMix64 words, ln, cos and sin in float32
#    arithmetic: `streams.GAUSSIAN_SCHEME`) instead of torch's CPU normal_; CUDA z unchanged.
DIRECTIONS_VERSION = 6
# The first scheme that drew each distribution's z as this distzo does (snapshots and run logs
# record DIRECTIONS_VERSION; `same_directions` compares a recorded one with this distzo's). Gaussian
# schemes differ by device (versions 4 and 5 changed CUDA's, 6 the CPU's): those changes are told
# apart by the recorded generator (`gaussian_generator_id`), which resume and replay compare.
SCHEME_SINCE = {"gaussian": 1, "rademacher": 3}
_MASK64 = (1 << 64) - 1
# The most elements one CUDA draw covers (whole chunks; a single chunk may be larger where one row is):
# bounds the scratch buffer at 128 MiB for every model whose rows are shorter.
SPAN_NUMEL = 1 << 25


def same_directions(recorded_version: int | None, distribution: str) -> bool:
    """Whether z recorded under `recorded_version` (a snapshot's) equals the z this distzo draws."""
    return recorded_version is not None and recorded_version >= SCHEME_SINCE[distribution]


def param_key(name: str) -> int:
    """A stable 64-bit identity for a parameter, from its canonical fully-qualified name."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def row_numel(shape: Sequence[int]) -> int:
    return max(1, math.prod(int(s) for s in shape[1:]))


def chunk_numel(shape: Sequence[int]) -> int:
    """Elements per chunk for a tensor of this shape (whole rows for tensors of 2+ dimensions)."""
    if len(shape) < 2:
        return CHUNK_NUMEL
    row = row_numel(shape)
    return max(1, CHUNK_NUMEL // row) * row


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of one parameter: flat elements [start, stop); `per_chunk` is the parameter's
    elements per chunk. On CUDA a ref may span several consecutive whole chunks (`Directions.units`):
    `index` is then the first."""

    key: int
    index: int
    start: int
    stop: int
    per_chunk: int


def _ref_size(ref: ChunkRef) -> int:
    return ref.stop - ref.start


def chunks_of(key: int, shape: Sequence[int]) -> list[ChunkRef]:
    numel = math.prod(int(s) for s in shape)
    c = chunk_numel(shape)
    return [ChunkRef(key, i, s, min(s + c, numel), c) for i, s in enumerate(range(0, numel, c))]


Unit = tuple[ChunkRef, "tuple[int, int] | None"]  # a piece of chunk work, and the part of it wanted


class Directions:
    """Generates z chunk by chunk from counter-derived seeds, in parallel over a thread pool.

    distribution: "gaussian" (N(0, 1)) or "rademacher" (+-1 with equal probability).
    z is always drawn in float32 on `device` and cast by the caller where needed.
    kernels: the fused kernels (`distzo.native.load`: C on CPU, Triton on CUDA), or None for torch
    ops; the values are the same either way.
    """

    def __init__(self, seed: int, distribution: str = "gaussian", device: torch.device | str = "cpu",
                 threads: int | None = None, kernels: Any = None, clock: WorkClock | None = None):
        if distribution not in ("gaussian", "rademacher"):
            raise ValueError(f"unknown direction distribution {distribution!r}")
        self.seed = int(seed)
        self.distribution = distribution
        self.device = torch.device(device)
        # CPU: the C kernels (fused passes, Rademacher draws); CUDA: the Triton chunk kernel, which
        # chunkpass calls (z is drawn by cuda_draws here either way).
        self.kernels = kernels if self.device.type in ("cpu", "cuda") else None
        self._cpu_kernels = kernels if self.device.type == "cpu" else None
        self.counter_draws = self.device.type == "cuda"  # every draw by cuda_draws, a span per launch
        if self.counter_draws:
            cuda_draws.require()
        self.workers = ChunkWorkers(self.device, threads, clock)  # where chunk work runs (not what z is)

    @property
    def clock(self) -> WorkClock | None:
        """The work clock of `bench` (CPU): time in work items and in draws."""
        return self.workers.clock

    def scratch(self, numel: int, slot: int = 0) -> torch.Tensor:
        return self.workers.scratch(numel, slot)

    def map(self, fn: Callable[[Any], None], items: Iterable[Any], cost: Callable[[Any], float] | None = None) -> None:
        self.workers.map(fn, items, cost)

    def step_hash(self, step: int) -> int:
        """The hash of (seed, step) that every key hash of the step extends (the CUDA chunk kernel
        derives the rest of `key_hash` from it)."""
        return mix64(mix64(self.seed) ^ (step & _MASK64))

    def key_hash(self, step: int, query: int, key: int) -> int:
        """The hash of (seed, step, query, parameter) that every chunk seed of the parameter extends."""
        h = self.step_hash(step)
        for coordinate in (query, key):
            h = mix64(h ^ (coordinate & _MASK64))
        return h

    def chunk_seed(self, step: int, query: int, key: int, chunk: int) -> int:
        return mix64(self.key_hash(step, query, key) ^ (chunk & _MASK64))

    def units(self, key: int, shape: Sequence[int], lo: int = 0, hi: int | None = None) -> list[Unit]:
        """The pieces in which chunk work on elements [lo, hi) of a parameter runs: (ref, part), part
        the (start, stop) within ref that is wanted, or None for all of it. On the CPU a piece is a
        chunk (the threads' work item). On CUDA it is a span of up to SPAN_NUMEL elements of whole
        chunks, drawn by one launch, so the work queued per step does not grow with the chunks."""
        hi = math.prod(int(s) for s in shape) if hi is None else hi
        refs = [r for r in chunks_of(key, shape) if r.start < hi and r.stop > lo]
        if self.counter_draws and refs:
            per = refs[0].per_chunk
            step = max(1, SPAN_NUMEL // per)
            refs = [ChunkRef(key, group[0].index, group[0].start, group[-1].stop, per)
                    for group in (refs[i:i + step] for i in range(0, len(refs), step))]
        out = []
        for ref in refs:
            a, b = max(ref.start, lo), min(ref.stop, hi)
            out.append((ref, None if (a, b) == (ref.start, ref.stop) else (a - ref.start, b - ref.start)))
        return out

    def stream(self, step: int, query: int, ref: ChunkRef, scale: float = 1.0) -> Stream | None:
        """Chunk `ref`'s z times scale as a counter stream that a fused pass generates itself, or
        None where z has to be drawn into memory (`fill_chunk`: on CUDA, by the draw kernel)."""
        if self.distribution == "gaussian" and self.counter_draws:
            return None
        return self._chunk_stream(step, query, ref, scale)

    def _chunk_stream(self, step: int, query: int, ref: ChunkRef, scale: float) -> Stream:
        return Stream(self.chunk_seed(step, query, ref.key, ref.index), scale, self.distribution == "gaussian")

    def fill_stream(self, out: torch.Tensor, stream: Stream, offset: int = 0) -> torch.Tensor:
        """out = elements [offset, offset + out.numel()) of a counter stream, times its scale."""
        if self._cpu_kernels is not None and out.dtype == torch.float32 and out.is_contiguous():
            return self._cpu_kernels.stream_fill(out, stream, offset)
        return stream_values(stream, offset, out.numel(), out=out)

    def fill_chunk(self, out: torch.Tensor, step: int, query: int, ref: ChunkRef, scale: float = 1.0) -> torch.Tensor:
        """Write scale * chunk `ref`'s z into `out` (a float32 tensor of ref.stop - ref.start
        elements). scale >= 0, folded into the draw, one pass instead of two, with the value of
        z.mul_(scale) bitwise (`tests/unit/test_directions.py` checks that)."""
        if scale < 0:
            raise ValueError(f"a draw's scale is a standard deviation; got {scale}")
        if self.clock is None:
            return self._fill_chunk(out, step, query, ref, scale)
        started = time.perf_counter()
        try:
            return self._fill_chunk(out, step, query, ref, scale)
        finally:
            self.clock.add(draw=time.perf_counter() - started)

    def _fill_chunk(self, out: torch.Tensor, step: int, query: int, ref: ChunkRef, scale: float) -> torch.Tensor:
        if self.counter_draws:
            return cuda_draws.fill_span(out, self.key_hash(step, query, ref.key), ref.index,
                                        ref.per_chunk, scale, self.distribution == "gaussian")
        return self.fill_stream(out, self._chunk_stream(step, query, ref, scale))

    def generate(self, shape: Sequence[int], key: int, step: int, query: int) -> torch.Tensor:
        """The full z of one parameter (float32, contiguous)."""
        z = torch.empty(tuple(shape), dtype=torch.float32, device=self.device)
        flat = z.view(-1)
        self.map(lambda u: self.fill_chunk(flat[u[0].start:u[0].stop], step, query, u[0]), self.units(key, shape),
                 lambda u: _ref_size(u[0]))
        return z

    def rows(self, shape: Sequence[int], key: int, step: int, query: int, rows: torch.Tensor) -> torch.Tensor:
        """z[rows] of a parameter (rows along dim 0): only those rows of its counter streams."""
        gaussian = self.distribution == "gaussian"
        row = row_numel(shape)
        rows_per_chunk = chunk_numel(shape) // row
        if self.counter_draws:  # one launch, and no wait for the host to see the row indices
            out = torch.empty((rows.numel(), row), dtype=torch.float32, device=self.device)
            return cuda_draws.fill_rows(out, self.key_hash(step, query, key), rows, row, rows_per_chunk, 1.0, gaussian)
        rows_cpu = rows.tolist()
        seed_of = {c: self.chunk_seed(step, query, key, c) for c in {r // rows_per_chunk for r in rows_cpu}}
        seeds = [seed_of[r // rows_per_chunk] for r in rows_cpu]  # each chunk's seed hashed once
        offsets = [(r % rows_per_chunk) * row for r in rows_cpu]
        if self._cpu_kernels is not None:
            return self._cpu_kernels.stream_rows(torch.empty(len(rows_cpu), row), seeds, offsets, 1.0, gaussian)
        return stream_rows(torch.tensor([as_int64(s) for s in seeds], dtype=torch.int64, device=self.device),
                           torch.tensor(offsets, dtype=torch.int64, device=self.device), row, 1.0, gaussian)

    # --- what a direction rule may add (low-rank factors, a magnitude mask) ------------------------

    def update_terms(self, step: int, coefficients: Sequence[tuple[int, float]],
                     terms: list[tuple[int, float]], unit: float) -> list[tuple[int, float]]:
        """The (query, scale) terms whose z the update of `step` applies: by default the rule's
        terms of the step's coefficients; a rule with a momentum of its own (LOZO-M) records the
        coefficients and returns its update query with `unit`, the rule's scale of a coefficient of 1."""
        return terms

    def magnitude_threshold(self, key: int) -> float | None:
        """A parameter's magnitude mask (Sparse MeZO): z reaches only elements with |x| <= this
        (x the master's value where the mask is read); None: every element."""
        return None

    def refreshes_at(self, step: int) -> bool:
        """Whether `refresh` runs before step `step`'s probes (on the weights as they are then)."""
        return False

    def refresh(self, step: int, params: TrainableParams) -> None:
        """Re-derive what the directions read of the weights (Sparse MeZO's thresholds)."""

    def state(self) -> dict[str, torch.Tensor]:
        """What the directions keep between steps that a snapshot must carry (names without '/' clash
        with no parameter's state); {} for counter-derived z alone."""
        return {}

    def state_keys(self) -> set[str]:
        """The names `state` returns (a snapshot's state is checked against them)."""
        return set()

    def load_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Continue from a snapshot's `state`."""

    def state_bytes(self) -> int:
        """Bytes of what `state` holds, on this rank."""
        return 0

    def memory_bytes(self) -> int:
        """Bytes the directions hold on this rank: their state and what they keep at hand (factors)."""
        return self.state_bytes()

    def close(self) -> None:
        self.workers.close()


def gaussian_generator_id(device: torch.device) -> str:
    """What a device's Gaussian draws depend on besides the seed: the device type and the stream's
    scheme, and on CUDA the GPU architecture. CUDA Gaussian z is a counter stream (`cuda_draws`),
    independent of the launch grid and so of the SM count (H100 SXM, H100 PCIe and MIG slices draw the
    same z), but its ln, cos and sin are the architecture's own approximate instructions, so another
    compute capability may round differently. CPU Gaussian z (`streams`) is float32 arithmetic alone:
    the same on every CPU. Runs of earlier schemes recorded "cpu" (torch's normal_, before
    DIRECTIONS_VERSION 6) and "cuda:counter-gaussian:sm_XY". Rademacher z is a counter stream of signs:
    the same everywhere."""
    device = torch.device(device)
    if device.type == "cpu":
        return f"cpu:{GAUSSIAN_SCHEME}"
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"cuda:{cuda_draws.GAUSSIAN_SCHEME}:sm_{major}{minor}"
