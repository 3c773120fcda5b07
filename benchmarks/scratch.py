"""The scratch engine: speedup of each hand-written parallel mode over scratch serial, where
the time goes, the scratch engine against the PyTorch engine, and accuracy.

    python benchmarks/scratch.py [--samples 19200] [--batch-sizes 64,256,1024] [--rounds 3]
                                 [--data-dir ../shared/data] [--no-accuracy]

0. Do Python threads run NumPy at the same time? Whether a GEMM releases the GIL (the main
   thread counts while another multiplies; a GIL-holding C call as the control), and the
   same GEMMs done twice in one thread against once in each of two threads.
1. Speedup over scratch serial (MNIST MLP 784-256-128-10, float32, BLAS on one thread
   everywhere) at each batch size: threads 2, ddp 2, hybrid 2x2, model-parallel 2 (4
   micro-batches), local SGD 2 (weights averaged every 8 steps). Each round runs every mode
   once at every batch size, serial first; a figure is the median over rounds of each run's
   mean step time after warm-up (the mean, not the median: local SGD's averaging steps are
   1 in 8, and a median would leave them out). The 2-process modes share one group of
   processes a round (``run_many``), so no process start is inside a step. Then the speedup
   table against the batch size, and the CPU time per step of serial and threads: the work
   each does, which a busy machine does not change much (a second thread that finds no
   free core shows as wall time, not CPU time).
2. Where the time goes: mean ms per step of compute, reduction (threads' and micro-batches'
   gradients summed), communication (allreduce, averaging, send/recv; waiting for the peer
   included), update, data, and the Python between them, per rank, from the events each run
   of the last round recorded (``--events``, the format of ``partrain trace``). Then the
   messages alone: the allreduce and a send/recv round trip.
3. Epoch time, scratch serial against ``partrain train --model mlp`` (hidden 256,128, the
   zoo's default) serial with 1 thread: one epoch each, alternating, ``--rounds`` times.
4. Accuracy: MNIST MLP 5 epochs (goal >= 97%); OCR letters, Linear+Sigmoid 128-128-10,
   lr 0.1, batch 32, 15 epochs (goal >= 88%).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
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
        ratios, cores = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            gemms(), gemms()
            one = time.perf_counter() - start
            start, cpu = time.perf_counter(), time.process_time()
            list(pool.map(lambda _: gemms(), range(2)))
            two = time.perf_counter() - start
            ratios.append(one / two)
            cores.append((time.process_time() - cpu) / two)  # CPU time / wall time: the cores this process got
    print(f"   fc1 GEMMs, 2 threads against 1: {statistics.median(ratios):.2f}x "
          f"(rounds {', '.join(f'{r:.2f}' for r in ratios)}); the two threads got {statistics.median(cores):.2f} cores; "
          f"loadavg {loadavg()}", flush=True)
    if statistics.median(cores) < 1.5:
        # Linux's autogroup scheduling shares the CPU fairly between sessions (terminals, jobs), not
        # threads: on a busy machine this session's threads and processes together get one share
        print("   !! this process did not get two cores: with other work on the machine (and the kernel's "
              "autogroup scheduling, which shares CPU between sessions, not threads) no parallel mode below "
              "can beat serial; measure on a quiet machine", flush=True)


def in_process(cfg: ScratchConfig):
    """A run in this process, with its CPU time over wall time (2.0 = two cores busy)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = run(cfg)
    return result, (time.process_time() - cpu) / (time.perf_counter() - wall)


