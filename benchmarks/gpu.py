"""partrain on one GPU against the plain PyTorch loop a user would write, side by side.

    PYTHONPATH=src python3 benchmarks/gpu.py --data-dir DIR [--json gpu.json] [--steps 60] [--rounds 3]
    PYTHONPATH=src python3 benchmarks/gpu.py --allow-cpu --data-dir DIR     # a tiny smoke run without a GPU

Every row is one zoo model, dataset and batch size trained two ways:

- plain: the textbook loop, written by hand: the same zoo model on the GPU, one batch
  already on the GPU (no data loading at all), SGD with momentum, ``zero_grad``,
  forward, cross-entropy (gpt's over every token), backward, ``step``; with the same
  precision, memory format and ``torch.compile`` as the partrain run it is compared with;
- partrain: ``partrain train`` (serial) through ``run_training``, with its own data
  path (MNIST and CIFAR-10 held on the GPU, ImageNet generated there) and options.

Both are timed the same way: a CUDA event pair around every step, read after the run
(partrain's ``StepClock``); a row's figure is the median over the steady steps (the first
``WARMUP`` left out: cuDNN autotuning, compilation) and the median of that over
``--rounds`` rounds run alternately (plain, partrain, plain, partrain, ...), so drift hits
both alike. ``plain / partrain`` >= 1 means partrain is as fast as the hand-written loop.
The cases are issue 16's table, plus resnet50 b128 with bf16 autocast, and with bf16,
channels-last and ``torch.compile`` together (the fastest loop a user writes by hand), and
the zoo's gpt on generated tokens (issue 17) at fp32 and bf16.
About 6 minutes on an H100, most of it compiling resnet50 (``--compile-rounds``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from partrain.config import RunConfig
from partrain.data import dataset_spec, load_dataset
from partrain.models import build_model
from partrain.runner import run_training
from partrain.strategies.base import loss_fn
from partrain.strategies.precision import DTYPES
from partrain.train import StepClock

WARMUP = 10


@dataclass(frozen=True)
class Case:
    model: str
    dataset: str
    batch: int
    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False

    @property
    def label(self) -> str:
        opts = [self.precision] + (["channels-last"] if self.channels_last else []) + (["compile"] if self.compile else [])
        data = f"{self.dataset} (synthetic)" if dataset_spec(self.dataset).synthetic_only else self.dataset
        return f"{self.model} / {data} / {self.batch} | {' + '.join(opts)}"


GPU_CASES = [
    Case("cnn", "mnist", 64), Case("cnn", "mnist", 512),
    Case("resnet18", "cifar10", 64), Case("resnet18", "cifar10", 256),
    Case("vgg11", "cifar10", 128), Case("mobilenetv2", "cifar10", 128),
    Case("resnet50", "imagenet", 128),
    Case("resnet50", "imagenet", 128, "bf16"),
    Case("resnet50", "imagenet", 128, "bf16", channels_last=True, compile=True),
    Case("gpt", "tokens", 32), Case("gpt", "tokens", 128), Case("gpt", "tokens", 128, "bf16"),
]
CPU_CASES = [Case("cnn", "mnist", 64), Case("cnn", "mnist", 64, "bf16"), Case("cnn", "mnist", 64, channels_last=True),
             Case("gpt", "tokens", 32)]


def steady_median(seconds: list[float]) -> float:
    return statistics.median(seconds[WARMUP:])


def plain_run(case: Case, steps: int, data_dir: str, device: torch.device) -> list[float]:
    """The loop a user writes by hand, the batch already on the device; seconds of every step."""
    spec = dataset_spec(case.dataset)
    data = load_dataset(case.dataset, "train", data_dir=data_dir)
    x, y = (t.to(device) for t in data.get(torch.arange(case.batch) % len(data)))
    torch.manual_seed(0)
    model = build_model(case.model, spec.input_shape, spec.num_classes).to(device)
    if case.channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if case.compile:
        model = torch.compile(model)
    low = case.precision != "fp32"
    clock = StepClock(device)
    for _ in range(steps):
        clock.start()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=DTYPES[case.precision], enabled=low):
            loss = loss_fn(model(x), y)  # cross-entropy; a token model's over every token
        loss.backward()
        opt.step()
        clock.stop()
    return clock.read()


def partrain_run(case: Case, steps: int, data_dir: str) -> list[float]:
    # epochs enough that --steps, not the end of a small dataset (the CIFAR-10 sample), ends the run
    cfg = RunConfig(model=case.model, dataset=case.dataset, data_dir=data_dir, batch_size=case.batch, steps=steps,
                    epochs=steps, evaluate=False, precision=case.precision, channels_last=case.channels_last, compile=case.compile)
    return run_training(cfg, show_progress=False).step_seconds


def measure(case: Case, steps: int, rounds: int, data_dir: str, device: torch.device) -> dict:
    """Rounds of plain and partrain, alternating; per round the steady median of each."""
    samples = {"plain": [], "partrain": []}
    for _ in range(rounds):
        samples["plain"].append(steady_median(plain_run(case, steps, data_dir, device)))
        samples["partrain"].append(steady_median(partrain_run(case, steps, data_dir)))
        gc.collect()  # the round's models and data go before the next round allocates
        if device.type == "cuda":
            torch.cuda.empty_cache()
    plain, ours = statistics.median(samples["plain"]), statistics.median(samples["partrain"])
    return {**asdict(case), "label": case.label, "plain_s": plain, "partrain_s": ours, "ratio": plain / ours,
            "rounds": samples}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("PARTRAIN_DATA_DIR", "../shared/data"))
    parser.add_argument("--steps", type=int, default=60, help=f"steps per run ({WARMUP} of them warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per row")
    parser.add_argument("--compile-rounds", type=int, default=2, help="rounds for the torch.compile row")
    parser.add_argument("--json", help="write the figures to this JSON file")
    parser.add_argument("--cudnn-benchmark", action="store_true", help="torch.backends.cudnn.benchmark on, for both")
    parser.add_argument("--only", help="only the rows whose label contains one of these comma-separated strings")
    parser.add_argument("--allow-cpu", action="store_true", help="without a GPU: a tiny smoke run on the CPU")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("benchmarks/gpu.py: no CUDA device (torch.cuda.is_available() is False): run it on a GPU machine, "
              "or pass --allow-cpu for a tiny smoke run", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    cases, steps = (GPU_CASES, args.steps) if device.type == "cuda" else (CPU_CASES, min(args.steps, WARMUP + 5))
    if args.only:
        cases = [c for c in cases if any(part in c.label for part in args.only.split(","))]
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"{name}, torch {torch.__version__}, {steps} steps per run ({WARMUP} warm-up), {args.rounds} alternating "
          f"rounds, cudnn.benchmark={args.cudnn_benchmark}; ms per step, medians", flush=True)
    print("\n| model / data / batch | options | plain loop | partrain | plain / partrain |\n| --- | --- | --- | --- | --- |")
    rows, start = [], time.perf_counter()
    for case in cases:
        rounds = args.compile_rounds if case.compile else args.rounds
        try:
            row = measure(case, steps, rounds, args.data_dir, device)
        except Exception as exc:  # one broken row must not cost the others (device time is short)
            print(f"| {case.label} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]} | | |", flush=True)
            rows.append({**asdict(case), "label": case.label, "error": f"{type(exc).__name__}: {exc}"})
            continue
        rows.append(row)
        rounds_ms = "; ".join(f"{k} " + " ".join(f"{v * 1e3:.2f}" for v in vs) for k, vs in row["rounds"].items())
        print(f"| {case.label} | {row['plain_s'] * 1e3:.2f} ms | {row['partrain_s'] * 1e3:.2f} ms | {row['ratio']:.2f} |"
              f"  rounds: {rounds_ms}", flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s in all", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "steps": steps, "warmup": WARMUP,
                       "cudnn_benchmark": args.cudnn_benchmark, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    # On an H200 (torch 2.11) the process did not end after a --compile row: everything was
    # printed and written, then the interpreter's exit hung past a 110 s limit (inductor's
    # compile workers, most likely). A benchmark's results are out by now: leave at once.
    os._exit(status)
