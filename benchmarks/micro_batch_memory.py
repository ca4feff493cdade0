"""Peak memory of a training step with and without micro-batches: the same step, less memory.

Runs `python -m distzo bench` twice in fresh processes (a process's peak RSS only grows, so each
setting needs its own): the whole shard in one forward, then `micro_batch_size` examples per
forward. Both take the same steps (tests/e2e/test_micro_batches.py); what changes is the
activations' working set, which scales with the micro-batch. Prints each run's training peak (peak
RSS on CPU, the allocator's reserved peak on CUDA), the ratio, and each run's step time:

    python benchmarks/micro_batch_memory.py                                  # embedded default, batch 64 vs 8
    python benchmarks/micro_batch_memory.py --batch 32 --micro 4 -- model=tiny
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench_runs import run_bench


def bench(overrides: list[str], out: Path) -> dict:
    return run_bench(["bench.reference=false", "bench.warmup=1", "bench.steps=2", *overrides], out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("overrides", nargs="*", help="more bench overrides (after --)")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        whole = bench([f"batch_size={ns.batch}", *ns.overrides], Path(tmp) / "whole")
        micro = bench([f"batch_size={ns.batch}", f"micro_batch_size={ns.micro}", *ns.overrides], Path(tmp) / "micro")
    gib = 2**30
    peak = lambda r: r["peak_memory_bytes"]["training"]  # noqa: E731
    print(f"batch {ns.batch}: training peak {peak(whole) / gib:.3f} GiB whole, {peak(micro) / gib:.3f} GiB in "
          f"micro-batches of {ns.micro}; ratio {peak(micro) / peak(whole):.3f}")
    for name, r in (("whole", whole), ("micro", micro)):
        print(f"  {name}: {json.dumps({k: r[k] for k in ('step_time_s', 'forward_time_s', 'memory_ratio')})}")


if __name__ == "__main__":
    main()
