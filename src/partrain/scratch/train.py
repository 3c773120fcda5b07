"""The scratch engine's run: a configuration, the training loop, the result.

    result = run(ScratchConfig(dataset="mnist", strategy="ddp", workers=2, epochs=1))

The loop, the same for every strategy: per epoch the PyTorch engine's sample order; per
step this worker's rows of the global batch, one ``stepper.step``; per epoch the test
accuracy. Losses are kept per step and made the world's once, at the end.
"""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from threadpoolctl import threadpool_limits

from partrain.data import dataset_spec
from partrain.errors import PartrainError
from partrain.events import EventLog
from partrain.progress import StepProgress
from partrain.scratch import STRATEGIES
from partrain.scratch.comm import Comm, run_workers
from partrain.scratch.data import dataset_name, epoch_order, load_arrays
from partrain.scratch.local import Timeline
from partrain.scratch.net import mlp
from partrain.scratch.pipeline import Pipeline
from partrain.scratch.strategies import DataParallel, LocalSGD
from partrain.train import EpochResult, RunResult, check_finite

WARMUP_STEPS = 5  # left out of the phase means (first-touch page faults, thread start)


@dataclass
class ScratchConfig:
    dataset: str = "mnist"
    hidden: tuple[int, ...] = (256, 128)
    activation: str | None = None  # None: relu for MNIST-like data, sigmoid for the OCR letters
    dtype: str = "float32"
    epochs: int = 1
    steps: int | None = None  # stop after this many steps in total
    limit: int | None = None
    eval_limit: int | None = None
    evaluate: bool = True
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0
    strategy: str = "serial"
    workers: int = 1  # processes (threads for --strategy threads)
    threads: int = 1  # threads per process (threads, hybrid)
    microbatches: int | None = None  # model-parallel; default 2 x stages
    average_every: int | None = 1  # local-sgd: steps between weight averages; None = once an epoch
    timeout_s: float = 300.0
    data_dir: str | None = None
    synthetic: bool = False
    events: str | None = None  # a directory: every rank's spans, for ``partrain trace``

    def __post_init__(self):
        self.dataset = dataset_name(self.dataset)
        if self.activation is None:
            self.activation = "sigmoid" if self.dataset == "ocr-letters" else "relu"
        if self.strategy not in STRATEGIES:
            raise PartrainError(f"the scratch engine has no strategy {self.strategy!r}; use one of {', '.join(STRATEGIES)}")
        if self.dtype not in ("float32", "float64"):
            raise PartrainError(f"--dtype must be float32 or float64, got {self.dtype!r}")
        for name in ("epochs", "batch_size", "workers", "threads"):
            if getattr(self, name) < 1:
                raise PartrainError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.strategy == "threads":  # --workers N or --threads N: both count threads here
            if self.workers > 1 and self.threads > 1:
                raise PartrainError("threads runs one process: give the thread count as --threads T (or --workers T), not both")
            self.threads, self.workers = max(self.workers, self.threads), 1
        elif self.strategy == "serial" and (self.workers > 1 or self.threads > 1):
            raise PartrainError("serial is one process, one thread: leave out --workers/--threads, or pick a parallel strategy")
        elif self.strategy == "hybrid" and self.threads < 2:
            raise PartrainError("hybrid is processes x threads: give --threads T (2 or more) beside --workers")
        elif self.strategy in ("ddp", "model-parallel") and self.threads > 1:
            raise PartrainError(f"{self.strategy} runs one thread a process; for processes x threads use --strategy hybrid")
        if self.strategy == "model-parallel" and self.workers > len(self.hidden) + 1:
            raise PartrainError(f"model-parallel: {self.workers} stages for {len(self.hidden) + 1} layers; "
                                f"use at most {len(self.hidden) + 1} workers")
        if self.microbatches is not None and not 1 <= self.microbatches <= self.batch_size:
            raise PartrainError(f"--microbatches must be 1 to the batch size ({self.batch_size}), got {self.microbatches}")
        if self.average_every is not None and self.average_every < 1:
            raise PartrainError(f"--average-every must be at least 1 or 'epoch', got {self.average_every}")

    @property
    def processes(self) -> int:
        return 1 if self.strategy == "threads" else self.workers


