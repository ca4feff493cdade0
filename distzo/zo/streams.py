"""Counter streams: the one definition, in torch ops, of the z the CPU draws (Rademacher and Gaussian).

Word j of a chunk's stream is output j of SplitMix64 started at the chunk's seed: the splitmix64
finaliser of seed + (j + 1) * golden gamma, all modulo 2^64. z is a pure function of (seed, element),
so any element range of a chunk can be drawn on its own, and the fused CPU kernels (`distzo/native`,
which import `Stream` from here and are checked against `stream_values` when they load) generate the
same values inside their pass without writing z to memory.

- Rademacher: element e is +1 when bit e % 64 of word e // 64 is set, -1 otherwise. Exact, so the
  same on every device.
- Gaussian: elements 2j and 2j + 1 are the two outputs of the Box-Muller transform of word j, with the
  bit layout of the CUDA stream (`distzo.zo.cuda_draws`): u1 = (top 24 bits + 1) / 2^24 in (0, 1],
  u2 = (next 24 bits) / 2^24, r = sqrt(-2 ln u1), t = pi (2 u2 - 1), z_2j = r cos t, z_2j+1 = r sin t.
  ln, cos and sin are computed here, not by a maths library, from float32 additions, multiplications,
  one division and one square root, each rounded once (IEEE 754), so every CPU and every compiler
  gives the same bits (libm's and torch's vectorised functions differ between instruction sets). ln
  u1 = (e - 24) ln 2 + ln m with u1 2^24 = m 2^e, m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(s),
  s = (m - 1) / (m + 1), by its series to s^9; t's quadrant comes from the angle's integer bits, and
  cos and sin of the remainder in [-pi/4, pi/4] by their Taylor series to x^10 and x^9. Against the
  exact transform of the same u1 and u2, z is off by at most 1.6e-6: r by at most 4.6e-7 over all
  2^24 values of u1, cos and sin by at most 1.4e-7 over all 2^24 angles (both checked exhaustively in
  tests/unit/test_native.py), r <= 5.77, and the product's rounding; the series' own errors are
  below 2e-9. The CUDA stream computes the same transform with the GPU's approximate functions
  (absolute error 2^-21 in cos and sin): the two agree to a few 1e-6, not bitwise (and to 3e-4 for
  the words near u1 = 1 that cuda_draws clamps).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
_GAMMA, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix64(x: int) -> int:
    """splitmix64 finaliser: a bijective 64-bit mix with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)



@dataclass(frozen=True)
class Stream:
    """A chunk's z times scale as a counter stream: its seed, the scale, and the distribution
    (Rademacher, or Gaussian when `gaussian`)."""

    seed: int
    scale: float
    gaussian: bool = False


def as_int64(c: int) -> int:
    """A 64-bit pattern as the signed integer torch's int64 arithmetic (which wraps) works on."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic on int64, and it has no
    uint64 shifts), as a new tensor."""
    return (x >> k).bitwise_and_((1 << (64 - k)) - 1)


def stream_words(seeds: torch.Tensor | int, words: torch.Tensor) -> torch.Tensor:
    """SplitMix64 output `words` (int64 word indices) of the streams started at `seeds`, as int64
    bit patterns: the splitmix64 finaliser of seed + (word + 1) * golden gamma, all modulo 2^64."""
    seeds = as_int64(seeds) if isinstance(seeds, int) else seeds
    x = (words + 1).mul_(as_int64(_GAMMA)) + seeds  # seeds may broadcast words (stream_rows)
    x.bitwise_xor_(_shr(x, 30)).mul_(as_int64(_MIX1))  # in place from here: each op one pass, no new tensor
    return x.bitwise_xor_(_shr(x, 27)).mul_(as_int64(_MIX2)).bitwise_xor_(_shr(x, 31))


_UNIT_SIGNS: dict[torch.device, torch.Tensor] = {}


