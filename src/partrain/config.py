"""Typed run configuration, validated where it is built.

Everything a training run needs is in one ``RunConfig`` (what to train, how long, how to
parallelize). ``ParallelDims`` is the validated (pp, dp) shape of the worker grid, after
torchtitan's ``ParallelDims``. Validation happens in ``__post_init__`` so that a bad
configuration is refused before any process is spawned or any data is read.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from partrain.errors import PartrainError

# name -> (kind, one-line description). The kind decides how the worker grid is shaped.
STRATEGIES: dict[str, tuple[str, str]] = {
    "serial": ("serial", "one worker, the baseline every speedup is measured against"),
    "ddp": ("data", "synchronous data parallel, bucketed allreduce overlapped with backward"),
    "local-sgd": ("data", "independent replicas, parameters averaged every K steps or once an epoch"),
    "fsdp": ("data", "sharded data parallel (ZeRO-3): parameters, gradients and optimizer state sharded"),
    "model-parallel": ("pipeline", "consecutive layer groups on consecutive workers, one batch at a time"),
    "gpipe": ("pipeline", "pipeline: all forwards then all backwards per batch"),
    "1f1b": ("pipeline", "pipeline: one-forward-one-backward (PipeDream-Flush)"),
    "hybrid": ("hybrid", "data parallel across pipeline replicas on a 2-D (pp x dp) device mesh"),
    "hogwild": ("shared", "shared-memory workers updating one set of weights without locks"),
}

# Pipeline schedules by name. "interleaved-1f1b" needs several stages per worker.
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def _finite_in(flag: str, value: float, what: str, ok) -> None:
    """Refuse NaN, infinities and values outside the option's range, naming the option."""
    if not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise PartrainError(f"{flag} must be a finite number {what}, got {value}")


@dataclass(frozen=True)
class ParallelDims:
    """The worker grid: ``pp`` pipeline stages times ``dp`` data-parallel replicas."""

    world_size: int
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "pp", "dp"):
            if getattr(self, name) < 1:
                raise PartrainError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.pp * self.dp != self.world_size:
            raise PartrainError(
                f"pp x dp = {self.pp} x {self.dp} = {self.pp * self.dp} differs from the "
                f"world size {self.world_size}: choose --pp and --dp whose product is --workers"
            )

    @property
    def pipeline(self) -> bool:
        return self.pp > 1

    @property
    def data_parallel(self) -> bool:
        return self.dp > 1


