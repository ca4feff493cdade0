"""LoRA on a float32, an int8 and an int4 (NF4) base, side by side (BENCHMARKS.md, "A quantized base"):
`python -m distzo bench peft=lora model.quantize=<base>` once per base (add offload=cpu after `--`
to stream the base from host memory: the table's "streamed a step" column), each in a fresh process (a
process's peak memory belongs to one model), on the embedded default (or the model named after
`--`). Each bench times the step and the forward passes alone in the same rounds and measures the
peak memory of inference and of training after the model is loaded and quantized. The table gives
each base's figures and their ratios to the float32 base's.

    python benchmarks/quantized_base.py --out quantized-base.json
    python benchmarks/quantized_base.py -- model=gemma3-270m
    python benchmarks/quantized_base.py --bases none int8 -- model=tiny task=synthetic-cue   # a quick check
"""

from __future__ import annotations

from bench_runs import bench_each


def main() -> None:
    rows = bench_each(__doc__, "bases", ["none", "int8", "int4"],
                      lambda base: ["peft=lora", f"model.quantize={base}", "bench.reference=false"])
    mib = 2**20
    ref = rows.get("none")
    print(f"{next(iter(rows.values()))['model']}, LoRA, {next(iter(rows.values()))['device']}")
    print("| base | quantized layers: MiB (x float32) | model parameters, MiB | peak inference, MiB | peak training, "
          "MiB | training / inference | streamed a step, MiB | step | forward passes | step / forward |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def vs(r: dict, key: str, value: float) -> str:
        """A figure in MiB, with its ratio to the float32 base's."""
        if ref is None or r is ref:
            return f"{value / mib:.1f}"
        other = ref["peak_memory_bytes"][key] if key in ("inference", "training") else ref[key]
        return f"{value / mib:.1f} ({value / other:.2f}x)" if other else f"{value / mib:.1f}"

    for base, r in rows.items():
        peaks = r["peak_memory_bytes"]
        layers = (f"{r['quantized_bytes'] / mib:.1f} ({r['quantized_bytes_ratio']})" if "quantize" in r else "float32")
        print(f"| {base} | {layers} | {vs(r, 'model_bytes', r['model_bytes'])} | "
              f"{vs(r, 'inference', peaks['inference'])} | {vs(r, 'training', peaks['training'])} | "
              f"{r['memory_ratio']} | {vs(r, 'h2d_bytes_per_step', r['h2d_bytes_per_step'])} | "
              f"{r['step_time_s']:.3f} s | {r['forward_time_s']:.3f} s | {r['overhead_ratio']} |")


if __name__ == "__main__":
    main()
