"""Model FLOPs utilisation: the FLOPs a step's forward passes need against what the card can do.

The count is the usual one for dense transformers: a forward pass costs 2 x parameters x tokens
FLOPs (one multiply and one add per weight per token; the tied output head counted once, like the
embedding it shares). Attention's own products (4 x layers x hidden x sequence FLOPs a token, about
15% more for OPT-1.3B at 2,048 tokens, less for bigger models) are not counted, so the figure is a
lower bound, as DistZO2's and most papers' are.

The peaks are the vendors' dense (no sparsity) tensor-core figures. Which one applies follows the
arithmetic of the forward: half-precision weights or `engine.compute=bf16` run on the fp16/bf16
tensor cores, `engine.compute=tf32` on TF32, plain float32 on the CUDA cores. Cards not listed have
no MFU unless `bench.peak_tflops` gives their peak.
"""

from __future__ import annotations

from typing import Any

# (a fragment of torch.cuda.get_device_name, fp16/bf16 dense, tf32 dense, fp32) in TFLOP/s, per the
# vendors' datasheets. First match wins: the longer names come before the ones they contain.
CARD_PEAKS: tuple[tuple[str, float, float, float], ...] = (
    ("H100 PCIe", 756.0, 378.0, 51.0),
    ("H100", 989.0, 495.0, 67.0),  # SXM ("H100 80GB HBM3")
    ("H200", 989.0, 495.0, 67.0),
    ("H20", 148.0, 74.0, 44.0),
    ("A100", 312.0, 156.0, 19.5),
)
PRECISIONS = ("half", "tf32", "fp32")
COUNT = "2 x parameters x tokens x forward passes (attention's products not counted)"


def forward_precision(weight_dtype: str, compute: str) -> str | None:
    """Which peak a forward runs against: half, tf32 or fp32 (None: float64, which has no
    tensor-core peak worth quoting)."""
    if weight_dtype in ("float16", "bfloat16") or compute == "bf16":
        return "half"
    if weight_dtype == "float64":
        return None
    return "tf32" if compute == "tf32" else "fp32"


def card_peak_tflops(name: str, precision: str) -> float | None:
    """The listed card's dense peak for `precision`, or None."""
    for fragment, *peaks in CARD_PEAKS:
        if fragment.lower() in name.lower():
            return peaks[PRECISIONS.index(precision)]
    return None


def model_flops_utilisation(parameters: int, tokens: float, passes: int, step_s: float, devices: int,
                            card: str | None, precision: str | None, peak_tflops: float | None) -> dict[str, Any]:
    """MFU of a step that runs `passes` forward passes over `tokens` tokens in `step_s` seconds on
    `devices` cards named `card` (None: not a GPU). peak_tflops: the card's peak, given (bench.peak_tflops);
    otherwise looked up. The figure is None, with the reason, when no peak is known."""
    flops = 2.0 * parameters * tokens * passes
    out: dict[str, Any] = {"count": COUNT, "parameters": parameters, "flops_per_step": flops,
                           "achieved_tflops": round(flops / step_s / 1e12, 3) if step_s > 0 else None,
                           "card": card, "precision": precision}
    if peak_tflops is None and card is not None and precision is not None:
        peak_tflops = card_peak_tflops(card, precision)
    if peak_tflops is None:
        out["value"] = None
        out["why_none"] = ("no GPU: MFU compares against a card's tensor-core peak (give bench.peak_tflops to "
                           "compare against another)") if card is None else (
            f"{card} is not in distzo.telemetry.flops.CARD_PEAKS; give bench.peak_tflops")
        return out
    out["peak_tflops"] = peak_tflops
    out["value"] = round(flops / step_s / (peak_tflops * 1e12 * devices), 4) if step_s > 0 else None
    return out
