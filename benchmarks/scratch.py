"""The scratch engine: speedup of each hand-written parallel mode over scratch serial, where
the time goes, the scratch engine against the PyTorch engine, and accuracy.

    python benchmarks/scratch.py [--steps 300] [--rounds 3] [--data-dir ../shared/data] [--no-accuracy]

0. Do Python threads run NumPy at the same time? Whether a GEMM releases the GIL (the main
   thread counts while another multiplies; a GIL-holding C call as the control), and the
   same GEMMs done twice in one thread against once in each of two threads.
1. Speedup over scratch serial (MNIST MLP 784-256-128-10, batch 64, float32, BLAS on one
   thread everywhere): threads 2, ddp 2, hybrid 2x2, model-parallel 2 (4 micro-batches),
   local SGD 2 (weights averaged every 8 steps). Each round runs every mode once, serial
   first (A B C ... A B C ...), over ``--rounds``; a figure is the median over rounds of each
   run's mean step time after warm-up (the mean, not the median: local SGD's averaging
   steps are 1 in 8, and a median would leave them out). The 2-process modes share one group of processes
   a round (``run_many``), so no process start is inside a step.
2. Where the time goes: mean ms per step of each phase (compute, reduce, comm, update),
   per rank, from the timeline every step records, of the last round; ``comm`` includes
   waiting for the peer. Then the messages alone: the allreduce and a send/recv round trip.
3. Epoch time, scratch serial against ``partrain train --model mlp`` (hidden 256,128, the
   zoo's default) serial with 1 thread: one epoch each, alternating, ``--rounds`` times.
4. Accuracy: MNIST MLP 5 epochs (goal >= 97%); OCR letters, Linear+Sigmoid 128-128-10,
   lr 0.1, batch 32, 15 epochs (goal >= 88%).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from partrain.config import RunConfig
from partrain.runner import run_training
from partrain.scratch import ScratchConfig, run, run_many
from partrain.scratch.train import WARMUP_STEPS

PARALLEL = {  # name: ScratchConfig changes, all on 2 processes
    "ddp 2": dict(strategy="ddp", workers=2),
    "hybrid 2x2": dict(strategy="hybrid", workers=2, threads=2),
    "model-parallel 2": dict(strategy="model-parallel", workers=2, microbatches=4),
    "local-sgd 2 (avg/8)": dict(strategy="local-sgd", workers=2, average_every=8),
}


def mean_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.mean(seconds[WARMUP_STEPS:])


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def gil_released(seconds: float = 1.0) -> None:
    """Can the main thread run Python while another thread is inside a C call? It counts
    loop turns while a thread does GEMMs, and while one does ``sum(range(...))``, a C call
    that holds the GIL throughout (the control). Independent of how busy the machine is:
    a held GIL stops the count, a busy machine only slows it."""
    import threading

    import numpy as np
    from threadpoolctl import threadpool_limits

    m = np.random.default_rng(0).standard_normal((1000, 1000), np.float32)
    with threadpool_limits(1, "blas"):
        for name, work in (("NumPy GEMM", lambda: m @ m), ("sum(range())", lambda: sum(range(20_000_000)))):
            worker = threading.Thread(target=work)
            turns, start = 0, time.perf_counter()
            worker.start()
            while worker.is_alive():
                turns += 1
            ms = 1e3 * (time.perf_counter() - start)
            print(f"   main thread during {name:<13} {turns:>10,} turns in {ms:6.0f} ms ({turns / ms:,.0f} per ms)")


def thread_speedup(rounds: int) -> None:
    """The same work twice in one thread, then once in each of two threads."""
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    a, w = rng.standard_normal((32, 784), np.float32), rng.standard_normal((256, 784), np.float32)

    def gemms(n=300):
        for _ in range(n):
            (a @ w.T).T @ a  # fc1's forward and weight gradient for 32 rows

    with threadpool_limits(1, "blas"), ThreadPoolExecutor(2) as pool:
        ratios = []
        for _ in range(rounds):
            start = time.perf_counter()
            gemms(), gemms()
            one = time.perf_counter() - start
            start = time.perf_counter()
            list(pool.map(lambda _: gemms(), range(2)))
            ratios.append(one / (time.perf_counter() - start))
    print(f"   fc1 GEMMs, 2 threads against 1: {statistics.median(ratios):.2f}x "
          f"(rounds {', '.join(f'{r:.2f}' for r in ratios)}); loadavg {loadavg()}", flush=True)


def in_process(cfg: ScratchConfig):
    """A run in this process, with its CPU time over wall time (2.0 = two cores busy)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = run(cfg)
    return result, (time.process_time() - cpu) / (time.perf_counter() - wall)


