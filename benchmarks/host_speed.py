"""How steady this machine's cores are: each core's speed over time, and what a job that
waits for its slowest worker pays for it.

    PYTHONPATH=src python3 benchmarks/host_speed.py [--model cnn --dataset mnist --batch-size 32] [--seconds 60]
                                                    [--slot 0.5] [--json out.json]

One process per core, each pinned to its core and busy with the model's forward and backward
(``profile.sharing.training_step``, one thread, freed memory kept as a training worker keeps
it), all at once, as a job with a worker per core runs. Each times every step and keeps the
median of each ``--slot`` seconds, the slots aligned across processes on the machine's
monotonic clock. Per core, the fast level is the 10th percentile of its slot medians; a slot's
slowdown is its median over that level.

- ``serial``: the mean slowdown of one core: what a one-worker step pays over the model
  profile, whose timings keep the fastest rounds (``profile.timing``), on average.
- ``synchronous``: the mean over slots of the slowest core's slowdown: what a step pays when
  every worker waits for every other each step (DDP's allreduce, a pipeline's messages).

On a dedicated machine both are about 1.0. On the 2-core VM partrain is developed on (a
Firecracker guest, AMD EPYC; session 42), each vCPU switched by itself between two speeds
about 1.35-1.5x apart, in spells of one to eight seconds: the cnn's step at batch 32 read
23-27 ms or 33-41 ms per half second, on either core, with the other core busy or idle
(``profile.sharing``'s co-runner alone and side by side read the same two levels). No steal
time was counted (``/proc/stat``), so the other load is beneath the guest. A synchronous
job is slow whenever either core is: issue 18's run20 under-predicted the cnn's serial step
by 10% and its 2-worker steps at fast links by 19-33% (measured again locally: ddp x2 41 ms
against 31 ms predicted), which is this, and not the links.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

FAST_QUANTILE = 0.1  # a core's fast level: this quantile of its slot medians
SLOW_OVER = 1.15  # a slot counts as slow above this multiple of its core's fast level
START_TIMEOUT_S = 120.0  # importing torch and building the model, on every core at once


def core_worker(core: int, model: str, dataset: str, batch: int, seconds: float, slot: float, together, out) -> None:
    """Pinned to ``core``: once every process is warm (``together``, a barrier), time the
    model's step for ``seconds``; put (core, {slot index: median step seconds}) on ``out``."""
    os.sched_setaffinity(0, {core})
    import torch

    from partrain.data import dataset_spec
    from partrain.distributed.launch import keep_freed_memory
    from partrain.models import build_model
    from partrain.profile.sharing import training_step

    keep_freed_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = dataset_spec(dataset)  # random rows of the dataset's shape: the speed, not the data, is measured
    net = build_model(model, spec.input_shape, spec.num_classes)
    step = training_step(net, torch.randn(batch, *spec.input_shape), torch.zeros(batch, dtype=torch.long))
    step()  # warm: the allocator's pages and the thread pool
    together.wait(timeout=START_TIMEOUT_S)
    start = time.monotonic()  # the same clock in every process: slots line up to the barrier's release
    steps: dict[int, list[float]] = {}
    while (now := time.monotonic()) < start + seconds:
        step()
        steps.setdefault(int((now - start) / slot), []).append(time.monotonic() - now)
    out.put((core, {k: statistics.median(v) for k, v in steps.items()}))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(series: dict[int, dict[int, float]]) -> dict:
    """Per core and for the cores together, from {core: {slot: median step seconds}}.

    The slowdowns are relative to each core's own fast level, so that cores that differ
    steadily (another model of processor) do not count as variation."""
    series = {core: slots for core, slots in series.items() if slots}
    cores = {}
    for core, slots in sorted(series.items()):
        fast = quantile(list(slots.values()), FAST_QUANTILE)
        ratios = [t / fast for t in slots.values()]
        cores[core] = {"fast_ms": fast * 1e3, "median_ms": statistics.median(slots.values()) * 1e3,
                       "mean_slowdown": statistics.fmean(ratios), "slow_share": sum(r > SLOW_OVER for r in ratios) / len(ratios),
                       "slots": len(ratios)}
    shared = set.intersection(*(set(s) for s in series.values())) if series else set()
    worst = [max(series[c][k] / (cores[c]["fast_ms"] / 1e3) for c in series) for k in sorted(shared)]
    return {"cores": cores,
            "serial": statistics.fmean(c["mean_slowdown"] for c in cores.values()) if cores else float("nan"),
            "synchronous": statistics.fmean(worst) if worst else float("nan"),
            "slots_together": len(worst)}


def measure(model: str, dataset: str, batch: int, seconds: float, slot: float) -> dict[int, dict[int, float]]:
    """{core: {slot: median step seconds}}: one pinned process per core, all busy at once."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    cores = sorted(os.sched_getaffinity(0))
    together = ctx.Barrier(len(cores))
    procs = [ctx.Process(target=core_worker, args=(c, model, dataset, batch, seconds, slot, together, out)) for c in cores]
    for p in procs:
        p.start()
    series = dict(out.get(timeout=START_TIMEOUT_S + seconds + 60) for _ in procs)
    for p in procs:
        p.join()
    return series


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cnn", help="a zoo model whose step is timed (default cnn)")
    parser.add_argument("--dataset", default="mnist", help="whose input shape and classes the model is built for (default mnist)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long every core is timed (default 60)")
    parser.add_argument("--slot", type=float, default=0.5, help="seconds per slot median (default 0.5)")
    parser.add_argument("--json", help="write the series and the summary here")
    args = parser.parse_args()
    series = measure(args.model, args.dataset, args.batch_size, args.seconds, args.slot)
    summary = summarize(series)
    for core, c in summary["cores"].items():
        print(f"core {core}: fast {c['fast_ms']:.2f} ms, median {c['median_ms']:.2f} ms, mean x{c['mean_slowdown']:.2f}, "
              f"{100 * c['slow_share']:.0f}% of {c['slots']} slots over x{SLOW_OVER}")
        print("  " + " ".join(f"{series[core][k] * 1e3:.0f}" for k in sorted(series[core])))
    print(f"a one-worker step pays x{summary['serial']:.2f} its fast-state time on average; "
          f"a step that waits for the slowest of {len(series)} x{summary['synchronous']:.2f} "
          f"({summary['slots_together']} slots)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "series": series, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
