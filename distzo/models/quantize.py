"""A quantized frozen base under the adapters (`model.quantize=int8|int4`).

With LoRA, LoRA-FA or prefix tuning the base model is frozen, so its linear weights need not be
float: they are quantized once at load, weight-only, with torchao (the same code on CPU and CUDA).
How the forward multiplies by a quantized weight is `engine.quantized_matmul` (`matmul_mode`):
- `torchao` (auto's choice on CPU): torchao's weight-only linear, which on CPU and CUDA alike
  dequantizes each weight back to float on every call (int8: `qdata.to(float)`, the row scales applied
  to the product; NF4: a dozen elementwise kernels) and then runs the float matmul. Measured on an
  H100 at DistZO2's workload (OPT-1.3B float16, 4 x 2,048 tokens): 1.39x the float base's LoRA step
  for int8, 1.52x for int4. On a CPU its NF4 weights are decoded by distzo's C kernels in one pass
  instead (the same bits, so torchao's product; `distzo.models.decode`).
- `decoded` (auto's choice on CUDA): one kernel per layer decodes the weight into a scratch buffer
  shared by the model, in the product's dtype, and the float base's `F.linear` runs on it
  (`distzo.models.decode`). The same workload: 1.02x (int8) and 1.01x (int4) the float base's step.
Either way the memory held is the quantized bytes; neither reads the quantized bytes inside the matmul.
The adapters stay in the model's dtype and train as on a float base; activations stay float.

- int8: per-row symmetric int8 with a float32 scale per row (`Int8WeightOnlyConfig`), about 0.25x
  the float32 bytes.
- int4: 4-bit NormalFloat (NF4, QLoRA's format: blocks of 64 weights share an absmax scale, the
  scales themselves quantized in blocks of 256), about 0.13x. torchao's affine int4 layouts run
  only on recent CUDA GPUs in bfloat16, so distzo's 4-bit base is NF4, which runs everywhere.

Quantized: every `nn.Linear` of the decoder (attention and MLP projections). Not quantized: the
token embeddings, the LM head (often tied to them; it scores the label words), norms, biases, and
GPT-2's Conv1D projections (not `nn.Linear`). A linear layer whose size NF4's blocks do not divide
stays float (named in the log). Quantization is deterministic, so every rank, a resumed run and
`PeftModel.from_pretrained` on a base quantized the same way read the same weights.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ConfigError
from .mapped import MappedFiles, trim_heap

log = logging.getLogger("distzo")


def matmul_mode(setting: str, device_type: str) -> str:
    """What `engine.quantized_matmul` means on a device: "auto" is "decoded" on CUDA (one decode kernel
    per layer, then the float matmul) and "torchao" elsewhere (torchao's int8 product; its NF4 weights
    are decoded by the C kernels all the same where they load, which gives torchao's product bitwise:
    models/decode.py)."""
    setting = str(setting)
    if setting == "auto":
        return "decoded" if device_type == "cuda" else "torchao"
    return setting


def base_matmul(quantize: str, setting: str, device_type: str) -> str | None:
    """How a run's quantized base multiplies on `device_type` (`matmul_mode`), or None without one
    (model.quantize=none): what the engine builds, the resume fingerprint and bench record."""
    return None if str(quantize) == "none" else matmul_mode(setting, device_type)

NF4_BLOCK = 64  # weights per NF4 absmax block (QLoRA's)
NF4_SCALER_BLOCK = 256  # absmax scales per block of their own 8-bit quantization (QLoRA's double quantization)


@dataclass
class QuantizedBase:
    """What was quantized: the layers, their bytes as stored (quantized values with their scales)
    and the same weights' bytes in float32."""

    method: str
    layers: list[str] = field(default_factory=list)
    kept_float: list[str] = field(default_factory=list)
    bytes: int = 0
    float32_bytes: int = 0
    model_bytes: int = 0  # every parameter of the model as stored, quantized or not (before the adapters)

    @property
    def ratio(self) -> float:
        return self.bytes / self.float32_bytes if self.float32_bytes else math.nan

    def modules(self, model: nn.Module) -> list[nn.Module]:
        """The quantized layers of `model`."""
        return [model.get_submodule(name) for name in self.layers]

    def summary(self) -> dict[str, object]:
        """The run summary's and bench's fields."""
        if self.method == "none":
            return {}
        return {"quantize": self.method, "quantized_layers": len(self.layers), "model_bytes": self.model_bytes,
                "quantized_bytes": self.bytes, "quantized_float32_bytes": self.float32_bytes,
                "quantized_bytes_ratio": round(self.ratio, 4)}

    def describe(self) -> str:
        kept = f"; {len(self.kept_float)} kept float" if self.kept_float else ""
        return (f"{self.method} base: {len(self.layers)} linear layers, {self.bytes / 2**20:.1f} MiB "
                f"({self.ratio:.3f}x their float32 {self.float32_bytes / 2**20:.1f} MiB){kept}")


