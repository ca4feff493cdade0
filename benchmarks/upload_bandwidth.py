"""Host-device copy bandwidth on one GPU: what an offloaded block's upload and write-back can reach.

Times `copy_(non_blocking=True)` between a host buffer and device memory with CUDA events, for
page-locked host memory registered in place (how distzo pins its host masters,
`engine.streamer.host_buffer`) and for ordinary pageable memory, both directions, at several sizes,
and pinned copies both ways at once on two streams (an offloaded step uploads block i + 2 while
block i - 1 writes back: where the link does not carry both at full rate, a step moving its weights'
bytes twice waits on it). Each figure is the median of `--repeats` timed copies after one warm-up copy.

    python benchmarks/upload_bandwidth.py                 # 64 MiB, 256 MiB and 1 GiB
    python benchmarks/upload_bandwidth.py --sizes-mib 512 --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def timed_copy(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    """Median seconds of one dst.copy_(src) (device time between events)."""
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def timed_duplex(up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor],
                 repeats: int) -> float:
    """Median seconds until both copies end, the upload (dst, src) on one stream and the write-back
    on another, started together."""
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    times = []
    for r in range(repeats + 1):  # the first is a warm-up
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        ends = []
        for stream, (dst, src) in zip(streams, (up, down)):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
                ends.append(end)
        torch.cuda.synchronize()
        if r:
            times.append(max(start.elapsed_time(e) for e in ends) / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("upload_bandwidth: no CUDA device here")
    from distzo.engine.streamer import host_buffer, unpin_all

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'size':>9}  {'pinned H2D':>11}  {'pinned D2H':>11}  {'pageable H2D':>13}  {'pageable D2H':>13}  "
          f"{'pinned both ways, each':>23}  (GB/s)")
    for mib in args.sizes_mib:
        n = mib << 20
        pinned = host_buffer(n, torch.uint8, pin=True)
        pageable = torch.empty(n, dtype=torch.uint8)
        pinned.fill_(1)
        pageable.fill_(1)
        device = torch.empty(n, dtype=torch.uint8, device="cuda")
        rates = [n / timed_copy(device, pinned, args.repeats), n / timed_copy(pinned, device, args.repeats),
                 n / timed_copy(device, pageable, args.repeats), n / timed_copy(pageable, device, args.repeats)]
        pinned_back = host_buffer(n, torch.uint8, pin=True)
        device_back = torch.empty(n, dtype=torch.uint8, device="cuda")
        rates.append(n / timed_duplex((device, pinned), (pinned_back, device_back), args.repeats))
        print(f"{mib:>5} MiB  {rates[0] / 1e9:>11.1f}  {rates[1] / 1e9:>11.1f}  {rates[2] / 1e9:>13.1f}  "
              f"{rates[3] / 1e9:>13.1f}  {rates[4] / 1e9:>23.1f}")
        del device, device_back
        unpin_all()


if __name__ == "__main__":
    main()