def _unit_signs(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: row b holds +-1 for bits 0..7 of byte b (bit set: +1)."""
    table = _UNIT_SIGNS.get(device)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1
        with torch.inference_mode(False):
            table = _UNIT_SIGNS[device] = (bits.float() * 2 - 1).to(device)
    return table


def _scaled_into(out: torch.Tensor | None, values: torch.Tensor, scale: float) -> torch.Tensor:
    """values * fl32(scale) (one rounding: exact for signs), written into `out` when given (one pass,
    no tensor of the result's size allocated and copied)."""
    magnitude = torch.tensor(scale, dtype=torch.float32)
    if out is None:
        return values.mul_(magnitude)
    if out.shape != values.shape:
        raise ValueError(f"out: needs {values.numel()} elements in one dimension, got shape {tuple(out.shape)}")
    return torch.mul(values, magnitude, out=out)


def stream_signs(seed: int, offset: int, n: int, scale: float = 1.0, device: torch.device | str = "cpu",
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Elements [offset, offset + n) of the Rademacher stream of a chunk with this seed, times scale
    (float32; +-fl32(scale), exact), in torch ops: the definition the fused kernels reproduce.
    Written into `out` (n elements, one dimension; its device is used) when given."""
    device = out.device if out is not None else torch.device(device)
    first, stop = offset >> 6, (offset + n + 63) >> 6
    words = stream_words(seed, torch.arange(first, stop, dtype=torch.int64, device=device))
    if sys.byteorder == "little":  # byte b of a word holds its bits 8b .. 8b + 7
        unit = _unit_signs(device)[words.view(torch.uint8).long()].view(-1)
    else:
        unit = (((words[:, None] >> torch.arange(64, device=device)) & 1) * 2 - 1).float().view(-1)
    start = offset - 64 * first
    return _scaled_into(out, unit[start:start + n], scale)


# The Gaussian stream's scheme, recorded with the CPU's Gaussian draws (`gaussian_generator_id`).
GAUSSIAN_SCHEME = "gaussian-pairs-series"
# Its constants, each a float32 value (written in hex here and in kernels.c, so both read the same bits):
# 1/3 .. 1/9 of atanh's series; sin's Taylor coefficients -1/3! .. 1/9!, cos's 1/4! .. -1/10!; ln 2 in
# two parts (the high one has 15 significant bits, so its product with an exponent is exact); the
# angle of one step of the 22-bit remainder, (pi / 2) / 2^22.
_LN_SERIES = tuple(float.fromhex(h) for h in ("0x1.c71c72p-4", "0x1.24924ap-3", "0x1.99999ap-3", "0x1.555556p-2"))
_SIN_SERIES = tuple(float.fromhex(h) for h in ("0x1.71de3ap-19", "-0x1.a01a02p-13", "0x1.111112p-7",
                                               "-0x1.555556p-3"))
_COS_SERIES = tuple(float.fromhex(h) for h in ("-0x1.27e4fcp-22", "0x1.a01a02p-16", "-0x1.6c16c2p-10",
                                               "0x1.555556p-5"))
_LN2_HI, _LN2_LO = float.fromhex("0x1.62e4p-1"), float.fromhex("0x1.7f7d1cp-20")
_ANGLE_STEP = float.fromhex("0x1.921fb6p-22")
# Words per block of the torch path, whose ~100 elementwise passes then work on tensors of 256 to 512
# KiB: measured faster than 2^15 or 2^17 words and than whole 2^20-element chunks (the kernels need
# none of it).
_WORDS_PER_BLOCK = 1 << 16


def _horner(x2: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    """((c0 x2 + c1) x2 + c2) ... : one rounding per operation, as kernels.c's loops do."""
    p = (x2 * coefficients[0]).add_(coefficients[1])
    for c in coefficients[2:]:
        p.mul_(x2).add_(c)
    return p


# A float32 sign bit, as an int32 (the negation torch performs is this bit flipped).
_SIGN_BIT = -(1 << 31)


def gaussian_pairs(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(r cos t, r sin t) of each word (int64 bit patterns): elements 2j and 2j + 1 of the Gaussian
    stream for word j, float32, in the operations kernels.c performs (the module docstring).

    Fast on torch ops too (no kernels, no compiler): each operation is one elementwise pass, in place
    where its input is not needed again; the quadrant's swap and signs are bit operations on the
    float32 patterns, as in kernels.c (four torch.where on boolean masks took half the time of the
    definition before). Division and square root
    are taken in float64 and rounded once to float32, which gives C's correctly rounded `/` and
    sqrtf: torch's vectorised float32 sqrt is not (it may come out one unit in the last place off;
    53 >= 2 x 24 + 2 bits makes the double rounding innocuous)."""
    k = (words >> 40).bitwise_and_(0xFFFFFF).to(torch.int32).add_(1)  # u1 2^24, in [1, 2^24]: exact in float32
    bits = k.to(torch.float32).view(torch.int32)
    mantissa = bits.bitwise_and(0x007FFFFF).bitwise_or_(0x3F800000)  # m in [1, 2) ...
    halve = torch.sub(0x3FB504F3, mantissa).bitwise_right_shift_(31)  # ... -1 where above sqrt(2), else 0:
    m = mantissa.add_(halve << 23).view(torch.float32)  # there m is halved (its exponent lowered by one)
    e = bits.bitwise_right_shift_(23).sub_(halve).sub_(127 + 24).to(torch.float32)  # ln u1 = e ln 2 + ln m
    s = (m - 1.0).double().div_((m + 1.0).double()).to(torch.float32)
    s2 = s * s
    ln_m = s.add_(s).mul_(_horner(s2, _LN_SERIES).mul_(s2).add_(1.0))
    ln_u1 = (e * _LN2_HI).add_(e.mul_(_LN2_LO).add_(ln_m))  # e ln2_hi first: e is reused in place after it
    r = ln_u1.mul_(-2.0).double().sqrt_().to(torch.float32)
    angle = (words >> 16).bitwise_and_(0xFFFFFF).to(torch.int32)  # t = pi (angle / 2^23 - 1)
    quadrant = (angle + (1 << 21)).bitwise_right_shift_(22)  # t + pi = quadrant pi/2 + x
    x = angle.sub_(quadrant << 22).to(torch.float32).mul_(_ANGLE_STEP)  # x in [-pi/4, pi/4)
    x2 = x * x
    sin_x = (x2 * _horner(x2, _SIN_SERIES)).mul_(x).add_(x)
    cos_x = _horner(x2, _COS_SERIES).mul_(x2).sub_(0.5).mul_(x2).add_(1.0)
    # cos and sin of t by quadrant mod 4: 0 (-cos x, -sin x), 1 (sin x, -cos x), 2 (cos x, sin x),
    # 3 (-sin x, cos x): swap the two where the quadrant is odd, then flip the sign bits
    cos_t, sin_t = cos_x.view(torch.int32), sin_x.view(torch.int32)
    swap = (cos_t ^ sin_t).bitwise_and_((quadrant & 1).neg_())
    flip_cos = (quadrant + 1).bitwise_not_().bitwise_left_shift_(30).bitwise_and_(_SIGN_BIT)  # bit 1 clear
    flip_sin = quadrant.bitwise_not_().bitwise_left_shift_(30).bitwise_and_(_SIGN_BIT)
    cos_t.bitwise_xor_(swap).bitwise_xor_(flip_cos)
    sin_t.bitwise_xor_(swap).bitwise_xor_(flip_sin)
    return cos_x.mul_(r), sin_x.mul_(r)


def stream_gaussians(seed: int, offset: int, n: int, scale: float = 1.0, device: torch.device | str = "cpu",
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Elements [offset, offset + n) of the Gaussian stream of a chunk with this seed, times scale
    (float32, fl(z * fl32(scale))), in torch ops: the definition the fused kernels reproduce.
    Written into `out` (n elements, one dimension; its device is used) when given."""
    device = out.device if out is not None else torch.device(device)
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=device)
    elif out.shape != (n,):
        raise ValueError(f"out: needs {n} elements in one dimension, got shape {tuple(out.shape)}")
    first, stop = offset >> 1, (offset + n + 1) >> 1
    for lo in range(first, stop, _WORDS_PER_BLOCK):  # blocks whose passes stay in the cache
        hi = min(lo + _WORDS_PER_BLOCK, stop)
        even, odd = gaussian_pairs(stream_words(seed, torch.arange(lo, hi, dtype=torch.int64, device=device)))
        pairs = torch.view_as_real(torch.complex(even, odd)).view(-1)  # elements 2 lo .. 2 hi, interleaved bitwise
        start, stop_ = max(2 * lo, offset), min(2 * hi, offset + n)
        _scaled_into(out[start - offset:stop_ - offset], pairs[start - 2 * lo:stop_ - 2 * lo], scale)
    return out


def stream_values(stream: Stream, offset: int, n: int, device: torch.device | str = "cpu",
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Elements [offset, offset + n) of a chunk's stream, times its scale (into `out` when given)."""
    draw = stream_gaussians if stream.gaussian else stream_signs
    return draw(stream.seed, offset, n, stream.scale, device, out)


def stream_rows(seeds: torch.Tensor, offsets: torch.Tensor, row: int, scale: float = 1.0,
                gaussian: bool = False) -> torch.Tensor:
    """[len(seeds), row] float32: row r = elements [offsets[r], offsets[r] + row) of stream seeds[r]
    (int64 bit patterns), times scale: `stream_values` for many short ranges at once."""
    elements = offsets[:, None] + torch.arange(row, dtype=torch.int64, device=offsets.device)
    magnitude = torch.tensor(scale, dtype=torch.float32, device=offsets.device)
    if gaussian:
        even, odd = gaussian_pairs(stream_words(seeds[:, None], elements >> 1))
        return torch.where((elements & 1).bool(), odd, even) * magnitude
    bits = (stream_words(seeds[:, None], elements >> 6) >> (elements & 63)) & 1
    return torch.where(bits.bool(), magnitude, -magnitude)
