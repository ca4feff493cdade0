"""Rounding float32 to narrower dtypes inside Triton kernels, the same bits on a GPU and under Triton's
interpreter.

A kernel that writes float16 or bfloat16 must round exactly as torch does (to nearest, ties to even)
or it would not agree bitwise with the torch ops it replaces. float16 conversion does that
everywhere. bfloat16 conversion does on a GPU, but the interpreter (TRITON_INTERPRET=1, how the CPU
suite checks these kernels) truncates, so bfloat16 is rounded here with integer arithmetic and
travels as its 16 bits (a bfloat16 tensor passed as `tensor.view(torch.uint16)`; `as_kernel_arg`).
Dtype codes (constexpr): 0 float32, 1 bfloat16, 2 float16.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: nothing here is used there
    triton = tl = None

CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def dtype_code(dtype: torch.dtype) -> int:
    """How the kernels round a float32 value to `dtype`: 0 keep float32, 1 bfloat16, 2 float16."""
    return CODES[dtype]


def as_kernel_arg(t: torch.Tensor) -> torch.Tensor:
    """What a kernel receives for t: a bfloat16 tensor as its bits (uint16), any other as itself."""
    return t.view(torch.uint16) if t.dtype == torch.bfloat16 else t


if triton is not None:
    @triton.jit
    def round_to(x, CODE: tl.constexpr):
        """x (float32) rounded to bfloat16 (CODE 1) or float16 (CODE 2), returned as float32; CODE 0
        returns x. bfloat16 by integer arithmetic, to nearest with ties to even."""
        if CODE == 1:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        elif CODE == 2:
            x = x.to(tl.float16).to(tl.float32)
        return x

    @triton.jit
    def load_f32(ptr, offsets, mask, CODE: tl.constexpr):
        """Elements of a tensor passed by `as_kernel_arg`, widened to float32 (exactly)."""
        if CODE == 1:
            x = (tl.load(ptr + offsets, mask=mask, other=0).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        return x

    @triton.jit
    def store_as(ptr, offsets, x, mask, CODE: tl.constexpr):
        """Store x (float32, already exact in the target's dtype: `round_to`) in a tensor passed by
        `as_kernel_arg`."""
        if CODE == 1:
            tl.store(ptr + offsets, (x.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16), mask=mask)
        elif CODE == 2:
            tl.store(ptr + offsets, x.to(tl.float16), mask=mask)
        else:
            tl.store(ptr + offsets, x, mask=mask)
