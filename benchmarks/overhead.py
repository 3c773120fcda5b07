"""Strategy overhead and speedup, measured side by side in one run (1 thread per worker).

    python benchmarks/overhead.py [--steps 60] [--rounds 3] [--data-dir ../shared/data]

1. partrain ``ddp`` against a hand-written plain-PyTorch DDP loop: throughput ratio
   (goal: >= 0.98, i.e. partrain adds no measurable overhead);
2. 2-worker speedup over ``serial``: cnn at global batch 256, mlp at global batch 64;
3. ``gpipe`` and ``1f1b`` against ``model-parallel``: 2 stages, 8 micro-batches (cnn);
4. the cost of recording events (``--events``) on a 1f1b run, on against off.

Every figure is the median seconds per step over the steps after warm-up; runs of the
things compared alternate (A B A B ...) over ``--rounds`` so drift on a shared machine
hits both alike, and the ratio is of the medians of the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from partrain.config import RunConfig
from partrain.data import load_dataset
from partrain.distributed.launch import detect_launcher, init_process_group, leave_process_group
from partrain.distributed.spawn import spawn
from partrain.models import build_model
from partrain.runner import run_training

WARMUP = 10


def steady_median(seconds: list[float]) -> float:
    return statistics.median(seconds[WARMUP:])


def plain_ddp_worker(model_name: str, batch: int, steps: int, data_dir: str) -> list[float]:
    """The textbook DDP loop, written by hand: what partrain's ddp must not be slower than."""
    torch.set_num_threads(1)
    init_process_group(detect_launcher(), "gloo", timeout_s=120)  # spawn's private rendezvous
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_dataset("mnist", "train", data_dir=data_dir)
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model(model_name, data.spec.input_shape, data.spec.num_classes))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    per = batch // world
    times = []
    for step in range(steps):
        start = time.perf_counter()
        x, y = data.get(order[step * batch + rank * per : step * batch + (rank + 1) * per])
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    # DDP's reducer holds the group: freed after it, at return, gloo's destructor joins a thread that
    # waits for the GIL this one holds, and the worker hangs. Free the model first
    model = opt = None
    leave_process_group()
    return times


def partrain_step(data_dir: str, steps: int, **kw) -> float:
    cfg = RunConfig(dataset="mnist", data_dir=data_dir, steps=steps, threads=1, evaluate=False, **kw)
    return steady_median(run_training(cfg, show_progress=False).step_seconds)


def plain_step(data_dir: str, steps: int, model: str, batch: int, workers: int) -> float:
    return steady_median(spawn(plain_ddp_worker, (model, batch, steps, data_dir), workers)[0])


def alternate(rounds: int, runs: dict) -> dict[str, float]:
    """Median over rounds of each run's seconds per step, the runs interleaved."""
    samples = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            samples[name].append(run())
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-dir", default=os.environ.get("PARTRAIN_DATA_DIR", "../shared/data"))
    args = parser.parse_args()
    d, n = args.data_dir, args.steps
    print(f"{os.cpu_count()} cores, torch {torch.__version__}, 1 thread per worker, {n} steps ({WARMUP} warm-up), "
          f"{args.rounds} alternating rounds; seconds per step are medians", flush=True)

    print("\n1. partrain ddp vs a hand-written DDP loop (2 workers)")
    for model, batch in (("cnn", 256), ("mlp", 64)):
        t = alternate(args.rounds, {
            "plain": lambda: plain_step(d, n, model, batch, 2),
            "partrain": lambda: partrain_step(d, n, model=model, batch_size=batch, strategy="ddp", workers=2),
        })
        print(f"   {model} batch {batch}: plain {t['plain'] * 1e3:.2f} ms, partrain {t['partrain'] * 1e3:.2f} ms, "
              f"throughput ratio partrain/plain = {t['plain'] / t['partrain']:.3f}", flush=True)

    print("\n2. 2-worker speedup over serial (same global batch)")
    for model, batch in (("cnn", 256), ("mlp", 64)):
        runs = {"serial": lambda: partrain_step(d, n, model=model, batch_size=batch)}
        for strategy in ("ddp", "local-sgd", "fsdp"):
            runs[strategy] = lambda s=strategy: partrain_step(d, n, model=model, batch_size=batch, strategy=s, workers=2)
        t = alternate(args.rounds, runs)
        cells = ", ".join(f"{s} {t['serial'] / t[s]:.2f}x" for s in runs if s != "serial")
        print(f"   {model} batch {batch}: serial {t['serial'] * 1e3:.2f} ms/step; speedup {cells}", flush=True)

    print("\n3. pipelines vs model-parallel (cnn, 2 stages, batch 256, 8 micro-batches)")
    t = alternate(args.rounds, {
        s: (lambda s=s: partrain_step(d, n, model="cnn", batch_size=256, strategy=s, workers=2,
                                      microbatches=None if s == "model-parallel" else 8))
        for s in ("model-parallel", "gpipe", "1f1b")
    })
    for s in ("gpipe", "1f1b"):
        print(f"   {s}: {t[s] * 1e3:.2f} ms/step vs model-parallel {t['model-parallel'] * 1e3:.2f} ms: "
              f"{t['model-parallel'] / t[s]:.2f}x", flush=True)

    print("\n4. event recording overhead (cnn, 1f1b, 2 stages, batch 256, 8 micro-batches)")
    with tempfile.TemporaryDirectory() as tmp:
        pipe = dict(model="cnn", batch_size=256, strategy="1f1b", workers=2, microbatches=8)
        t = alternate(args.rounds, {
            "off": lambda: partrain_step(d, n, **pipe),
            "on": lambda: partrain_step(d, n, events=tmp, **pipe),
        })
    print(f"   off {t['off'] * 1e3:.2f} ms/step, on {t['on'] * 1e3:.2f} ms/step: on/off = {t['on'] / t['off']:.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