@dataclass
class ScratchResult(RunResult):
    """The PyTorch engine's result, plus where the time went: mean ms per step of each phase."""

    engine: str = "scratch"
    processes: int = 1
    phases_ms: dict = field(default_factory=dict)  # rank 0's
    cpu_ms_per_step: float | None = None  # rank 0's CPU time (all its threads) per step: the work, busy machine or not
    phases_ms_per_rank: list = field(default_factory=list)


def run(cfg: ScratchConfig, show_progress: bool = False) -> ScratchResult | None:
    """Train as ``cfg`` says, in this process or in ``cfg.processes`` spawned ones (under
    mpirun: in mpirun's processes; the result on rank 0, None on the others). With
    ``show_progress`` rank 0 draws a progress bar on stderr, as the PyTorch engine does."""
    load_arrays(cfg.dataset, "test", data_dir=cfg.data_dir, synthetic=cfg.synthetic, limit=1)  # missing data: one line, before any spawn
    return _with_ranks(run_workers(train_worker, (cfg, show_progress), cfg.processes, cfg.timeout_s))


def run_many(cfgs: list[ScratchConfig]) -> list[ScratchResult]:
    """Several runs one after another in one group of processes (all need as many): the
    processes start once, which the tests and the benchmark use to save seconds a run."""
    if len({cfg.processes for cfg in cfgs}) != 1:
        raise PartrainError("run_many: every configuration must run on the same number of processes")
    per_rank = run_workers(train_many, (cfgs,), cfgs[0].processes, max(cfg.timeout_s for cfg in cfgs))
    if per_rank is None:  # a rank of mpirun's other than 0
        return [None] * len(cfgs)
    return [_with_ranks([results[i] for results in per_rank]) for i in range(len(cfgs))]


def _with_ranks(results: list[ScratchResult] | None) -> ScratchResult | None:
    if results is None:
        return None
    results[0].phases_ms_per_rank = [r.phases_ms for r in results]
    results[0].peak_memory_per_worker = [r.peak_memory_bytes for r in results]
    results[0].peak_memory_bytes = max(results[0].peak_memory_per_worker)
    return results[0]


def make_stepper(cfg: ScratchConfig, comm: Comm):
    dtype = np.dtype(cfg.dtype)
    blocks = mlp(widths(cfg), cfg.activation, dtype, cfg.seed)
    opt = (cfg.lr, cfg.momentum, cfg.weight_decay, dtype)
    if cfg.strategy == "model-parallel":
        return Pipeline(blocks, comm, cfg.microbatches or 2 * comm.world, *opt)
    if cfg.strategy == "local-sgd":
        return LocalSGD(blocks, comm, cfg.threads, *opt, every=cfg.average_every)
    return DataParallel(blocks, comm, cfg.threads, *opt)


def widths(cfg: ScratchConfig) -> tuple[int, ...]:
    spec = dataset_spec(cfg.dataset)
    return (int(np.prod(spec.input_shape)), *cfg.hidden, spec.num_classes)


def count_parameters(cfg: ScratchConfig) -> int:
    w = widths(cfg)
    return sum((n_in + 1) * n_out for n_in, n_out in zip(w, w[1:]))


def train_worker(comm: Comm, cfg: ScratchConfig, show_progress: bool = False) -> ScratchResult:
    # The parallelism is ours alone: BLAS runs one thread in every thread of ours. A diverging
    # run is told once, by check_finite, not by NumPy's overflow warning from every layer.
    with threadpool_limits(1, "blas"), np.errstate(over="ignore", invalid="ignore"):
        return _train(comm, cfg, show_progress and comm.rank == 0)


def train_many(comm: Comm, cfgs: list[ScratchConfig]) -> list[ScratchResult]:
    return [train_worker(comm, cfg) for cfg in cfgs]


