"""Host memory while a big checkpoint loads and trains, as users load it: a sharded safetensors folder.

`write` saves a random OPT of one of DistZO2's sizes (or a small one) with `save_pretrained` in shards,
as the hub's checkpoints come. `measure` runs what `python -m distzo train` does with that folder
(`model=hf model.path=DIR`, any overrides: `offload=cpu`, `peft=lora model.quantize=int8`, ...) up to
and through two training steps (`--steps`), and prints one JSON line: the host's resident set before
loading (the interpreter and its imports), its peak from there while building the run (loading,
quantizing, the host masters) and through the steps, that peak over the checkpoint's bytes, and the
GPU's peak. On a CPU the "device" slots and working copies are host memory too, so only the building
peak compares with a GPU machine's host. `table` measures the usual variants of one
folder, one fresh process each.

    python benchmarks/load_peak.py write --out /tmp/opt-6.7b --size 6.7b --device cuda
    python benchmarks/load_peak.py table /tmp/opt-6.7b -- device=cuda task=lm-2048 batch_size=4
    python benchmarks/load_peak.py measure /tmp/opt-6.7b offload=cpu device=cuda

The goal: with `offload=cpu` the host peak is at most 1.3x the checkpoint's bytes, and the GPU holds
the streamed working set, not the model. The peak is the kernel's high-water mark of the process's
resident set (VmHWM, reset when loading starts), so it counts the checkpoint's mapped pages that
were read as well as the memory allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SIZES = {  # hidden, layers, heads, ffn: conf/model/opt-*.yaml; "small" is for a CPU (354M parameters, 708 MB)
    "small": (1024, 24, 16, 4096), "1.3b": (2048, 24, 32, 8192), "2.7b": (2560, 32, 32, 10240),
    "6.7b": (4096, 32, 32, 16384), "13b": (5120, 40, 40, 20480),
}


def write(ns: argparse.Namespace) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hidden, layers, heads, ffn = SIZES[ns.size]
    config = AutoConfig.for_model("opt", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                  ffn_dim=ffn, word_embed_proj_dim=hidden, vocab_size=50272,
                                  max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(ns.device):  # drawn on a GPU in seconds; a CPU takes minutes for billions
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, ns.dtype))
    model.save_pretrained(ns.out, max_shard_size=ns.shard)
    shards = sorted(Path(ns.out).glob("*.safetensors"))
    print(json.dumps({"folder": str(ns.out), "shards": len(shards), "bytes": sum(p.stat().st_size for p in shards)}))


def status_mib(field: str) -> float:
    with open("/proc/self/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) / 1024 for line in fh if line.startswith(field + ":"))


def measure(folder: str, overrides: list[str], steps: int = 2) -> dict:
    """In this process: build the run on `folder` and train `steps` steps; the host and GPU figures."""
    import torch

    import distzo
    from distzo.config.compose import typed
    from distzo.parallel.mesh import Mesh, device_type
    from distzo.run.components import build_components
    from distzo.run.training import zo_step

    cfg = typed(distzo.compose("model=hf", f"model.path={folder}", "model.tokenizer=smollm2", "task=synthetic-cue",
                               "batch_size=4", *overrides))
    mesh = Mesh.single(device_type(str(cfg.device)))
    before = status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")  # VmHWM starts again from here
    c = build_components(cfg, mesh, 0)
    built = status_mib("VmHWM")
    for step in range(steps):
        zo_step(c, step)
    cuda = mesh.device.type == "cuda"
    checkpoint = sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
    peak = status_mib("VmHWM") - before
    return {"overrides": overrides, "checkpoint_mib": round(checkpoint / 2**20, 1),
            "host_before_load_mib": round(before, 1), "host_peak_building_mib": round(built - before, 1),
            "host_peak_mib": round(peak, 1), "host_peak_over_checkpoint": round(peak * 2**20 / checkpoint, 3),
            "gpu_peak_mib": round(torch.cuda.max_memory_reserved() / 2**20, 1) if cuda else None}


def fresh(folder: str, overrides: list[str], steps: int = 2) -> dict:
    """`measure` in a fresh interpreter (a process's peak belongs to one run)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, __file__, "measure", "--steps", str(steps), folder, *overrides],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return {"overrides": overrides, "error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


VARIANTS = {"offload": ["offload=cpu"], "resident": [], "int8": ["peft=lora", "model.quantize=int8"],
            "int4": ["peft=lora", "model.quantize=int4"],
            "int8-offload": ["peft=lora", "model.quantize=int8", "offload=cpu"],
            "int4-offload": ["peft=lora", "model.quantize=int4", "offload=cpu"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("--out", required=True)
    w.add_argument("--size", default="small", choices=list(SIZES))
    w.add_argument("--dtype", default="float16")
    w.add_argument("--shard", default="2GB", help="max_shard_size of save_pretrained")
    w.add_argument("--device", default="cpu")
    m = sub.add_parser("measure")
    m.add_argument("--steps", type=int, default=2, help="training steps after building (0: loading alone)")
    m.add_argument("folder")
    m.add_argument("overrides", nargs="*")
    t = sub.add_parser("table")
    t.add_argument("folder")
    t.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    t.add_argument("overrides", nargs="*", help="for every variant (after --)")
    ns = ap.parse_args()
    if ns.command == "write":
        write(ns)
    elif ns.command == "measure":
        print(json.dumps(measure(ns.folder, ns.overrides, ns.steps)))
    else:
        print("| variant | checkpoint (MiB) | host peak building the run (MiB) | host peak through two steps (MiB) | "
              "/ checkpoint | GPU peak (MiB) |")
        print("|---|---|---|---|---|---|")
        for name in ns.variants:
            r = fresh(ns.folder, [*VARIANTS[name], *ns.overrides])
            if "error" in r:
                print(f"| {name} | {r['error']} | | | | |")
            else:
                gpu = r["gpu_peak_mib"] if r["gpu_peak_mib"] is not None else "-"
                print(f"| {name} | {r['checkpoint_mib']} | {r['host_peak_building_mib']} | {r['host_peak_mib']} | "
                      f"{r['host_peak_over_checkpoint']} | {gpu} |")


if __name__ == "__main__":
    main()