@dataclass
class RunConfig:
    """One training run. Defaults are the main job: an MLP on MNIST, one worker."""

    # what
    model: str = "mlp"
    dataset: str = "mnist"
    data_dir: str | None = None
    synthetic: bool = False
    model_options: dict = field(default_factory=dict)
    # how long
    epochs: int = 1
    steps: int | None = None  # stop after this many optimizer steps in total
    limit: int | None = None  # train on the first `limit` samples only
    eval_limit: int | None = None  # evaluate on the first `eval_limit` test samples only
    evaluate: bool = True
    # optimization (batch_size is the global batch, summed over data-parallel replicas)
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    optimizer: str = "sgd"
    seed: int = 0
    # parallelism
    strategy: str = "serial"
    workers: int = 1
    pp: int | None = None
    dp: int | None = None
    backend: str | None = None  # gloo | nccl; default: nccl when every worker has a GPU
    microbatches: int | None = None
    schedule: str | None = None  # for pipelines: gpipe | 1f1b | interleaved-1f1b
    stages_per_worker: int = 1  # > 1 only for interleaved schedules
    recompute: bool = False
    balance: str = "time"  # time | params
    split_points: list[int] | None = None
    bucket_mb: float = 25.0
    average_every: int | str = 1  # local-sgd: steps between averages, or "epoch"
    # machinery
    threads: int | None = None
    timeout_s: float = 300.0  # collective timeout: a dead peer fails the run, never hangs it
    checkpoint: str | None = None  # directory to write checkpoints into
    resume: str | None = None  # directory to resume from
    events: str | None = None  # directory for per-rank event traces (timelines)
    save_model: str | None = None  # file to write the trained model's full state_dict into

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise PartrainError(
                f"unknown strategy {self.strategy!r}: choose one of {', '.join(STRATEGIES)}"
            )
        positive = ["epochs", "batch_size", "workers", "stages_per_worker"]
        positive += [n for n in ("steps", "limit", "eval_limit", "microbatches", "threads") if getattr(self, n) is not None]
        for name in positive:
            if getattr(self, name) < 1:
                raise PartrainError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        _finite_in("--lr", self.lr, "> 0", lambda v: v > 0)
        _finite_in("--momentum", self.momentum, "in [0, 1)", lambda v: 0 <= v < 1)
        _finite_in("--weight-decay", self.weight_decay, ">= 0", lambda v: v >= 0)
        _finite_in("--timeout", self.timeout_s, "> 0", lambda v: v > 0)
        _finite_in("--bucket-mb", self.bucket_mb, "> 0", lambda v: v > 0)
        if not 0 <= self.seed < 2**32:
            raise PartrainError(f"--seed must be in 0..{2**32 - 1}, got {self.seed}")
        if self.optimizer not in ("sgd", "adam"):
            raise PartrainError(f"unknown optimizer {self.optimizer!r}: choose sgd or adam")
        if self.balance not in ("time", "params"):
            raise PartrainError(f"unknown --balance {self.balance!r}: choose time or params")
        if self.backend not in (None, "gloo", "nccl"):
            raise PartrainError(f"unknown backend {self.backend!r}: choose gloo or nccl")
        self._check_average_every()
        self._check_parallel()

    def _check_average_every(self) -> None:
        if isinstance(self.average_every, str) and self.average_every != "epoch":
            try:
                self.average_every = int(self.average_every)
            except ValueError:
                raise PartrainError(
                    f"--average-every takes a number of steps or 'epoch', got {self.average_every!r}"
                ) from None
        if isinstance(self.average_every, int) and self.average_every < 1:
            raise PartrainError(f"--average-every must be at least 1, got {self.average_every}")

    def _check_parallel(self) -> None:
        kind = STRATEGIES[self.strategy][0]
        if kind == "serial" and self.workers != 1:
            raise PartrainError(f"strategy serial runs on one worker, got --workers {self.workers}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise PartrainError(f"unknown schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if self.schedule is not None and kind not in ("pipeline", "hybrid"):
            raise PartrainError(f"--schedule applies to pipeline strategies, not {self.strategy}")
        if self.stages_per_worker > 1 and self.pipeline_schedule != "interleaved-1f1b":
            raise PartrainError("--stages-per-worker > 1 needs --schedule interleaved-1f1b")
        if self.pipeline_schedule == "interleaved-1f1b" and self.stages_per_worker < 2:
            raise PartrainError("--schedule interleaved-1f1b needs --stages-per-worker 2 or more")
        if kind != "hybrid" and (self.pp is not None or self.dp is not None):
            raise PartrainError(f"--pp/--dp apply to the hybrid strategy; {self.strategy} sets them from --workers")
        dims = self.dims  # validates pp x dp == workers
        if kind == "shared":
            return
        if dims.dp > 1 and self.batch_size % (dims.dp * self.num_microbatches) != 0:
            raise PartrainError(
                f"global batch {self.batch_size} is not divisible by dp x micro-batches = "
                f"{dims.dp} x {self.num_microbatches}: choose a multiple of {dims.dp * self.num_microbatches}"
            )
        if dims.pp > 1 and (self.batch_size // dims.dp) % self.num_microbatches != 0:
            raise PartrainError(
                f"batch {self.batch_size // dims.dp} per pipeline is not divisible by "
                f"{self.num_microbatches} micro-batches: choose a batch that is a multiple of it"
            )
        if dims.pp > 1 and self.strategy != "model-parallel" and self.num_microbatches < dims.pp:
            raise PartrainError(
                f"{self.num_microbatches} micro-batches for {dims.pp} pipeline stages: the "
                f"{self.pipeline_schedule} schedule needs at least as many micro-batches as stages "
                f"(--microbatches {dims.pp} or more)"
            )
        if self.strategy == "model-parallel" and self.microbatches not in (None, 1):
            raise PartrainError("model-parallel runs one batch at a time: use gpipe or 1f1b for micro-batches")

    @property
    def kind(self) -> str:
        return STRATEGIES[self.strategy][0]

    @property
    def dims(self) -> ParallelDims:
        kind, w = self.kind, self.workers
        if kind == "pipeline":
            return ParallelDims(w, pp=w, dp=1)
        if kind == "hybrid":
            pp = self.pp if self.pp is not None else (w // self.dp if self.dp else 2 if w % 2 == 0 else w)
            dp = self.dp if self.dp is not None else max(1, w // pp)
            return ParallelDims(w, pp=pp, dp=dp)
        return ParallelDims(w, pp=1, dp=w)

    @property
    def pipeline_schedule(self) -> str | None:
        """The schedule a pipeline run uses (model-parallel is GPipe with one micro-batch)."""
        if self.kind not in ("pipeline", "hybrid"):
            return None
        if self.schedule is not None:
            return self.schedule
        return "gpipe" if self.strategy in ("gpipe", "model-parallel") else "1f1b"

    @property
    def num_microbatches(self) -> int:
        if self.kind not in ("pipeline", "hybrid") or self.strategy == "model-parallel":
            return 1
        return self.microbatches if self.microbatches is not None else 2 * self.dims.pp * self.stages_per_worker

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