def _torchao():
    """torchao's quantization API; a one-line error naming the install when it is missing."""
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_, to_nf4
    except ImportError as exc:
        raise ConfigError(f"model.quantize needs torchao ({exc}); pip install 'distzo[quant]' (or pip install "
                          "torchao)") from None
    return quantize_, Int8WeightOnlyConfig, to_nf4


def stored_bytes(weight: torch.Tensor) -> int:
    """Bytes a (possibly quantized) weight occupies: its inner tensors' for a torchao tensor."""
    if hasattr(weight, "__tensor_flatten__") and type(weight) is not torch.Tensor and \
            type(weight) is not nn.Parameter:
        names, _ = weight.__tensor_flatten__()
        return sum(getattr(weight, n).numel() * getattr(weight, n).element_size() for n in names)
    return weight.numel() * weight.element_size()


def quantizable_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The decoder's linear layers: every nn.Linear except the LM head and any layer whose weight is
    shared with the embeddings."""
    tied = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
            for p in m.parameters()}
    return [(name, m) for name, m in model.named_modules()
            if type(m) is nn.Linear and id(m.weight) not in tied and name.split(".")[-1] != "lm_head"]


def _nf4_scaler_block(numel: int) -> int | None:
    """NF4's scaler block for a weight of `numel` elements (None: NF4's blocks do not divide it)."""
    if numel % NF4_BLOCK:
        return None
    blocks = numel // NF4_BLOCK
    return math.gcd(blocks, NF4_SCALER_BLOCK) if blocks % 2 == 0 else None


def quantize_base(model: nn.Module, method: str) -> QuantizedBase:
    """Quantize the frozen base's linear weights in place (see the module docstring); method none
    leaves the model as it is. The quantized weights never require grad."""
    method = str(method)
    report = QuantizedBase(method)
    if method == "none":
        report.model_bytes = sum(stored_bytes(p) for p in model.parameters())
        return report
    quantize_, Int8WeightOnlyConfig, to_nf4 = _torchao()
    layers = quantizable_linears(model)
    if not layers:
        raise ConfigError(f"model.quantize={method}: this model has no nn.Linear layers to quantize (GPT-2's "
                          "projections are Conv1D); use model.quantize=none")
    chosen = []
    for name, module in layers:
        if method == "int4" and _nf4_scaler_block(module.weight.numel()) is None:
            report.kept_float.append(name)
            continue
        chosen.append((name, module))
        report.float32_bytes += module.weight.numel() * 4
    if method not in ("int8", "int4"):
        raise ConfigError(f"model.quantize={method} is not supported; use none, int8 or int4")
    mapped = MappedFiles()  # the float checkpoint's pages, given back layer by layer as each is quantized
    with torch.no_grad():
        for _, module in chosen:
            w = module.weight.detach()
            if method == "int8":  # one layer at a time: the same per-row result as the whole model at once
                quantize_(module, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn == "")
            else:
                module.weight = nn.Parameter(to_nf4(w, NF4_BLOCK, _nf4_scaler_block(w.numel())), requires_grad=False)
            mapped.release(w)
            trim_heap()  # the layer's float32 temporaries: else glibc keeps them, +600 MiB for a 390 MiB base
    for _, module in layers:
        module.weight.requires_grad_(False)  # the base is frozen, quantized or kept float
    for name, module in chosen:
        report.layers.append(name)
        report.bytes += stored_bytes(module.weight)
    report.model_bytes = sum(stored_bytes(p) for p in model.parameters())
    _release_float_copies(model)
    if report.kept_float:
        log.info("model.quantize=%s: %d linear layer(s) whose size NF4's blocks do not divide stay float: %s",
                 method, len(report.kept_float), ", ".join(report.kept_float[:4]))
    log.info("Quantized the %s", report.describe())
    return report


def _release_float_copies(model: nn.Module) -> None:
    """Give the host back the float weights quantization replaced. transformers maps the checkpoint
    file and the tensors that stay float (embeddings, norms) are views of that one mapping, so the
    pages quantization read stay resident while any of them lives: the float tensors get memory of
    their own. Then glibc returns the freed heap (quantization's temporaries) to the system, where
    it can; without both, a quantized base's process held more than the float one's. On a GPU the
    device gets the float weights' memory back the same way."""
    copies: dict[int, torch.Tensor] = {}  # a tied tensor is copied once and stays tied
    with torch.no_grad():
        for module in model.modules():
            for t in module._parameters.values():
                if t is not None and type(t.data) is torch.Tensor and t.device.type == "cpu" and id(t) not in copies:
                    copies[id(t)] = t.data = t.data.clone()  # the Parameter object (and its ties) stays
            for name, t in module._buffers.items():
                if t is not None and type(t) is torch.Tensor and t.device.type == "cpu":
                    if id(t) not in copies:
                        copies[id(t)] = t.clone()
                    module._buffers[name] = copies[id(t)]
    trim_heap()
    if any(p.is_cuda for p in model.parameters()):
        # A base drawn on the GPU (model.init_device=device): its float weights' memory went back to
        # torch's caching allocator, which keeps it reserved (and every peak counts it) until told.
        torch.cuda.empty_cache()

