"""What a message between two pipeline stages costs after the stages computed, on this machine.

    PYTHONPATH=src python3 benchmarks/p2p_wake.py [--computes 0,0.2,0.6,1.7,5.5] [--exchanges 300] [--json out.json]

Two gloo workers (1 thread each) repeat 1F1B's steady state: each computes for a while (a
64 x 128 by 128 x 128 product, repeated), then sends a 64 x 32 float32 tensor to the other
and receives one (``batch_isend_irecv``, as ``torch.distributed.pipelining`` sends), and
waits. Every exchange is timed on both workers against one clock, so what counts is the
true latency: from the later of the two posts to each worker's completion. The skew
between the workers (the one that computed faster waits for the other) is left out.

partrain's hardware profile times a message inside a real pipeline over tiny stages that
compute almost nothing (``profile.step_probes.measure_pipeline_hops``). This shows what
that leaves out. On the 2-core VM partrain is developed on (a Firecracker guest, Linux
6.18, torch 2.13, session 37): with nothing computed between messages the mean latency was
0.23-0.40 ms (p90 0.24-0.33); after 0.6 ms of compute 0.59-1.16 ms (p90 2.0-3.4); after
1.7 ms 1.04-1.80 ms (p90 2.5-4.4). The median stays near 0.2 ms: the cost is a tail of
1-4 ms waits in a growing share of the exchanges (at 1.7 ms, 36-59% of them). Neither the
guest's scheduler nor its own load explains it: a 0.1 ms scheduler slice for gloo's I/O
thread (EEVDF's custom slice) changed nothing, and two busy-looping processes at the lowest
priority, even ``SCHED_IDLE``, made the tail worse (mean 2.2-2.7 ms after 1.7-6 ms of
compute). The stage compute of a real pipeline sits in that range, so its step pays a
share of these waits that the profile's probe does not see: issue 17's small 2-stage
pipelines at batch 256 measured 10-24% over their prediction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from partrain.distributed.launch import detect_launcher, init_process_group
from partrain.distributed.spawn import spawn

WARMUP = 20


@record
def exchange_worker(computes_ms: list[float], exchanges: int) -> dict:
    """Both workers: per compute level, (post, done) wall times of every exchange."""
    torch.set_num_threads(1)
    init_process_group(detect_launcher(), "gloo", timeout_s=120)  # spawn's private rendezvous
    peer = 1 - dist.get_rank()
    out, inp = torch.randn(64, 32), torch.empty(64, 32)
    a, w = torch.randn(64, 128), torch.randn(128, 128)
    start = time.perf_counter()
    for _ in range(200):
        a @ w
    product_s = (time.perf_counter() - start) / 200
    times = {}
    for ms in computes_ms:
        reps = round(ms / 1e3 / product_s)
        pairs = []
        dist.barrier()
        for _ in range(exchanges):
            for _ in range(reps):
                a @ w
            posted = time.time()  # one clock for both workers: they run on one machine
            ops = [dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, inp, peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            pairs.append((posted, time.time()))
        times[ms] = pairs[WARMUP:]
    dist.destroy_process_group()
    return times


def summarize(by_rank: dict[int, dict]) -> list[dict]:
    rows = []
    for ms in by_rank[0]:
        latencies = []
        for (post0, done0), (post1, done1) in zip(by_rank[0][ms], by_rank[1][ms]):
            later = max(post0, post1)
            latencies += [done0 - later, done1 - later]
        ordered = sorted(latencies)
        rows.append({"compute_ms": ms, "exchanges": len(latencies), "median_ms": 1e3 * statistics.median(latencies),
                     "mean_ms": 1e3 * statistics.fmean(latencies), "p90_ms": 1e3 * ordered[int(0.9 * len(ordered))],
                     "over_1ms": sum(t > 1e-3 for t in latencies)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--computes", default="0,0.2,0.6,1.7,5.5", help="ms of compute before each exchange")
    parser.add_argument("--exchanges", type=int, default=300, help="exchanges per compute level")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    computes = [float(v) for v in args.computes.split(",")]
    rows = summarize(spawn(exchange_worker, (computes, args.exchanges + WARMUP), 2))
    print(f"{'compute ms':>10} {'median ms':>10} {'mean ms':>8} {'p90 ms':>7} {'> 1 ms':>10}")
    for r in rows:
        print(f"{r['compute_ms']:10.1f} {r['median_ms']:10.3f} {r['mean_ms']:8.3f} {r['p90_ms']:7.2f} "
              f"{r['over_1ms']:4d} / {r['exchanges']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
