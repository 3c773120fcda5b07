"""What a blocking wait costs the compute after it, on this machine's CPU.

    PYTHONPATH=src python3 benchmarks/wake.py [--size 200] [--repeats 200]

A pipeline stage blocks in a receive between its actions; the profile times blocks back to
back. This times one single-threaded matrix product (``--size`` square, about 0.24 ms at 200
on a 2-vCPU VM) right after a blocking wait (``threading.Event.wait``) of each length, then
the next three products, and the first after a busy spin of the same length: medians in ms.
Where the first product after a wait is slower than back to back, and the next ones recover,
the core came back slower from its idle spell (its clock, or the hypervisor's scheduling),
not from lost caches (a spin keeps the core busy and loses them as much).
Session 78 measured it for issue 18 (docs/predictions.md).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=200)
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)
    a, b = torch.randn(args.size, args.size), torch.randn(args.size, args.size)
    for _ in range(500):
        torch.mm(a, b)

    def timed() -> float:
        t = time.perf_counter()
        torch.mm(a, b)
        return time.perf_counter() - t

    print("wait ms | 1st product after a blocking wait, 2nd, 3rd, 4th | 1st after a spin (ms)")
    for gap in (0.0, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01):
        after_wait, after_spin = [[] for _ in range(4)], []
        for _ in range(args.repeats):
            if gap:
                threading.Event().wait(gap)
            for calls in after_wait:
                calls.append(timed())
            spin(gap)
            after_spin.append(timed())
        row = " ".join(f"{statistics.median(c) * 1e3:.3f}" for c in after_wait)
        print(f"{gap * 1e3:7.1f} | {row} | {statistics.median(after_spin) * 1e3:.3f}", flush=True)


if __name__ == "__main__":
    main()
