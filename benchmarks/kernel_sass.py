"""distzo's CUDA kernels (the chunk pass, the draws, a quantized base's decode) compiled for a GPU
architecture on any machine, no GPU needed: their SASS instruction counts (static, per element of a
program's block) and the approximate instructions they use.

Triton compiles for a target without a device (its wheel brings ptxas and nvdisasm), so the kernels'
machine code can be inspected, and their compilation checked, on a CPU. A static count is not a
timing: branches that rarely run (the IEEE cos's large-argument reduction) count as much as the hot
path. It is what changed between two versions of a kernel, read on the same compiler.

    python benchmarks/kernel_sass.py                 # sm_90 (H100), every variant
    python benchmarks/kernel_sass.py --arch 80 --json

tests/unit/test_cuda_chunk_kernel.py runs it to check that every variant compiles for sm_90.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile the GPU's code, not the interpreter's stand-ins

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from distzo.models import decode  # noqa: E402
from distzo.native import cuda as native_cuda  # noqa: E402
from distzo.native.rounding import CODES  # noqa: E402
from distzo.zo import cuda_draws  # noqa: E402

BLOCK = 1024
POINTER = {0: "*fp32", 1: "*u16", 2: "*fp16"}  # as rounding.as_kernel_arg passes them: bfloat16 as its bits

# (name, kernel, constexprs, pointer types): the variants a step launches
CHUNK = [("chunk: update + copies, float16, gaussian", dict(UPDATE=True, DECAY=False, PLUS=True, MINUS=True, CODE=2,
                                                            GAUSSIAN=True)),
         ("chunk: copies, float32, gaussian", dict(UPDATE=False, DECAY=False, PLUS=True, MINUS=True, CODE=0,
                                                   GAUSSIAN=True)),
         ("chunk: update with decay, bfloat16, rademacher", dict(UPDATE=True, DECAY=True, PLUS=False, MINUS=False,
                                                                 CODE=1, GAUSSIAN=False))]
DRAW = [("draw: span, gaussian", dict(TABLES=False, GAUSSIAN=True)),
        ("draw: rows, gaussian", dict(TABLES=True, GAUSSIAN=True)),
        ("draw: span, rademacher", dict(TABLES=False, GAUSSIAN=False))]
# A quantized base's decode (models/decode.py): (name, kernel, weight code, output code, constexprs)
SCALE = {0: "*fp32", 1: "*bf16", 2: "*fp16"}  # torchao's scales and tables are in the weight's dtype
DECODE = [("decode: int8, float32 weight to float32", "int8", 0, 0),
          ("decode: int8, float16 weight to float32", "int8", 2, 0),
          ("decode: int8, bfloat16 weight to bfloat16", "int8", 1, 1),
          ("decode: nf4, float32 weight to float32", "nf4", 0, 0),
          ("decode: nf4, bfloat16 weight to bfloat16", "nf4", 1, 1)]


def _signature(fn, constexprs: dict, pointers: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name in ("decay", "eps", "scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"  # every int argument reaches the kernels as i32 (cuda_draws.split64)
    return sig


def compile_variants(arch: int) -> list[tuple[str, object]]:
    target = GPUTarget("cuda", arch, 32)
    out = []
    for name, flags in CHUNK:
        data = POINTER[flags["CODE"]]
        pointers = {"master_ptr": data, "plus_ptr": data, "minus_ptr": data, "term_query_ptr": "*i64",
                    "term_scale_ptr": "*fp32"}
        constexprs = {**flags, "BLOCK": BLOCK}
        src = ASTSource(native_cuda._chunk_kernel, _signature(native_cuda._chunk_kernel, constexprs, pointers),
                        constexprs=constexprs)
        out.append((name, triton.compile(src, target=target, options=cuda_draws.UNFUSED)))
    for name, flags in DRAW:
        constexprs = {**flags, "BLOCK": BLOCK}
        pointers = {"out_ptr": "*fp32", "chunk_ptr": "*i64", "base_ptr": "*i64"}
        src = ASTSource(cuda_draws._draw_kernel, _signature(cuda_draws._draw_kernel, constexprs, pointers),
                        constexprs=constexprs)
        out.append((name, triton.compile(src, target=target, options=cuda_draws.UNFUSED)))
    for name, kind, weight, result in DECODE:
        codes = dict(WEIGHT=weight, OUT=result)
        if kind == "int8":
            fn, constexprs = decode._int8_kernel, {**codes, "ROWS": decode._INT8_ROWS, "COLS": decode._INT8_COLS}
            pointers = {"q_ptr": "*i8", "scale_ptr": SCALE[weight], "out_ptr": POINTER[result]}
        else:
            fn, constexprs = decode._nf4_kernel, {**codes, "GROUP": 64, "SCALER_GROUP": 256, "BLOCK": decode._NF4_BLOCK}
            pointers = {"packed_ptr": "*u8", "lut_ptr": SCALE[weight], "qscaler_ptr": "*i8",
                        "factor_ptr": SCALE[weight], "mean_ptr": SCALE[weight], "out_ptr": POINTER[result]}
        src = ASTSource(fn, _signature(fn, constexprs, pointers), constexprs=constexprs)
        out.append((name, triton.compile(src, target=target)))
    return out


def opcodes(kernel) -> collections.Counter:
    """The kernel's SASS instructions by opcode (nvdisasm of its cubin)."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter()
    for line in text.splitlines():
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for an H100, 80 for an A100")
    ap.add_argument("--json", action="store_true", help="one JSON object per variant instead of a table")
    ns = ap.parse_args()
    assert set(POINTER) == set(CODES.values()), "a dtype code without a pointer type here"
    rows = []
    for name, kernel in compile_variants(ns.arch):
        ops = opcodes(kernel)
        ptx = kernel.asm["ptx"]
        approx = sorted(set(re.findall(r"\b(lg2\.approx|sin\.approx|cos\.approx|ex2\.approx)", ptx)))
        threads = kernel.metadata.num_warps * 32  # every program handles BLOCK elements
        rows.append({"variant": name, "arch": f"sm_{ns.arch}", "sass": sum(ops.values()),
                     "sass_per_element": round(sum(ops.values()) / (BLOCK / threads), 1),
                     "mufu": ops["MUFU"], "imad": ops["IMAD"], "branches": ops["BRA"], "approx": approx})
    if ns.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"distzo's CUDA kernels for sm_{ns.arch} (Triton {triton.__version__}), static SASS; a program draws "
          f"{BLOCK} elements")
    print("| variant | instructions | per element | MUFU | IMAD | branches | approximate PTX |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['sass']} | {r['sass_per_element']} | {r['mufu']} | {r['imad']} | "
              f"{r['branches']} | {', '.join(r['approx']) or '-'} |")


if __name__ == "__main__":
    sys.exit(main())