def speedups(data_dir: str, steps: int, rounds: int) -> None:
    base = dict(dataset="mnist", steps=steps, evaluate=False, data_dir=data_dir)
    samples, cpu, last = {}, {}, {}
    for r in range(rounds):
        for name, changes in {"serial": {}, "threads 2": dict(strategy="threads", threads=2)}.items():
            result, cpu[name] = in_process(ScratchConfig(**base, **changes))
            samples.setdefault(name, []).append(mean_ms(result.step_seconds))
            last[name] = result
        results = run_many([ScratchConfig(**base, **changes) for changes in PARALLEL.values()])
        for name, result in zip(PARALLEL, results):
            samples.setdefault(name, []).append(mean_ms(result.step_seconds))
            last[name] = result
        print(f"   round {r + 1}: " + ", ".join(f"{n} {s[-1]:.2f}" for n, s in samples.items()) + f" ms/step; "
              f"loadavg {loadavg()}", flush=True)
    serial = statistics.median(samples["serial"])
    print(f"\n   {'mode':<20} {'ms/step':>8} {'spread':>14} {'speedup':>8} {'samples/s':>10}")
    for name, ms in samples.items():
        med = statistics.median(ms)
        print(f"   {name:<20} {med:>8.2f} {min(ms):>6.2f}-{max(ms):<7.2f} {serial / med:>7.2f}x {64e3 / med:>10,.0f}")
    print(f"   CPU time / wall time in this process: serial {cpu['serial']:.2f}, threads 2 {cpu['threads 2']:.2f} "
          "(2.0 would be both cores busy)")

    print("\n2. Where the time goes: mean ms per step, per rank (last round)")
    for name, result in last.items():
        for rank, phases in enumerate(result.phases_ms_per_rank):
            parts = ", ".join(f"{p} {ms:.2f}" for p, ms in phases.items())
            print(f"   {name:<20} rank {rank}: {parts} (sum {sum(phases.values()):.2f})")
    from partrain.scratch.comm import run_workers

    alone = run_workers(collectives, (), 2)[0]
    print("   the messages alone, 2 processes, nothing else to do: "
          + ", ".join(f"{name} {ms:.2f} ms" for name, ms in alone.items()) + f"; loadavg {loadavg()}")


def collectives(comm, repeats: int = 200) -> dict[str, float]:
    """A worker's median ms for the messages alone: the ddp allreduce (235,147 float32,
    the MLP's gradient and the loss) and a pipeline round trip (32 x 256 float32 there, back)."""
    import numpy as np

    grads, act = np.zeros(235_147, np.float32), np.zeros((32, 256), np.float32)
    times = {"allreduce 0.94 MB": [], "send+recv round trip 32 KB": []}
    for _ in range(repeats):
        start = time.perf_counter()
        comm.allreduce_sum(grads)
        times["allreduce 0.94 MB"].append(time.perf_counter() - start)
        start = time.perf_counter()
        if comm.rank == 0:
            comm.isend(act, 1).wait()
            comm.recv(act.shape, act.dtype, 1)
        else:
            back = comm.recv(act.shape, act.dtype, 0)
            comm.isend(back, 0).wait()
        times["send+recv round trip 32 KB"].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t[10:]) for name, t in times.items()}


def engines(data_dir: str, rounds: int) -> None:
    torch_cfg = RunConfig(model="mlp", dataset="mnist", data_dir=data_dir, epochs=1, threads=1, evaluate=False)
    scratch_cfg = ScratchConfig(dataset="mnist", epochs=1, evaluate=False, data_dir=data_dir)
    times = {"scratch": [], "torch": []}
    for _ in range(rounds):
        times["scratch"].append(run(scratch_cfg).epochs[0].seconds)
        times["torch"].append(run_training(torch_cfg, show_progress=False).epochs[0].seconds)
    s, t = statistics.median(times["scratch"]), statistics.median(times["torch"])
    print(f"   scratch {s:.2f} s/epoch ({min(times['scratch']):.2f}-{max(times['scratch']):.2f}), "
          f"torch {t:.2f} s/epoch ({min(times['torch']):.2f}-{max(times['torch']):.2f}): "
          f"scratch/torch = {s / t:.2f}; loadavg {loadavg()}")


def accuracy(data_dir: str) -> None:
    mnist = run(ScratchConfig(dataset="mnist", epochs=5, data_dir=data_dir))
    print("   MNIST MLP, 5 epochs: " + ", ".join(f"{e.test_accuracy:.2%}" for e in mnist.epochs)
          + f" (goal >= 97%); {mnist.epochs[-1].seconds:.1f} s/epoch")
    ocr = run(ScratchConfig(dataset="ocr", hidden=(128,), lr=0.1, batch_size=32, epochs=15, data_dir=data_dir))
    print(f"   OCR Linear+Sigmoid, 15 epochs: final {ocr.test_accuracy:.2%}, best {max(e.test_accuracy for e in ocr.epochs):.2%}"
          f" (goal >= 88%); loadavg {loadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-dir", default=os.environ.get("PARTRAIN_DATA_DIR", "../shared/data"))
    parser.add_argument("--no-accuracy", dest="accuracy", action="store_false")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores, loadavg {loadavg()}; MNIST MLP batch 64 float32, {args.steps} steps a run, "
          f"{args.rounds} rounds; ms/step = median over rounds of each run's mean", flush=True)
    print("\n0. Do Python threads run NumPy at the same time?")
    gil_released()
    thread_speedup(max(3, args.rounds))
    print("\n1. Speedup over scratch serial")
    speedups(args.data_dir, args.steps, args.rounds)
    print("\n3. Epoch time: scratch engine against the PyTorch engine (serial, 1 thread each)", flush=True)
    engines(args.data_dir, args.rounds)
    if args.accuracy:
        print("\n4. Accuracy", flush=True)
        accuracy(args.data_dir)


if __name__ == "__main__":
    main()