def _train(comm: Comm, cfg: ScratchConfig, show_progress: bool = False) -> ScratchResult:
    dtype = np.dtype(cfg.dtype)
    data = dict(data_dir=cfg.data_dir, synthetic=cfg.synthetic, seed=cfg.seed, dtype=dtype)
    x, y = load_arrays(cfg.dataset, "train", limit=cfg.limit, **data)
    xt, yt = load_arrays(cfg.dataset, "test", limit=cfg.eval_limit, **data) if cfg.evaluate else (None, None)
    stepper = make_stepper(cfg, comm)
    events = EventLog(cfg.events, comm.rank)
    timeline, losses, step_seconds = Timeline(events), [], []
    steps_per_epoch = len(x) // cfg.batch_size  # drop the last partial batch, as the PyTorch engine does
    if steps_per_epoch == 0:
        raise PartrainError(f"{len(x)} training samples make no batch of {cfg.batch_size}: lower --batch-size")
    spans = []  # per epoch: (first step, steps, seconds, (test loss, test accuracy))
    cpu = 0.0  # process CPU seconds inside the steps
    total_steps = min(cfg.epochs * steps_per_epoch, cfg.steps or cfg.epochs * steps_per_epoch)
    progress = StepProgress(show_progress, total_steps, label=f"scratch mlp/{cfg.dataset} {cfg.strategy} x{comm.world * cfg.threads}")
    has_loss = getattr(stepper, "last", True)  # a pipeline's loss is on its last stage
    with progress:
        try:
            for epoch in range(cfg.epochs):
                order, start, first = epoch_order(len(x), cfg.seed, epoch).numpy(), time.perf_counter(), len(losses)
                for s in range(steps_per_epoch):
                    if cfg.steps is not None and len(losses) >= cfg.steps:
                        break
                    batch = order[s * cfg.batch_size:(s + 1) * cfg.batch_size]
                    mine = batch[stepper.rows(len(batch))]  # this worker's rows of the global batch
                    t, c = time.perf_counter(), time.process_time()
                    with timeline.phase("data"):  # a copy of the rows: ~batch x features x 4 bytes
                        xb, yb = x[mine], y[mine]
                    losses.append(stepper.step(xb, yb, len(batch), timeline))
                    step_seconds.append(time.perf_counter() - t)
                    cpu += time.process_time() - c
                    events.record("step", t, t + step_seconds[-1], step=len(timeline.steps))
                    timeline.end_step()
                    progress.advance(losses[-1] if has_loss else None, len(batch))  # a redraw at most every 0.25 s
                stepper.end_epoch(timeline)
                seconds = time.perf_counter() - start
                spans.append((first, len(losses) - first, seconds, stepper.evaluate(xt, yt) if cfg.evaluate else (None, None)))
                if cfg.steps is not None and len(losses) >= cfg.steps:
                    break
            losses = stepper.world_losses(losses)  # one message, after the last step
            check_finite(losses, 0, cfg.lr)  # the same on every process: all stop, or none
        finally:
            stepper.close()
    events.write({"engine": "scratch", "scratch_config": asdict(cfg), "world_size": comm.world * cfg.threads,
                  "processes": comm.world, "backend": comm.backend if comm.world > 1 else "none"})
    epochs = [EpochResult(e, n, float(np.mean(losses[first:first + n])) if n else float("nan"), seconds,
                          n * cfg.batch_size / seconds, *scores)
              for e, (first, n, seconds, scores) in enumerate(spans, start=1)]
    return ScratchResult(
        config={**asdict(cfg), "model": "mlp", "engine": "scratch"}, world_size=comm.world * cfg.threads,
        backend=comm.backend if comm.world > 1 else "none", threads=cfg.threads, parameters=count_parameters(cfg),
        epochs=epochs, step_losses=[float(v) for v in losses], step_seconds=step_seconds, processes=comm.world,
        steps_per_epoch=steps_per_epoch,
        partition=_partition(stepper) if cfg.strategy == "model-parallel" else None,
        phases_ms=timeline.steady_ms(WARMUP_STEPS),
        cpu_ms_per_step=1e3 * cpu / max(1, len(step_seconds)),
        peak_memory_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # this process's peak RSS (Linux: KiB)
    )


def _partition(pipeline: Pipeline) -> str:
    return "\n".join(f"stage {i}: {', '.join(map(repr, layers))}" for i, layers in enumerate(pipeline.stages))
