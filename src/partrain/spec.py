"""One ``StrategySpec`` per strategy, in one registry: everything partrain knows about a strategy.

Every place that branches on a strategy asks its spec instead of its name: the run
configuration (which options apply, how the worker grid is shaped), the command line a plan
prints, a plan's label, the candidate plans the recommender tries, the refusals, which
overheads the profiler measures on a world of one, and the ``parallelize_*`` that runs it.

Adding a strategy: write its ``parallelize_<name>(model, blocks, cfg, ctx, sample) -> Stepper``
in ``strategies/`` and add its ``StrategySpec`` to ``SPECS`` below; nothing else. Its ``cost``
names the cost model of ``predict/`` that predicts it; one that none of them fits also needs
its own there.

Pure Python: the runtime (``parallelize``) is named by ``module:function`` and imported only
when a worker builds it, so the cost model can read specs without loading torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

# How the worker grid is shaped, and how the cost model costs a step:
#   serial   one worker                    data     dp = workers, one replica per worker
#   pipeline pp = workers, one pipeline    hybrid   pp x dp (DeviceMesh)
#   shared   workers share one set of weights in host memory (no collectives)
FAMILIES = ("serial", "data", "pipeline", "hybrid", "shared")

# The cost models of ``predict/`` a strategy can be predicted by: serial (``predictor``), ddp,
# local-sgd, fsdp and shared (``data_parallel``), pipeline (``pipeline``: the schedule simulated)
COST_MODELS = ("serial", "ddp", "local-sgd", "fsdp", "shared", "pipeline")

# Pipeline schedules by name. "interleaved-1f1b" needs several stages per worker.
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")

# option -> (its ``partrain train`` flag, how a plan's label shows it)
OPTIONS: dict[str, tuple[str, Callable[[object], str]]] = {
    "bucket_mb": ("--bucket-mb", lambda v: f"bucket {v:g}MB"),
    "average_every": ("--average-every", lambda v: f"K={v}"),
}


@dataclass(frozen=True)
class StrategySpec:
    name: str
    family: str  # one of FAMILIES
    description: str
    parallelize: str  # "module:function" of its parallelize_* (imported when a worker runs it)
    cost: str  # the cost model that predicts it (one of COST_MODELS)
    synchronous: bool = True  # reproduces the serial loss curve step by step (a test)
    asynchronous_because: str = ""  # in words, when not synchronous (the recommender's caveat)
    micro_batched: bool = False  # takes --microbatches, --schedule, --stages-per-worker, --recompute
    default_schedule: str | None = None  # pipelines: the schedule it runs without --schedule
    options: tuple[str, ...] = ()  # its own plan options (keys of OPTIONS)
    shares_host_memory: bool = False  # all workers on one node, with gloo (hogwild's shared weights)
    world_of_one_probe: bool = False  # the profiler times its machinery on a world of one
    # the plans the recommender tries on w workers: Plan keyword arguments beyond the common ones
    variants: Callable[[int], list[dict]] = lambda w: []

    @property
    def pipelined(self) -> bool:
        """Runs a pipeline schedule (model-parallel too, with one micro-batch)."""
        return self.family in ("pipeline", "hybrid")

    def runtime(self) -> Callable:
        """Its ``parallelize_*`` function (imports torch)."""
        module, function = self.parallelize.split(":")
        return getattr(importlib.import_module(module), function)

    def refusal(self, workers: int, local_workers: int, backend: str | None) -> str | None:
        """Why this strategy cannot run ``workers`` workers, ``local_workers`` per node, on
        ``backend`` (None when it can). One line with the fix."""
        if self.shares_host_memory and (backend not in (None, "gloo") or local_workers < workers):
            return f"{self.name} shares weights in host memory: it needs all its workers on one node, with gloo"
        return None


def _pipeline_variants(schedule: str, interleaved: bool) -> Callable[[int], list[dict]]:
    def variants(w: int) -> list[dict]:
        out = []
        for m in (w, 2 * w, 4 * w):
            out.append(dict(pp=w, microbatches=m, schedule=schedule))
            if interleaved:
                out.append(dict(pp=w, microbatches=m, schedule="interleaved-1f1b", stages_per_worker=2))
        return [] if w == 1 else out
    return variants


def _hybrid_variants(w: int) -> list[dict]:
    return [dict(pp=pp, dp=w // pp, microbatches=m, schedule=schedule)
            for pp in range(2, w) if w % pp == 0 for schedule in ("gpipe", "1f1b") for m in (pp, 2 * pp)]


def _data(*variants: dict) -> Callable[[int], list[dict]]:
    return lambda w: [] if w == 1 else [dict(dp=w, **v) for v in variants]


_S = "partrain.strategies."
SPECS: dict[str, StrategySpec] = {s.name: s for s in (
    StrategySpec("serial", "serial", "one worker, the baseline every speedup is measured against",
                 _S + "serial:parallelize_serial", "serial", world_of_one_probe=True, variants=lambda w: [{}] if w == 1 else []),
    StrategySpec("ddp", "data", "synchronous data parallel, bucketed allreduce overlapped with backward",
                 _S + "ddp:parallelize_ddp", "ddp", options=("bucket_mb",), world_of_one_probe=True,
                 variants=_data({}, {"bucket_mb": 1.0})),
    StrategySpec("local-sgd", "data", "independent replicas, parameters averaged every K steps or once an epoch",
                 _S + "local_sgd:parallelize_local_sgd", "local-sgd", synchronous=False,
                 asynchronous_because="averaged only every K steps", options=("average_every",),
                 world_of_one_probe=True, variants=_data(*({"average_every": k} for k in (1, 8, "epoch")))),
    StrategySpec("fsdp", "data", "sharded data parallel (ZeRO-3): parameters, gradients and optimizer state sharded",
                 _S + "fsdp:parallelize_fsdp", "fsdp", world_of_one_probe=True, variants=_data({})),
    StrategySpec("model-parallel", "pipeline", "consecutive layer groups on consecutive workers, one batch at a time",
                 _S + "pipeline:parallelize_pipeline", "pipeline", default_schedule="gpipe",
                 variants=lambda w: [] if w == 1 else [dict(pp=w, schedule="gpipe")]),
    StrategySpec("gpipe", "pipeline", "pipeline: all forwards then all backwards per batch",
                 _S + "pipeline:parallelize_pipeline", "pipeline", micro_batched=True, default_schedule="gpipe",
                 variants=_pipeline_variants("gpipe", interleaved=False)),
    StrategySpec("1f1b", "pipeline", "pipeline: one-forward-one-backward (PipeDream-Flush)",
                 _S + "pipeline:parallelize_pipeline", "pipeline", micro_batched=True, default_schedule="1f1b",
                 variants=_pipeline_variants("1f1b", interleaved=True)),
    StrategySpec("hybrid", "hybrid", "data parallel across pipeline replicas on a 2-D (pp x dp) device mesh",
                 _S + "pipeline:parallelize_pipeline", "pipeline", micro_batched=True, default_schedule="1f1b",
                 world_of_one_probe=True, variants=_hybrid_variants),
    StrategySpec("hogwild", "shared", "shared-memory workers updating one set of weights without locks",
                 _S + "hogwild:parallelize_hogwild", "shared", synchronous=False, asynchronous_because="lock-free and stale",
                 shares_host_memory=True, variants=_data({})),
)}


def fully_sharded(strategy: str, dp: int) -> bool:
    """Its replicas hold their parameters through ``fully_shard``: fsdp, and a hybrid's with dp > 1."""
    return strategy == "fsdp" or (strategy == "hybrid" and dp > 1)


def scalar_refusal(model: str, parameter: str, strategy: str) -> str:
    """Why a model with the scalar (0-dim) ``parameter`` cannot run ``strategy`` (a ``fully_sharded`` one)."""
    return (f"model {model!r}: parameter {parameter} is a scalar, which fully_shard ({strategy}) cannot shard: "
            "give it shape (1,), or use ddp, local-sgd or a pipeline")


def strategy_spec(name: str) -> StrategySpec:
    """The spec of strategy ``name``; ``PartrainError`` naming the choices when there is none."""
    from partrain.errors import PartrainError

    if name not in SPECS:
        raise PartrainError(f"unknown strategy {name!r}: choose one of {', '.join(SPECS)}")
    return SPECS[name]


def threads_per_worker(cores: int, local_workers: int, requested: int | None = None) -> int:
    """Intra-op threads per worker: what the user asked for, else the node's cores shared by
    its workers (``torch.set_num_threads(max(1, cores // local_workers))``): more busy threads
    than cores slows every worker more than it helps. The training launcher, the predictor,
    the recommender and ``predict``'s profile all ask here."""
    return requested if requested is not None else max(1, cores // max(1, local_workers))
