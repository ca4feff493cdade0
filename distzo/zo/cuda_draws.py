"""z on CUDA: one Triton kernel draws any element range of a parameter, chunk seeds derived in the kernel.

On the CPU a chunk's z comes from a generator seeded per chunk (`Directions.fill_chunk`), one call
per ~1M-element chunk. On a GPU that is one Python call, one generator and several kernel launches
per chunk: a 1B-parameter step made ~1,000 of them, and the host, not the GPU, set its pace
(docs/performance.md). Here one launch covers a whole span of chunks (a parameter, or the rows an
embedding lookup reads): each program derives its chunk's seed from the parameter's hash and the
chunk index with the same SplitMix64 finaliser as `Directions.chunk_seed`, so the values are a pure
function of (seed, step, query, parameter, element), whatever the launch grid.

Both distributions are counter streams here:

- Rademacher: the stream of `distzo.zo.streams` (bit e % 64 of SplitMix64 word e // 64), bitwise
  the same values as on the CPU.
- Gaussian: elements 2j and 2j + 1 of a chunk are the two outputs of the Box-Muller transform of
  word j of the chunk's SplitMix64 stream: u1 = (top 24 bits + 1) / 2^24 in (0, 1], u2 = (next 24
  bits) / 2^24 in [0, 1), r = sqrt(-2 ln u1), t = pi (2 u2 - 1) in [-pi, pi), z_2j = r cos t,
  z_2j+1 = r sin t. It replaces torch's CUDA `normal_`, whose values depend on the GPU's
  multiprocessor count (its launch grid sets each thread's Philox offsets).

ln, cos and sin are the GPU's approximate instructions (lg2.approx, cos.approx and sin.approx, through
libdevice's fast_logf, fast_cosf and fast_sinf: relative error about 2^-22 for ln, absolute 2^-21 for
cos and sin on [-pi, pi], hence t's range), and one word serves two elements: the draw kernel is 45
instructions an element where the IEEE functions and a word per element took 205 (static SASS for
sm_90, `benchmarks/kernel_sass.py`; the draws were 13-18% of a float16 OPT's forward passes on an
H100, BENCHMARKS.md).
z's distribution is N(0, 1) to that precision, which is far below what a zeroth-order estimate
resolves. The values are the same on every GPU of one architecture running the same kernel;
`gaussian_generator_id` records the architecture and the scheme, and resume/replay compare it. Under
Triton's interpreter (CPU tests) the functions are numpy's: the same stream to their precision.

The kernels are compiled on first use (a second or two). torch's CUDA builds ship with Triton.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: nothing here is used there
    triton = tl = None

_BLOCK = 1024
_MASK32 = (1 << 32) - 1
# Every kernel that draws z is compiled without contracting a product and a sum into one fused
# multiply-add (Triton's default contracts them). Each operation then rounds once, as torch's
# elementwise kernels do, so a kernel that draws z and applies it in one pass (distzo.native.cuda)
# computes bitwise what this draw followed by torch's add computes, and draws the same z as this one.
UNFUSED = {"enable_fp_fusion": False}
# The Gaussian stream's scheme, part of `Directions.gaussian_generator_id` on CUDA: "counter-gaussian"
# drew one word and IEEE ln and cos per element (DIRECTIONS_VERSION 4); "gaussian-pairs" is this one.
GAUSSIAN_SCHEME = "gaussian-pairs"


def _interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1, true, on or yes; or set in
    code): it runs no libdevice call (the CPU tests), so numpy's functions stand in for the GPU's."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


INTERPRETED = triton is not None and _interpreted()


def split64(value: int) -> tuple[int, int]:
    """A 64-bit hash as the two halves a kernel takes it in (`join64`), each as a signed 32-bit int.

    Triton types an int argument by its value (i32, i64 or u64) and compiles a kernel per combination
    of types: a hash passed whole gave a new combination on about every second step, and each cost a
    compile (or a load from Triton's disk cache) inside the step. Two i32 halves keep one signature."""
    value &= (1 << 64) - 1
    hi, lo = value >> 32, value & _MASK32
    return (hi - (1 << 32) if hi >= 1 << 31 else hi), (lo - (1 << 32) if lo >= 1 << 31 else lo)


def require() -> None:
    """Raise a clear error where CUDA directions cannot be drawn."""
    if triton is None:
        raise RuntimeError("perturbation directions on CUDA are drawn by a Triton kernel, and Triton is not "
                           "installed; torch's CUDA wheels bring it (pip install triton matching your torch)")


if triton is not None:
    @triton.jit
    def _mix64(x):
        """The splitmix64 finaliser of x + golden gamma (uint64, wrapping): `rademacher.mix64`."""
        x = x + 0x9E3779B97F4A7C15
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB
        return x ^ (x >> 31)

    @triton.jit
    def join64(hi, lo):
        """The uint64 whose halves `split64` passed (each an i32 bit pattern)."""
        return (hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | lo.to(tl.uint32, bitcast=True).to(tl.uint64)

    from triton.language.extra import libdevice

    # Compile-time switch (a constexpr global): the GPU's approximate functions, or numpy's where
    # Triton's interpreter runs the kernels.
    FAST_MATH = tl.constexpr(not INTERPRETED)

    @triton.jit
    def _polar(word):
        """Box-Muller's radius and angle of one SplitMix64 word (uint64): r = sqrt(-2 ln u1),
        t = pi (2 u2 - 1), u1 from its top 24 bits plus one, u2 from the next 24, each / 2^24. The
        approximate ln's error is absolute near u1 = 1, where it may come out above 0: clamped, so
        r is 0 there rather than NaN (z then off by at most 3e-4, for about one word in 10^6)."""
        u1 = ((word >> 40).to(tl.float32) + 1.0) * 5.9604644775390625e-08
        u2 = ((word >> 16) & 0xFFFFFF).to(tl.float32) * 5.9604644775390625e-08
        if FAST_MATH:
            ln = libdevice.fast_logf(u1)
        else:
            ln = tl.log(u1)
        return tl.sqrt(tl.maximum(-2.0 * ln, 0.0)), (u2 * 2.0 - 1.0) * 3.1415927410125732

    @triton.jit
    def _cos_sin(r, t):
        """Both Box-Muller outputs of (r, t): r cos t (a word's even element), r sin t (its odd one)."""
        if FAST_MATH:
            c, s = libdevice.fast_cosf(t), libdevice.fast_sinf(t)
        else:
            c, s = tl.cos(t), tl.sin(t)
        return r * c, r * s

    @triton.jit
    def draw(key_hash, chunk, offset, GAUSSIAN: tl.constexpr):
        """z (unit scale, float32) of element `offset` of chunk `chunk` of the parameter whose
        `Directions.key_hash` is key_hash (all uint64): the one definition every kernel draws by
        (`draw_block` draws the same values for a block of consecutive elements, a word per two)."""
        seed = _mix64(key_hash ^ chunk)  # Directions.chunk_seed's last step
        if GAUSSIAN:
            r, t = _polar(_mix64(seed + (offset >> 1) * 0x9E3779B97F4A7C15))  # SplitMix64 output offset // 2
            even, odd = _cos_sin(r, t)
            z = tl.where((offset & 1) == 0, even, odd)
        else:
            word = _mix64(seed + (offset >> 6) * 0x9E3779B97F4A7C15)
            z = tl.where(((word >> (offset & 63)) & 1) != 0, 1.0, -1.0)
        return z

    @triton.jit
    def draw_block(key_hash, chunk, first, BLOCK: tl.constexpr, GAUSSIAN: tl.constexpr):
        """`draw` of elements first .. first + BLOCK - 1 of one chunk (first even, a uint64 scalar):
        a Gaussian word gives both its elements (cos, then sin: the same products as `draw`'s)."""
        if GAUSSIAN:
            seed = _mix64(key_hash ^ chunk)
            pair = (first >> 1) + tl.arange(0, BLOCK // 2).to(tl.uint64)
            r, t = _polar(_mix64(seed + pair * 0x9E3779B97F4A7C15))
            even, odd = _cos_sin(r, t)
            z = tl.interleave(even, odd)
        else:
            z = draw(key_hash, chunk, first + tl.arange(0, BLOCK).to(tl.uint64), False)
        return z

    @triton.jit(do_not_specialize=["key_hi", "key_lo", "first_chunk"])
    def _draw_kernel(out_ptr, chunk_ptr, base_ptr, first_chunk, n_cols, col_blocks, total, key_hi, key_lo, scale,
                     TABLES: tl.constexpr, GAUSSIAN: tl.constexpr, BLOCK: tl.constexpr):
        # Row r of the output holds elements [base_r, base_r + n_cols) of chunk c_r: from the tables
        # (TABLES: embedding rows), else c_r = first_chunk + r and base_r = 0 (a span of whole chunks).
        # Only the first `total` elements of the flat output are written (a span's last chunk may be
        # short). One grid dimension (rows x column blocks): the second is capped at 65,535 blocks.
        pid = tl.program_id(0).to(tl.int64)
        row = pid // col_blocks
        col = (pid - row * col_blocks) * BLOCK + tl.arange(0, BLOCK)
        flat = row * n_cols + col
        mask = (col < n_cols) & (flat < total)
        key_hash = join64(key_hi, key_lo)
        if TABLES:  # a row's elements start anywhere in its chunk: each element by itself
            chunk = tl.load(chunk_ptr + row).to(tl.uint64, bitcast=True)
            offset = (tl.load(base_ptr + row) + col).to(tl.uint64, bitcast=True)
            z = draw(key_hash, chunk, offset, GAUSSIAN)
        else:  # a block of a chunk from an element that is a multiple of BLOCK
            chunk = first_chunk.to(tl.uint64) + row.to(tl.uint64)
            z = draw_block(key_hash, chunk, ((pid - row * col_blocks) * BLOCK).to(tl.uint64), BLOCK, GAUSSIAN)
        tl.store(out_ptr + flat, z * scale, mask=mask)


def _launch(out: torch.Tensor, rows: int, n_cols: int, key_hash: int, scale: float, gaussian: bool,
            first_chunk: int = 0, chunks: torch.Tensor | None = None,
            bases: torch.Tensor | None = None) -> torch.Tensor:
    require()
    total = out.numel()
    if total == 0 or rows == 0:
        return out
    col_blocks = triton.cdiv(n_cols, _BLOCK)
    tables = chunks is not None
    _draw_kernel[(rows * col_blocks,)](out, chunks if tables else out, bases if tables else out, first_chunk, n_cols,
                                       col_blocks, total, *split64(key_hash), float(scale), TABLES=tables,
                                       GAUSSIAN=gaussian, BLOCK=_BLOCK, **UNFUSED)
    return out


def fill_span(out: torch.Tensor, key_hash: int, first_chunk: int, per_chunk: int, scale: float,
              gaussian: bool) -> torch.Tensor:
    """out (float32, contiguous, on the GPU) = scale * z of elements [first_chunk * per_chunk,
    ... + out.numel()) of a parameter whose chunks hold `per_chunk` elements (whole chunks from the
    first; the last may be short). key_hash: `Directions.key_hash(step, query, key)`."""
    return _launch(out, -(-out.numel() // per_chunk), per_chunk, key_hash, scale, gaussian, first_chunk=first_chunk)


def fill_rows(out: torch.Tensor, key_hash: int, rows: torch.Tensor, row_len: int, rows_per_chunk: int,
              scale: float, gaussian: bool) -> torch.Tensor:
    """out [len(rows), row_len] (float32, contiguous) = scale * z of those rows of a parameter whose
    chunks hold `rows_per_chunk` rows: one launch, no synchronisation with the host."""
    rows = rows.to(torch.int64)
    chunks = torch.div(rows, rows_per_chunk, rounding_mode="floor")
    bases = (rows - chunks * rows_per_chunk) * row_len
    return _launch(out, rows.numel(), row_len, key_hash, scale, gaussian, chunks=chunks, bases=bases)
