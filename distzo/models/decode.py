"""A quantized base's weights decoded for the forward: one kernel into one reused buffer
(`engine.quantized_matmul=decoded`).

torchao's weight-only linears decode on every call, with several kernels and fresh memory: int8
converts the whole int8 weight to the activation's dtype and scales the product; NF4 rebuilds the
weight with about fifteen elementwise kernels. On an H100 a LoRA step on an int8 base of `llama-1b`
took 1.6x the float32 base's, 2.0x on NF4. Here each quantized linear decodes its weight with one
kernel (Triton on CUDA; on a CPU the C kernels of distzo.native for float32 weights, torchao's own
dequantization for the rest) into a scratch buffer that every quantized layer of the model shares,
in the dtype the product runs in (bfloat16 under `engine.compute=bf16`), and then runs the float
base's `F.linear` on it. The stock layer is untouched: a forward pre-hook puts the decoded weight in
place for the call and a forward hook puts the quantized one back. Each layer's launch is prepared
once (`KernelDecode`) and reused while the layer holds the same weight, so the host's work per call
is the launch.

On a CPU the same hooks serve `engine.quantized_matmul=torchao` too, for NF4 weights multiplied in
float32 or bfloat16 (`only_same`): torchao's NF4 linear is F.linear on its dequantized weight (rounded
to the product's dtype), then the bias added to the product, so decoding that weight with the C kernel
(one pass, where torchao takes about fifteen) and adding the bias the same way changes no bit.

Exactness: the decoded weight is torchao's `dequantize()` bitwise (int8: q times its row's scale;
NF4: the code's table value times its block's scaler, each scaler rebuilt in the kernel with the
operations of torchao's `dequantize_scalers`, IEEE division included),
rounded once to the product's dtype, as autocast would round it. The product is then the float
path's on that weight (the bias inside the matmul). torchao's int8 forward scales the product instead
of the weight, and its NF4 forward adds a bias after the product, so the two settings differ by
rounding (NF4: only in a layer with a bias); every engine path decodes the same way, so streamed and
resident runs and any mesh agree within a setting as before. The Triton kernels round to bfloat16 with integer
arithmetic (to nearest, ties to even; distzo/native/rounding.py), so they compute the same bits on a
GPU and under Triton's interpreter (TRITON_INTERPRET=1, a CPU: tests/unit/test_decode.py).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ..native import DECODED_DTYPES
from ..native.rounding import as_kernel_arg, dtype_code

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs decode with torch ops
    triton = tl = None
else:
    from ..native.rounding import round_to, store_as

_INT8_ROWS, _INT8_COLS = 4, 256  # an int8 program's tile (1,024 elements, each row's scale loaded once)
_NF4_BLOCK = 1024  # an NF4 program's elements (whole blocks of the format)


def is_int8(weight: torch.Tensor) -> bool:
    return type(weight).__name__ == "Int8Tensor"


def is_nf4(weight: torch.Tensor) -> bool:
    return type(weight).__name__ == "NF4Tensor"


if triton is not None:
    @triton.jit
    def _int8_kernel(q_ptr, scale_ptr, out_ptr, n_rows, n_cols, WEIGHT: tl.constexpr, OUT: tl.constexpr,
                     ROWS: tl.constexpr, COLS: tl.constexpr):
        # out[r, c] = q[r, c] * scale[r], rounded to the weight's dtype (torchao's dequantize), then
        # to the output's. A program decodes a tile of ROWS x COLS and loads each row's scale once:
        # no per-element division to find the row (a 64-bit division is about forty instructions).
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        q = tl.load(q_ptr + offsets, mask=mask, other=0).to(tl.float32)
        scale = tl.load(scale_ptr + rows, mask=row_ok, other=0).to(tl.float32)
        x = round_to(round_to(q * scale[:, None], WEIGHT), OUT)
        store_as(out_ptr, offsets, x, mask, OUT)

    @triton.jit
    def _nf4_kernel(packed_ptr, lut_ptr, qscaler_ptr, factor_ptr, mean_ptr, out_ptr, total, WEIGHT: tl.constexpr,
                    OUT: tl.constexpr, GROUP: tl.constexpr, SCALER_GROUP: tl.constexpr, BLOCK: tl.constexpr):
        # A program decodes BLOCK elements, BLOCK // GROUP whole NF4 blocks (GROUP: the weights per
        # absmax block). Element 2j is the high nibble of byte j, element 2j + 1 the low one. Each
        # block's scaler is decoded once, as torchao's dequantize_scalers does, every operation
        # rounded to the weight's dtype: qscaler[b] / factor[b // SCALER_GROUP] + mean; then value =
        # lut[code] * scaler, rounded to the weight's dtype, then to the output's.
        G: tl.constexpr = BLOCK // GROUP
        pid = tl.program_id(0).to(tl.int64)
        half = pid * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
        byte = tl.load(packed_ptr + half, mask=half < total // 2, other=0).to(tl.int32)
        value = tl.load(lut_ptr + tl.interleave(byte >> 4, byte & 15)).to(tl.float32)
        blocks = pid * G + tl.arange(0, G)
        block_ok = blocks < total // GROUP
        qs = tl.load(qscaler_ptr + blocks, mask=block_ok, other=0).to(tl.float32)
        factor = tl.load(factor_ptr + blocks // SCALER_GROUP, mask=block_ok, other=1).to(tl.float32)
        mean = tl.load(mean_ptr).to(tl.float32)
        scaler = round_to(round_to(tl.math.div_rn(qs, factor), WEIGHT) + mean, WEIGHT)
        x = round_to(round_to(tl.reshape(value, (G, GROUP)) * scaler[:, None], WEIGHT), OUT)
        offsets = pid * BLOCK + tl.arange(0, G)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        store_as(out_ptr, offsets, x, offsets < total, OUT)


class KernelDecode:
    """The Triton decode of one torchao int8 or NF4 weight into one output tensor (contiguous, the
    weight's shape, float32, bfloat16 or float16), its launch arguments prepared once: calling it
    launches the kernel (on CUDA, or on CPU tensors under Triton's interpreter). `reusable`: the
    arguments are the weight's own tensors, not contiguous copies of them, so a later call decodes
    what the weight holds then (a streamed slot refilled in place)."""

    def __init__(self, weight: torch.Tensor, out: torch.Tensor):
        if not (is_int8(weight) or is_nf4(weight)):
            raise TypeError(f"no decoder for a {type(weight).__name__} weight")
        self.weight, self.out = weight, out
        target = as_kernel_arg(out)  # bfloat16 stored as its bits
        codes = dict(WEIGHT=dtype_code(weight.dtype), OUT=dtype_code(out.dtype))
        if is_int8(weight):
            own = [weight.qdata, weight.scale.reshape(-1)]
            q, scale = args = [t.contiguous() for t in own]
            n_cols = q.shape[-1]
            n_rows = q.numel() // n_cols
            grid = (triton.cdiv(n_rows, _INT8_ROWS), triton.cdiv(n_cols, _INT8_COLS))
            self._launch = _int8_kernel[grid]
            self._args = (q, scale, target, n_rows, n_cols)
            self._meta = dict(**codes, ROWS=_INT8_ROWS, COLS=_INT8_COLS)
        else:  # the scalers are decoded in the kernel too: no torch op per call
            own = [weight.quantized_data, weight.nf4, weight.quantized_scalers, weight.quantization_factor,
                   weight.scaler_mean.reshape(1)]
            args = [t.contiguous() for t in own]
            group = int(weight.block_size)
            block = max(_NF4_BLOCK, group)
            self._launch = _nf4_kernel[(triton.cdiv(out.numel(), block),)]
            self._args = (*args, target, out.numel())
            self._meta = dict(**codes, GROUP=group, SCALER_GROUP=int(weight.scaler_block_size), BLOCK=block)
        self.reusable = all(a.data_ptr() == t.data_ptr() and a.shape == t.shape for a, t in zip(args, own))

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        """Whether the kernels decode `weight`: int8, or NF4 with a power-of-two block (a program
        holds whole blocks; torchao's default and distzo's are 64)."""
        if is_int8(weight):
            return True
        return is_nf4(weight) and weight.block_size > 0 and weight.block_size & (weight.block_size - 1) == 0

    def __call__(self) -> torch.Tensor:
        self._launch(*self._args, **self._meta)
        return self.out


def decode_with_kernel(weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The Triton kernels' decode of a torchao int8 or NF4 weight into `out` (`KernelDecode`)."""
    return KernelDecode(weight, out)()


def decode_reference(weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """torchao's own dequantization of `weight`, rounded into `out`: what the kernels must equal."""
    full = weight.dequantize() if is_int8(weight) else weight.get_original_weight()
    return out.copy_(full)


class ReferenceDecode:
    """torchao's dequantization of one weight into one output tensor, called like `KernelDecode`."""

    reusable = False

    def __init__(self, weight: torch.Tensor, out: torch.Tensor):
        self.weight, self.out = weight, out

    def __call__(self) -> torch.Tensor:
        return decode_reference(self.weight, self.out)


class NativeDecode:
    """The C kernels' decode (distzo.native, on a CPU) of one torchao int8 or NF4 weight into one
    float32 or bfloat16 output, called like `KernelDecode`: one pass, the same values as torchao's
    dequantization (rounded to bfloat16 as torch converts). Float32 weights only (what `model.quantize`
    makes of a float32 model); others take torchao's."""

    def __init__(self, kernels: Any, weight: torch.Tensor, out: torch.Tensor):
        self.kernels, self.weight, self.out = kernels, weight, out
        if is_int8(weight):
            own = [weight.qdata, weight.scale]
        else:
            own = [weight.quantized_data, weight.nf4, weight.quantized_scalers, weight.quantization_factor]
            self._groups = (int(weight.block_size), int(weight.scaler_block_size))
        self._args = [t.contiguous() for t in own]
        self.reusable = all(a.data_ptr() == t.data_ptr() for a, t in zip(self._args, own))

    @staticmethod
    def supports(weight: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether the C kernels decode `weight` into `out`: a float32 weight, a float32 or bfloat16
        output, on a CPU; int8 with a scale a row and no zero point (torchao's weight-only int8), NF4 of
        whole blocks."""
        if out.device.type != "cpu" or out.dtype not in DECODED_DTYPES or not out.is_contiguous():
            return False
        if weight.dtype != torch.float32:
            return False
        if is_int8(weight):
            zero = getattr(weight, "zero_point", None)
            rows, cols = weight.qdata.shape if weight.qdata.dim() == 2 else (0, 0)
            return (rows > 0 and list(getattr(weight, "block_size", [1, cols])) == [1, cols]
                    and weight.scale.dtype == torch.float32 and weight.scale.numel() == rows
                    and (zero is None or not zero.any()))
        return (is_nf4(weight) and weight.is_contiguous()
                and weight.nf4.dtype == weight.quantization_factor.dtype == torch.float32
                and weight.block_size % 2 == 0 and weight.numel() % weight.block_size == 0
                and (weight.numel() // weight.block_size) % weight.scaler_block_size == 0)

    def __call__(self) -> torch.Tensor:
        if is_int8(self.weight):
            return self.kernels.decode_int8(*self._args, self.out.view(-1)).view(self.out.shape)
        mean = self.weight.scaler_mean.item()  # read at each call, as the codes are (a streamed slot is refilled)
        self.kernels.decode_nf4(*self._args, mean, *self._groups, self.out.view(-1))
        return self.out


def decoder(weight: torch.Tensor, out: torch.Tensor,
            kernels: Any = None) -> KernelDecode | NativeDecode | ReferenceDecode:
    """`weight`'s decode into `out`: the Triton kernel on CUDA, the C kernels on a CPU where `kernels`
    (distzo.native's, None: not loaded) take the weight, torchao's dequantization elsewhere (the same
    values), or for an NF4 block size the Triton kernel does not take."""
    if out.device.type == "cuda":
        if triton is None:
            raise RuntimeError("engine.quantized_matmul=decoded decodes with a Triton kernel on CUDA, and Triton is "
                               "not installed; torch's CUDA wheels bring it")
        if KernelDecode.supports(weight):
            return KernelDecode(weight, out)
    elif kernels is not None and NativeDecode.supports(weight, out):
        return NativeDecode(kernels, weight, out)
    return ReferenceDecode(weight, out)


class DecodedLinears:
    """Hooks on a model's quantized linear layers: for each call the layer's weight is decoded into
    the shared scratch buffer (the largest layer's size, per device and dtype) and put in place of
    the quantized one; the forward hook puts the quantized weight back.

    kernels: distzo.native's CPU kernels, which decode in one pass on a CPU (None: torchao's
    dequantization there). only_same: decode only the calls whose result is torchao's own forward
    bitwise, and leave the others to it (`engine.quantized_matmul=torchao` on a CPU): an NF4 weight
    multiplied in float32 or bfloat16 (autocast's or the input's), which torchao computes as F.linear
    on its dequantized weight rounded to that dtype and then adds the bias, as done here (the weight
    decoded in one pass instead of about fifteen)."""

    def __init__(self, layers: Iterable[nn.Linear], kernels: Any = None, only_same: bool = False):
        self.layers = list(layers)
        self.kernels, self.only_same = kernels, only_same
        self.largest = max((m.weight.numel() for m in self.layers), default=0)
        self.scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.held: dict[nn.Module, tuple[torch.Tensor, torch.Tensor | None]] = {}  # (weight, bias added after)
        # Each layer's prepared decode (a kernel launch with its arguments ready), kept while the layer
        # holds the same weight object: a resident base prepares once, a streamed slot per walk.
        self.prepared: dict[nn.Module, KernelDecode | NativeDecode | ReferenceDecode] = {}
        # always_call: a call that raises gives the layer its quantized weight back all the same;
        # prepend: the bias torchao adds after the product comes before other hooks' terms (LoRA's)
        self.handles = [h for m in self.layers
                        for h in (m.register_forward_pre_hook(self._decode),
                                  m.register_forward_hook(self._restore, always_call=True, prepend=True))]

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
        # torchao's NF4 product: F.linear(x, weight.to(x.dtype)), which autocast casts to its dtype
        if self.only_same and x.dtype not in DECODED_DTYPES:
            return  # torchao's forward, as without the hooks
        run = self.prepared.get(module)
        if run is None or run.weight is not weight or run.out.dtype != dtype or run.out.device != x.device:
            if self.only_same and not (is_nf4(weight) and self.kernels is not None):
                return  # an int8 weight (torchao scales its product) or no C kernels: before any buffer
            out = self._buffer(x.device, dtype)[:weight.numel()].view(weight.shape)
            if self.only_same and not NativeDecode.supports(weight, out):
                return  # checked once per weight and dtype, not on every call of a prepared one
            run = decoder(weight, out, self.kernels)
            if run.reusable:
                self.prepared[module] = run
            else:
                self.prepared.pop(module, None)
        bias = module._parameters.get("bias") if self.only_same else None
        if bias is not None:  # torchao's NF4 linear adds it after the product (out + bias), not inside it
            module._parameters["bias"] = None
        self.held[module] = (weight, bias)
        module._parameters["weight"] = run()

    def _restore(self, module: nn.Module, args, output):
        held = self.held.pop(module, None)
        if held is None:  # a call the pre-hook left to torchao
            return output
        weight, bias = held
        module._parameters["weight"] = weight
        if bias is None:
            return output
        module._parameters["bias"] = bias
        return output + bias if output is not None else output

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.prepared.clear()

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.scratch.values())
