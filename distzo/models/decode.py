"""A quantized base's weights decoded for the forward: one kernel into one reused buffer
(`engine.quantized_matmul=decoded`).

torchao's weight-only linears decode on every call, with several kernels and fresh memory: int8
converts the whole int8 weight to the activation's dtype and scales the product; NF4 rebuilds the
weight with about fifteen elementwise kernels. On an H100 a LoRA step on an int8 base of `llama-1b`
took 1.6x the float32 base's, 2.0x on NF4. Here each quantized linear decodes its weight with one
kernel (Triton on CUDA; torchao's own dequantization elsewhere, where speed is not the point) into a
scratch buffer that every quantized layer of the model shares, in the dtype the product runs in
(bfloat16 under `engine.compute=bf16`), and then runs the float base's `F.linear` on it. The stock
layer is untouched: a forward pre-hook puts the decoded weight in place for the call and a forward
hook puts the quantized one back.

Exactness: the decoded weight is torchao's `dequantize()` bitwise (int8: q times its row's scale;
NF4: the code's table value times its block's scaler, each scaler rebuilt in the kernel with the
operations of torchao's `dequantize_scalers`, IEEE division included),
rounded once to the product's dtype, as autocast would round it. The product is then the float
path's on that weight. torchao's int8 forward scales the product instead of the weight, so the two
settings differ by rounding; every engine path decodes the same way, so streamed and resident runs
and any mesh agree within a setting as before. The Triton kernels round to bfloat16 with integer
arithmetic (to nearest, ties to even; distzo/native/rounding.py), so they compute the same bits on a
GPU and under Triton's interpreter (TRITON_INTERPRET=1, a CPU: tests/unit/test_decode.py).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..native.rounding import as_kernel_arg, dtype_code

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs decode with torch ops
    triton = tl = None
else:
    from ..native.rounding import round_to, store_as

_BLOCK = 1024


def is_int8(weight: torch.Tensor) -> bool:
    return type(weight).__name__ == "Int8Tensor"


def is_nf4(weight: torch.Tensor) -> bool:
    return type(weight).__name__ == "NF4Tensor"


if triton is not None:
    @triton.jit
    def _int8_kernel(q_ptr, scale_ptr, out_ptr, n_cols, total, WEIGHT: tl.constexpr, OUT: tl.constexpr,
                     BLOCK: tl.constexpr):
        # out[r, c] = q[r, c] * scale[r], rounded to the weight's dtype (torchao's dequantize), then
        # to the output's.
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < total
        q = tl.load(q_ptr + offsets, mask=mask, other=0).to(tl.float32)
        scale = tl.load(scale_ptr + offsets // n_cols, mask=mask, other=0).to(tl.float32)
        x = round_to(round_to(q * scale, WEIGHT), OUT)
        store_as(out_ptr, offsets, x, mask, OUT)

    @triton.jit
    def _nf4_kernel(packed_ptr, lut_ptr, qscaler_ptr, factor_ptr, mean_ptr, out_ptr, block_size, scaler_block,
                    total, WEIGHT: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr):
        # Element i: code = high nibble of byte i // 2 for even i, low nibble for odd i; its block's
        # scaler decoded as torchao's dequantize_scalers does, each operation rounded to the weight's
        # dtype: qscaler[b] / factor[b // scaler_block] + mean, b = i // block_size; value =
        # lut[code] * scaler, rounded to the weight's dtype, then to the output's.
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < total
        byte = tl.load(packed_ptr + offsets // 2, mask=mask, other=0).to(tl.int32)
        code = tl.where(offsets % 2 == 0, byte >> 4, byte & 15)
        value = tl.load(lut_ptr + code, mask=mask, other=0).to(tl.float32)
        b = offsets // block_size
        qs = tl.load(qscaler_ptr + b, mask=mask, other=0).to(tl.float32)
        factor = tl.load(factor_ptr + b // scaler_block, mask=mask, other=1).to(tl.float32)
        mean = tl.load(mean_ptr).to(tl.float32)
        scaler = round_to(round_to(tl.math.div_rn(qs, factor), WEIGHT) + mean, WEIGHT)
        x = round_to(round_to(value * scaler, WEIGHT), OUT)
        store_as(out_ptr, offsets, x, mask, OUT)


def decode_with_kernel(weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The Triton kernels' decode of a torchao int8 or NF4 weight into `out` (contiguous, the
    weight's shape, float32, bfloat16 or float16): on CUDA, or on CPU tensors under Triton's
    interpreter."""
    if not (is_int8(weight) or is_nf4(weight)):
        raise TypeError(f"no decoder for a {type(weight).__name__} weight")
    total = out.numel()
    target = as_kernel_arg(out)  # bfloat16 stored as its bits
    grid, codes = (triton.cdiv(total, _BLOCK),), dict(WEIGHT=dtype_code(weight.dtype), OUT=dtype_code(out.dtype))
    if is_int8(weight):
        q, scale = weight.qdata.contiguous(), weight.scale.reshape(-1).contiguous()
        _int8_kernel[grid](q, scale, target, q.shape[-1], total, **codes, BLOCK=_BLOCK)
    else:  # the scalers are decoded in the kernel too: no torch op per call
        _nf4_kernel[grid](weight.quantized_data.contiguous(), weight.nf4.contiguous(),
                          weight.quantized_scalers.contiguous(), weight.quantization_factor.contiguous(),
                          weight.scaler_mean.reshape(1), target, weight.block_size, weight.scaler_block_size, total,
                          **codes, BLOCK=_BLOCK)
    return out


def decode_reference(weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """torchao's own dequantization of `weight`, rounded into `out`: what the kernels must equal."""
    full = weight.dequantize() if is_int8(weight) else weight.get_original_weight()
    return out.copy_(full)


def decode(weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`weight` decoded into `out`: the kernel on CUDA, torchao's dequantization elsewhere (the same
    values)."""
    if out.device.type == "cuda":
        if triton is None:
            raise RuntimeError("engine.quantized_matmul=decoded decodes with a Triton kernel on CUDA, and Triton is "
                               "not installed; torch's CUDA wheels bring it")
        return decode_with_kernel(weight, out)
    return decode_reference(weight, out)


class DecodedLinears:
    """Hooks on a model's quantized linear layers: for each call the layer's weight is decoded into
    the shared scratch buffer (the largest layer's size, per device and dtype) and put in place of
    the quantized one; the forward hook puts the quantized weight back."""

    def __init__(self, layers: Iterable[nn.Linear]):
        self.layers = list(layers)
        self.largest = max((m.weight.numel() for m in self.layers), default=0)
        self.scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.held: dict[nn.Module, torch.Tensor] = {}
        self.handles = [h for m in self.layers for h in (m.register_forward_pre_hook(self._decode),
                                                          m.register_forward_hook(self._restore))]

    def _buffer(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self.scratch:
            self.scratch[key] = torch.empty(self.largest, device=device, dtype=dtype)
        return self.scratch[key]

    def _decode(self, module: nn.Module, args) -> None:
        weight = module._parameters["weight"]  # the quantized tensor (a streamed block's view, under the engine)
        x = args[0]
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        out = self._buffer(x.device, dtype)[:weight.numel()].view(weight.shape)
        self.held[module] = weight
        module._parameters["weight"] = decode(weight, out)

    def _restore(self, module: nn.Module, args, output):
        module._parameters["weight"] = self.held.pop(module)
        return output

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.scratch.values())