def speedups(data_dir: str, samples: int, rounds: int, batches: list[int], events_root: str) -> dict:
    """Every mode at every batch size, ``rounds`` times; returns the last round's event
    directories by (mode, batch). A run trains ``samples`` samples (at least 50 steps)."""
    samples_ms, cpu, events = {}, {}, {}
    for r in range(rounds):
        for batch in batches:
            base = dict(dataset="mnist", steps=max(50, samples // batch), batch_size=batch, evaluate=False, data_dir=data_dir)
            for name, changes in {"serial": {}, "threads 2": dict(strategy="threads", threads=2)}.items():
                events[name, batch] = f"{events_root}/{name.replace(' ', '-')}-b{batch}"
                result, _ = in_process(ScratchConfig(**base, **changes, events=events[name, batch]))
                samples_ms.setdefault((name, batch), []).append(mean_ms(result.step_seconds))
                cpu.setdefault((name, batch), []).append(result.cpu_ms_per_step)
        cfgs = []
        for batch in batches:
            base = dict(dataset="mnist", steps=max(50, samples // batch), batch_size=batch, evaluate=False, data_dir=data_dir)
            for name, changes in PARALLEL.items():
                events[name, batch] = f"{events_root}/{name.split()[0]}-b{batch}"
                cfgs.append(((name, batch), ScratchConfig(**base, **changes, events=events[name, batch])))
        for key, result in zip([k for k, _ in cfgs], run_many([cfg for _, cfg in cfgs])):  # one group of processes
            samples_ms.setdefault(key, []).append(mean_ms(result.step_seconds))
        print(f"   round {r + 1}/{rounds} done; loadavg {loadavg()}", flush=True)
    modes = ["serial", "threads 2", *PARALLEL]
    for batch in batches:
        serial = statistics.median(samples_ms["serial", batch])
        print(f"\n   batch {batch}: {'mode':<20} {'ms/step':>8} {'spread':>15} {'speedup':>8} {'samples/s':>10}")
        for name in modes:
            ms = samples_ms[name, batch]
            med = statistics.median(ms)
            print(f"   {'':<9}{name:<20} {med:>8.2f} {min(ms):>7.2f}-{max(ms):<7.2f} {serial / med:>7.2f}x {batch * 1e3 / med:>10,.0f}")
    print(f"\n   speedup over scratch serial (median of {rounds} rounds) against the batch size:")
    print(f"   {'mode':<20}" + "".join(f"{f'b{b}':>8}" for b in batches))
    for name in modes:
        print(f"   {name:<20}" + "".join(f"{statistics.median(samples_ms['serial', b]) / statistics.median(samples_ms[name, b]):>7.2f}x"
                                       for b in batches))
    print("\n   CPU ms per step in the process (all its threads), the work whether or not a core was free:")
    for batch in batches:
        s, t = statistics.median(cpu["serial", batch]), statistics.median(cpu["threads 2", batch])
        print(f"   b{batch:<6} serial {s:7.2f}, threads 2 {t:7.2f} ({t / s:.2f}x the work; on 2 free cores at best "
              f"{2 * s / t:.2f}x)")
    return events


def where_the_time_goes(events: dict, batches: list[int]) -> None:
    """Mean ms per step of each part, per rank, from the last round's events (``--events``)."""
    from partrain.events import read_events
    from partrain.scratch.local import breakdown

    parts = ("compute", "reduction", "communication", "update", "data")
    print(f"   {'mode':<20} {'batch':>5} {'rank':>4} " + " ".join(f"{p:>13}" for p in parts) + f" {'other':>7} {'step':>7}")
    for (name, batch), directory in events.items():
        for rank, ms in breakdown(read_events(directory), skip=WARMUP_STEPS).items():
            other = ms["step"] - sum(ms.get(p, 0.0) for p in parts)  # Python between the phases
            print(f"   {name:<20} {batch:>5} {rank:>4} " + " ".join(f"{ms.get(p, 0.0):>13.2f}" for p in parts)
                  + f" {other:>7.2f} {ms['step']:>7.2f}")
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
    parser.add_argument("--samples", type=int, default=19_200, help="samples a run trains (300 steps at batch 64)")
    parser.add_argument("--batch-sizes", default="64,256,1024", help="comma-separated (default: 64,256,1024)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-dir", default=os.environ.get("PARTRAIN_DATA_DIR", "../shared/data"))
    parser.add_argument("--no-accuracy", dest="accuracy", action="store_false")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    print(f"{os.cpu_count()} cores, loadavg {loadavg()}; MNIST MLP float32, batch {args.batch_sizes}, {args.samples} "
          f"samples a run, {args.rounds} rounds; ms/step = median over rounds of each run's mean", flush=True)
    print("\n0. Do Python threads run NumPy at the same time?")
    gil_released()
    thread_speedup(max(3, args.rounds))
    print("\n1. Speedup over scratch serial")
    with tempfile.TemporaryDirectory(prefix="scratch-events-") as root:
        events = speedups(args.data_dir, args.samples, args.rounds, batches, root)
        print("\n2. Where the time goes: mean ms per step of each part, per rank, from the last round's events "
              "(partrain train --engine scratch --events DIR records the same; partrain trace DIR draws them)")
        where_the_time_goes(events, batches)
    print("\n3. Epoch time: scratch engine against the PyTorch engine (serial, 1 thread each)", flush=True)
    engines(args.data_dir, args.rounds)
    if args.accuracy:
        print("\n4. Accuracy", flush=True)
        accuracy(args.data_dir)


if __name__ == "__main__":
    main()
