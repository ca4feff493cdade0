"""The Rademacher stream: the one definition of Rademacher directions, in torch ops.

Element e of a chunk's stream is +1 when bit e % 64 of word e // 64 is set, -1 otherwise, where word
j is output j of SplitMix64 started at the chunk's seed: the splitmix64 finaliser of
seed + (j + 1) * golden gamma, all modulo 2^64. Any element range of a chunk can therefore be drawn on
its own, the values are the same on every device, and the fused CPU kernels (`distzo/native`, which
import `Stream` from here and are checked against `stream_signs` when they load) generate the same
values inside their pass without writing z to memory.
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
    """A chunk's Rademacher z as a counter stream: element e is +scale when bit e % 64 of word e // 64
    of the chunk's SplitMix64 stream is set, else -scale."""

    seed: int
    scale: float


def as_int64(c: int) -> int:
    """A 64-bit pattern as the signed integer torch's int64 arithmetic (which wraps) works on."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic on int64)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def stream_words(seeds: torch.Tensor | int, words: torch.Tensor) -> torch.Tensor:
    """SplitMix64 output `words` (int64 word indices) of the streams started at `seeds`, as int64
    bit patterns: the splitmix64 finaliser of seed + (word + 1) * golden gamma, all modulo 2^64."""
    seeds = as_int64(seeds) if isinstance(seeds, int) else seeds
    x = (words + 1) * as_int64(_GAMMA) + seeds
    x = (x ^ _shr(x, 30)) * as_int64(_MIX1)
    x = (x ^ _shr(x, 27)) * as_int64(_MIX2)
    return x ^ _shr(x, 31)


_UNIT_SIGNS: dict[torch.device, torch.Tensor] = {}


def _unit_signs(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: row b holds +-1 for bits 0..7 of byte b (bit set: +1)."""
    table = _UNIT_SIGNS.get(device)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1
        with torch.inference_mode(False):
            table = _UNIT_SIGNS[device] = (bits.float() * 2 - 1).to(device)
    return table


def stream_signs(seed: int, offset: int, n: int, scale: float = 1.0,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Elements [offset, offset + n) of the Rademacher stream of a chunk with this seed, times scale
    (float32; +-fl32(scale), exact), in torch ops: the definition the fused kernels reproduce."""
    device = torch.device(device)
    first, stop = offset >> 6, (offset + n + 63) >> 6
    words = stream_words(seed, torch.arange(first, stop, dtype=torch.int64, device=device))
    if sys.byteorder == "little":  # byte b of a word holds its bits 8b .. 8b + 7
        unit = _unit_signs(device)[words.view(torch.uint8).long()].view(-1)
    else:
        unit = (((words[:, None] >> torch.arange(64, device=device)) & 1) * 2 - 1).float().view(-1)
    start = offset - 64 * first
    return unit[start:start + n].mul_(torch.tensor(scale, dtype=torch.float32))


def stream_rows(seeds: torch.Tensor, offsets: torch.Tensor, row: int, scale: float = 1.0) -> torch.Tensor:
    """[len(seeds), row] float32: row r = elements [offsets[r], offsets[r] + row) of stream seeds[r]
    (int64 bit patterns), times scale: `stream_signs` for many short ranges at once."""
    elements = offsets[:, None] + torch.arange(row, dtype=torch.int64, device=offsets.device)
    bits = (stream_words(seeds[:, None], elements >> 6) >> (elements & 63)) & 1
    magnitude = torch.tensor(scale, dtype=torch.float32, device=offsets.device)
    return torch.where(bits.bool(), magnitude, -magnitude)
