"""Per-strategy predictions: seconds per step and per epoch, peak memory, and where time goes.

The public API the recommender uses:

    plans = enumerate_plans(profile, workers=4, batch_size=64)
    pred = predict_plan(profile, hardware, plan)      # -> Prediction
    pred.seconds_per_epoch, pred.fits(limit), plan.cli_args()

Reads profiles only, never a live model. Every model is per worker; times come from
``compute`` (measured blocks), ``comm`` (fitted collectives), ``pipeline_sim`` (the actual
schedule) and ``memory``. A step is what ``train.py`` times on rank 0: loading its rows,
``Stepper.train_step`` (forward, backward, communication, optimizer).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field

from partrain.config import STRATEGIES, RunConfig
from partrain.errors import PartrainError
from partrain.predict import compute
from partrain.predict.comm import collective_time, stage_transfer_time
from partrain.predict.memory import MemoryBreakdown, activation_bytes, block_input_bytes, stage_state, transient_bytes
from partrain.predict.pipeline_sim import PipelineCosts, StepWork, schedule_order, simulate
from partrain.profile.hardware import HardwareProfile
from partrain.profile.model import ModelProfile
from partrain.strategies.partition import balanced_bounds, bounds_from_split_points, pipeline_refusal

MB = 2**20  # DDP's bucket_cap_mb is in MiB (torch.nn.parallel.distributed._MB_TO_BYTES)


@dataclass(frozen=True)
class Plan:
    """One way to run a training job: what ``partrain train`` would be told."""

    strategy: str
    workers: int
    batch_size: int  # global, summed over data-parallel replicas
    pp: int = 1
    dp: int = 1
    microbatches: int = 1
    schedule: str | None = None  # pipelines: gpipe | 1f1b | interleaved-1f1b
    stages_per_worker: int = 1
    bucket_mb: float = 25.0
    average_every: int | str = 1
    recompute: bool = False
    optimizer: str = "sgd"
    momentum: float = 0.9
    threads: int | None = None
    split_points: tuple[int, ...] | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig, split_points: list[int] | None = None) -> Plan:
        dims = cfg.dims
        return cls(
            strategy=cfg.strategy, workers=cfg.workers, batch_size=cfg.batch_size, pp=dims.pp, dp=dims.dp,
            microbatches=cfg.num_microbatches, schedule=cfg.pipeline_schedule, stages_per_worker=cfg.stages_per_worker,
            bucket_mb=cfg.bucket_mb, average_every=cfg.average_every, recompute=cfg.recompute, optimizer=cfg.optimizer,
            momentum=cfg.momentum, threads=cfg.threads,
            split_points=tuple(split_points or cfg.split_points or ()) or None,
        )

    @property
    def kind(self) -> str:
        return STRATEGIES[self.strategy][0]

    def cli_args(self) -> list[str]:
        """The ``partrain train`` arguments that run this plan."""
        args = ["--strategy", self.strategy, "--workers", str(self.workers), "--batch-size", str(self.batch_size)]
        if self.kind == "hybrid":
            args += ["--pp", str(self.pp), "--dp", str(self.dp)]
        if self.kind in ("pipeline", "hybrid") and self.strategy != "model-parallel":
            args += ["--microbatches", str(self.microbatches), "--schedule", str(self.schedule)]
            if self.stages_per_worker > 1:
                args += ["--stages-per-worker", str(self.stages_per_worker)]
            if self.recompute:
                args.append("--recompute")
        if self.split_points:
            args += ["--split-points", ",".join(map(str, self.split_points))]
        if self.strategy == "ddp":
            args += ["--bucket-mb", f"{self.bucket_mb:g}"]
        if self.strategy == "local-sgd":
            args += ["--average-every", str(self.average_every)]
        args += ["--optimizer", self.optimizer]
        if self.optimizer == "sgd":
            args += ["--momentum", f"{self.momentum:g}"]
        if self.threads is not None:
            args += ["--threads", str(self.threads)]
        return args

    def to_config(self, model: str, dataset: str, **extra) -> RunConfig:
        """The validated ``RunConfig`` (raises ``PartrainError`` naming what is wrong)."""
        hybrid = self.kind == "hybrid"
        piped = self.kind in ("pipeline", "hybrid") and self.strategy != "model-parallel"
        return RunConfig(
            model=model, dataset=dataset, strategy=self.strategy, workers=self.workers, batch_size=self.batch_size,
            pp=self.pp if hybrid else None, dp=self.dp if hybrid else None,
            microbatches=self.microbatches if piped else None, schedule=self.schedule if piped else None,
            stages_per_worker=self.stages_per_worker, bucket_mb=self.bucket_mb, average_every=self.average_every,
            recompute=self.recompute, optimizer=self.optimizer, momentum=self.momentum if self.optimizer == "sgd" else 0.9,
            threads=self.threads, split_points=list(self.split_points) if self.split_points else None, **extra,
        )

    def batch_sizes(self) -> tuple[float, float]:
        """The batch sizes a prediction evaluates: one worker's rows, and its micro-batch."""
        rows = self.batch_size / self.dp
        return rows, rows / self.microbatches

    def label(self) -> str:
        """A short name for tables: strategy and the parameters that matter."""
        parts = [self.strategy]
        if self.kind == "hybrid":
            parts.append(f"pp{self.pp}xdp{self.dp}")
        if self.kind in ("pipeline", "hybrid") and self.strategy != "model-parallel":
            sched = self.schedule if self.stages_per_worker == 1 else f"{self.schedule} v{self.stages_per_worker}"
            parts.append(f"{sched} M={self.microbatches}" if self.kind == "hybrid" or sched != self.strategy else f"M={self.microbatches}")
        if self.strategy == "ddp":
            parts.append(f"bucket {self.bucket_mb:g}MB")
        if self.strategy == "local-sgd":
            parts.append(f"K={self.average_every}")
        if self.recompute:
            parts.append("recompute")
        return " ".join(parts)


@dataclass(frozen=True)
class Prediction:
    plan: Plan
    seconds_per_step: float
    steps_per_epoch: int
    compute_s: float  # forward and backward on the measured worker
    comm_s: float  # communication the computation does not hide
    bubble_s: float  # pipeline idle time
    optimizer_s: float
    data_s: float  # loading the worker's rows
    memory: MemoryBreakdown  # the worker with the largest peak
    memory_per_worker: tuple[int, ...]
    notes: tuple[str, ...] = field(default=())
    occasional_s: float = 0.0  # part of seconds_per_step paid by only a few steps (local SGD's averaging)

    @property
    def seconds_per_epoch(self) -> float:
        return self.seconds_per_step * self.steps_per_epoch

    @property
    def median_step_s(self) -> float:
        """The typical step, what a median of step times measures: without averaging that
        happens on fewer than half of the steps."""
        return self.seconds_per_step - self.occasional_s

    @property
    def memory_bytes_per_worker(self) -> int:
        return max(self.memory_per_worker)

    def fits(self, memory_limit: float) -> bool:
        """True when every worker's predicted peak is within ``memory_limit`` bytes."""
        return self.memory_bytes_per_worker <= memory_limit

    def to_dict(self) -> dict:
        return {
            "plan": asdict(self.plan), "label": self.plan.label(), "seconds_per_step": self.seconds_per_step,
            "seconds_per_epoch": self.seconds_per_epoch, "steps_per_epoch": self.steps_per_epoch,
            "compute_s": self.compute_s, "comm_s": self.comm_s, "bubble_s": self.bubble_s,
            "optimizer_s": self.optimizer_s, "data_s": self.data_s, "median_step_s": self.median_step_s,
            "memory_bytes_per_worker": self.memory_bytes_per_worker, "memory_per_worker": list(self.memory_per_worker),
            "memory": {**asdict(self.memory), "total": self.memory.total}, "notes": list(self.notes),
            "cli_args": self.plan.cli_args(),
        }


# ---- shared pieces ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Env:
    """Where a plan runs: threads, contention, speed."""

    threads: int
    local_workers: int
    nodes_used: int
    cores: int  # per node
    speed: float  # compute_speed of the hardware relative to the profiling machine
    sharing: dict[int, float]  # measured slowdown of k single-threaded workers computing side by side
    sync_s: float  # FSDP: one synchronisation after computing, beyond its collectives (measured; 0 if not).
    # DDP, local SGD and hybrid replicas use ``ddp_allreduce``, measured as DDP drives it, which includes it

    def sharing_slowdown(self, busy_workers_per_node: float) -> float:
        """Compute time of a worker while ``busy_workers_per_node`` compute on its node, over
        its time alone: measured by the hardware profile for single-threaded workers (cores,
        SMT siblings, caches and memory bandwidth shared), never below processor sharing of
        the cores (more busy threads than cores cannot each run faster than cores / threads of one)."""
        measured = self.sharing.get(round(busy_workers_per_node)) if self.threads == 1 else None
        shared = compute.contention(busy_workers_per_node * self.threads, self.cores)
        return max(measured or 1.0, shared)

    def slowdown(self, busy_workers_per_node: float) -> float:
        """``sharing_slowdown`` on this hardware's compute speed."""
        return self.sharing_slowdown(busy_workers_per_node) / self.speed


def _env(hw: HardwareProfile, plan: Plan) -> _Env:
    local = plan.workers if hw.nodes <= 1 else min(plan.workers, hw.workers_per_node)
    threads = plan.threads or max(1, hw.cores_per_node // local)  # the training default (launch.set_threads)
    return _Env(threads, local, math.ceil(plan.workers / local), hw.cores_per_node, hw.compute_speed,
                hw.compute_sharing, hw.sync_s.get(local, 0.0) if plan.workers > 1 else 0.0)


def _baseline(profile: ModelProfile, hw: HardwareProfile, workers: int) -> dict:
    return {"baseline": profile.baseline_rss_bytes, "baseline_peak": profile.baseline_peak_rss_bytes,
            "process_group": hw.process_group_rss_bytes if workers > 1 else 0}


def _steps_per_epoch(profile: ModelProfile, plan: Plan) -> int:
    return max(1, profile.train_samples // plan.batch_size)  # train.py drops the last partial batch


# ---- data parallel ------------------------------------------------------------------------


def ddp_buckets(param_bytes: list[int], cap_bytes: float) -> list[tuple[int, int]]:
    """(bytes, first block) of each DDP gradient bucket, in the order backward fills them.

    After its first step DDP rebuilds its buckets in the order gradients become ready,
    i.e. the blocks in reverse, each closed once it holds ``cap_bytes`` (Li et al.,
    "PyTorch Distributed", VLDB 2020, section 3.2.3). A bucket is ready when the earliest
    block with a parameter in it has finished its backward.
    """
    buckets, size, first = [], 0, None
    for i in reversed(range(len(param_bytes))):
        left = param_bytes[i]
        while left > 0:
            take = min(left, cap_bytes - size)
            size, left, first = size + take, left - take, i
            if size >= cap_bytes:
                buckets.append((int(size), first))
                size = 0
    if size > 0:
        buckets.append((int(size), first))
    return buckets


def overlapped_allreduce(ready_s: list[float], comm_s: list[float], backward_s: float) -> float:
    """Communication left after backward: buckets reduced one after another, each from the
    moment it is ready (Li et al. 2020; Sergeev & Del Balso, "Horovod", 2018)."""
    end = 0.0
    for ready, cost in zip(ready_s, comm_s):
        end = max(end, ready) + cost
    return max(0.0, end - backward_s)


def _data_parallel(profile: ModelProfile, hw: HardwareProfile, plan: Plan) -> Prediction:
    env = _env(hw, plan)
    dp, b = plan.dp, plan.batch_size / plan.dp
    slow = env.slowdown(env.local_workers)
    kind = compute.optimizer_kind(plan.optimizer, plan.momentum)
    fwd, bwd = compute.block_times(profile, b)
    fb = (sum(fwd) + sum(bwd) + compute.loss_time(profile, b) + compute.loop_time(profile)) * slow
    data = compute.at(profile, profile.data_s, b) * slow
    opt = compute.optimizer_time(profile, kind) * slow
    ranks = list(range(plan.workers))
    params = [blk.param_bytes for blk in profile.blocks]
    total_params = sum(params)
    notes: list[str] = []
    grads, opt_state = stage_state(profile, 0, len(params), plan.optimizer, plan.momentum)
    act = activation_bytes(profile, 0, len(params), b) + block_input_bytes(profile, 0, b)
    buffers, occasional = 0, 0.0
    if plan.strategy == "ddp":
        # DDP's own work (autograd hooks, copies into and out of the buckets), measured on a world of one
        comm = _ddp_comm(profile, hw, plan, ranks, bwd, slow) + profile.overhead_s("ddp") * slow
        buffers = total_params  # flat gradient buckets beside the gradients (gradient_as_bucket_view=False)
    elif plan.strategy == "local-sgd":
        # average_parameters flattens every parameter into one buffer and allreduces it
        # (torch.distributed.algorithms.model_averaging.utils), every K steps or once an epoch;
        # the work around it (flatten, scale, unflatten) is what the profile measured for local SGD
        # averaging every step on a world of one
        every = _steps_per_epoch(profile, plan) if plan.average_every == "epoch" else int(plan.average_every)
        local = profile.overhead_s("local-sgd") * slow
        comm = (collective_time(hw, "ddp_allreduce", total_params, ranks) + local) / every
        buffers = total_params
        if every > 2:
            occasional = comm
            notes.append(f"averaging amortized over {every} steps; the median step has none")
    elif plan.strategy == "fsdp":
        comm, buffers = _fsdp_comm(profile, hw, ranks, fwd, bwd, slow)
        comm += env.sync_s
        grads, opt_state = stage_state(profile, 0, len(params), plan.optimizer, plan.momentum, shards=dp)
    else:  # hogwild: no communication; workers update shared weights in place
        comm = 0.0
        notes.append("hogwild: lock-free updates modelled without memory-bandwidth contention")
    mem = MemoryBreakdown(**_baseline(profile, hw, plan.workers), gradients=grads, optimizer=opt_state,
                          buffers=int(buffers), activations=int(act), transient=transient_bytes(profile, act))
    return Prediction(plan, data + fb + comm + opt, _steps_per_epoch(profile, plan), fb, comm, 0.0, opt, data,
                      mem, (mem.total,) * plan.workers, tuple(notes), occasional)


def _ddp_comm(profile: ModelProfile, hw: HardwareProfile, plan: Plan, ranks: list[int], bwd: list[float], slow: float) -> float:
    """Exposed bucket allreduce plus DDP's per-forward broadcast of module buffers (BatchNorm
    statistics; ``broadcast_buffers=True`` by default). Buckets cost what the allreduce costs
    as DDP drives it (``ddp_allreduce`` in the hardware profile; the plain one on a cluster file)."""
    buckets = ddp_buckets([blk.param_bytes for blk in profile.blocks], plan.bucket_mb * MB)
    backward = [t * slow for t in bwd]
    done_at = [sum(backward[i:]) for i in range(len(backward))]  # backward runs the blocks in reverse
    ready = [done_at[first] for _, first in buckets]
    costs = [collective_time(hw, "ddp_allreduce", nbytes, ranks) for nbytes, _ in buckets]
    exposed = overlapped_allreduce(ready, costs, sum(backward))
    buffer_bytes = sum(blk.buffer_bytes for blk in profile.blocks)
    return exposed + collective_time(hw, "broadcast", buffer_bytes, ranks)


def _fsdp_comm(profile: ModelProfile, hw: HardwareProfile, ranks: list[int], fwd: list[float], bwd: list[float],
               slow: float) -> tuple[float, int]:
    """(exposed communication, gathered-parameter bytes) of ``fully_shard`` per block.

    Forward all-gathers each block's parameters as it is reached; backward all-gathers
    them again, prefetching the next block's while one computes, and reduce-scatters the
    gradients behind it: 1.5x DDP's traffic (Zhao et al., "PyTorch FSDP", VLDB 2023). The
    forward gathers are exposed; backward's are hidden up to the backward compute.
    """
    params = [blk.param_bytes for blk in profile.blocks]
    gather = [collective_time(hw, "all_gather", n, ranks) for n in params]
    scatter = [collective_time(hw, "reduce_scatter", n, ranks) for n in params]
    backward_comm = sum(gather[:-1]) + sum(scatter)  # the last block's gather is still resident
    exposed = sum(gather) + max(0.0, backward_comm - sum(bwd) * slow)
    return exposed, 2 * max(params)  # one block unsharded, the next one prefetched


# ---- pipelines ----------------------------------------------------------------------------


def stage_bounds(profile: ModelProfile, plan: Plan) -> list[tuple[int, int]]:
    """The stage cut the run will use: explicit split points, else the same min-max partition
    over measured block times at the micro-batch size as ``strategies.partition``."""
    n_stages = plan.pp * plan.stages_per_worker
    if plan.split_points:
        return bounds_from_split_points(list(plan.split_points), len(profile.blocks), n_stages)
    fwd, bwd = compute.block_times(profile, _microbatch(plan))
    return balanced_bounds([f + g for f, g in zip(fwd, bwd)], n_stages)


def _microbatch(plan: Plan) -> float:
    return plan.batch_size / plan.dp / plan.microbatches


def _pipeline_costs(profile: ModelProfile, hw: HardwareProfile, plan: Plan, bounds, env: _Env) -> PipelineCosts:
    """Per-stage compute, boundary transfers, and each rank's work around the schedule."""
    b = _microbatch(plan)
    fwd, bwd = compute.stage_times(profile, bounds, b, plan.recompute)
    action = hw.pipeline_action_s  # the runtime's own cost per micro-batch action, measured on this hardware
    n, m = len(bounds), plan.microbatches
    # every micro-batch after the first adds its parameter gradients into .grad (AccumulateGrad),
    # spread here evenly over the stage's m backwards; once the step's backwards are done the
    # schedule divides every gradient by m (scale_grads): one read and one write, 2/3 of that pass
    grad_pass = [compute.gradient_pass_time(profile, range(*bounds[s])) for s in range(n)]
    fwd = tuple(t / env.speed + action for t in fwd)
    bwd = tuple((t + grad_pass[s] * (m - 1) / m) / env.speed + action for s, t in enumerate(bwd))
    rank = lambda s: (s % plan.pp) * plan.dp  # noqa: E731  (global rank of replica 0's stage s)
    out = [compute.at(profile, profile.blocks[e - 1].out_bytes, b) for _, e in bounds]
    send_fwd = tuple(stage_transfer_time(hw, out[s], rank(s), rank(s + 1)) if s < n - 1 else 0.0 for s in range(n))
    send_bwd = tuple(stage_transfer_time(hw, out[s - 1], rank(s), rank(s - 1)) if s > 0 else 0.0 for s in range(n))
    kind = compute.optimizer_kind(plan.optimizer, plan.momentum)
    data = compute.at(profile, profile.data_s, plan.batch_size / plan.dp) / env.speed
    wrapper = profile.replica_wrapper_s if plan.dp > 1 else 0.0  # a hybrid wraps its stages only then
    before, after = [], []
    for r in range(plan.pp):
        stages = [s for s in range(n) if s % plan.pp == r]
        blocks = [i for s in stages for i in range(*bounds[s])]
        loads = 0 in stages or n - 1 in stages  # PipelineStepper.loads_data: first stage or the loss
        before.append((StepWork("data", data),) if loads else ())
        grad_bytes = sum(profile.blocks[i].param_bytes for i in blocks)
        dp_ranks = [rank(stages[0]) + d for d in range(plan.dp)]
        reduce = collective_time(hw, "ddp_allreduce", grad_bytes, dp_ranks)  # hybrid: replicas' gradients
        opt = compute.optimizer_time(profile, kind, blocks) / env.speed
        scale = sum(grad_pass[s] for s in stages) * 2 / 3 / env.speed if m > 1 else 0.0
        # the schedule's per-step bookkeeping and gradient scaling, the loop's own, and a hybrid's
        # replica wrapper on its blocks (its cost over the whole model, shared by parameter bytes)
        own = (hw.pipeline_step_s + scale
               + (compute.loop_time(profile) + wrapper * grad_bytes / max(1, profile.param_bytes)) / env.speed)
        runtime = StepWork("runtime", own)
        after.append((runtime, StepWork("allreduce", reduce, cpu=False), StepWork("optimizer", opt)))
    return PipelineCosts(fwd, bwd, send_fwd, send_bwd, tuple(before), tuple(after))


def _pipeline(profile: ModelProfile, hw: HardwareProfile, plan: Plan) -> Prediction:
    env = _env(hw, plan)
    bounds = stage_bounds(profile, plan)
    costs = _pipeline_costs(profile, hw, plan, bounds, env)
    orders = schedule_order(plan.schedule or "gpipe", plan.pp, plan.microbatches, plan.stages_per_worker)
    # k actions of the simulated timeline computing at once are k busy workers on each of its dp
    # replicas, which run the same timeline side by side, spread over the nodes the plan uses
    sharing = lambda k: env.sharing_slowdown(k * plan.dp / env.nodes_used)  # noqa: E731
    sim = simulate(orders, costs, sharing)
    no_transfer = simulate(orders, costs.without_transfers(), sharing)
    busy = sim.busy[0]  # rank 0: the worker whose step time the training loop reports
    compute_s = busy.get("F", 0.0) + busy.get("B", 0.0) + busy.get("runtime", 0.0)
    comm = busy.get("allreduce", 0.0) + max(0.0, sim.step_s - no_transfer.step_s)  # what the transfers add
    data, opt = busy.get("data", 0.0), busy.get("optimizer", 0.0)
    bubble = max(0.0, sim.step_s - compute_s - comm - data - opt)
    memory = [_pipeline_memory(profile, hw, plan, bounds, sim.max_in_flight, r) for r in range(plan.pp)]
    worst = max(memory, key=lambda m: m.total)
    per_worker = tuple(memory[r // plan.dp].total for r in range(plan.workers))
    return Prediction(plan, sim.step_s, _steps_per_epoch(profile, plan), compute_s, comm, bubble, opt, data,
                      worst, per_worker)


def _pipeline_memory(profile: ModelProfile, hw: HardwareProfile, plan: Plan, bounds, in_flight: list[int], rank: int) -> MemoryBreakdown:
    """One pipeline rank: its stages' state, receive buffers, and activations in flight.

    ``PipelineStage`` allocates a receive buffer per micro-batch for its input (all but the
    first stage) and for its output's gradient (all but the last), and keeps every
    in-flight micro-batch's output until its backward (``torch.distributed.pipelining.stage``).
    """
    b = _microbatch(plan)
    n = len(bounds)
    grads = opt = buffers = act = 0.0
    for s in range(rank, n, plan.pp):
        lo, hi = bounds[s]
        g, o = stage_state(profile, lo, hi, plan.optimizer, plan.momentum)
        grads, opt = grads + g, opt + o
        out = compute.at(profile, profile.blocks[hi - 1].out_bytes, b)
        inp = block_input_bytes(profile, lo, b)
        buffers += plan.microbatches * ((inp if s > 0 else 0.0) + (out if s < n - 1 else 0.0))
        keeps_out = 0.0 if profile.blocks[hi - 1].saves_output else out
        act += in_flight[s] * (activation_bytes(profile, lo, hi, b, plan.recompute) + keeps_out)
        if s == 0:
            act += block_input_bytes(profile, 0, plan.batch_size / plan.dp)  # the loaded batch
    return MemoryBreakdown(**_baseline(profile, hw, plan.workers), gradients=int(grads), optimizer=int(opt),
                           buffers=int(buffers), activations=int(act), transient=transient_bytes(profile, act))


# ---- serial -------------------------------------------------------------------------------


def _serial(profile: ModelProfile, hw: HardwareProfile, plan: Plan) -> Prediction:
    """The measured serial step, interpolated to the batch size (the thesis's sequential model)."""
    env = _env(hw, plan)
    slow = env.slowdown(1)
    b = plan.batch_size
    kind = compute.optimizer_kind(plan.optimizer, plan.momentum)
    step = compute.serial_step(profile, b, kind) * slow
    data = compute.at(profile, profile.data_s, b) * slow
    opt = compute.optimizer_time(profile, kind) * slow
    n = len(profile.blocks)
    grads, opt_state = stage_state(profile, 0, n, plan.optimizer, plan.momentum)
    act = activation_bytes(profile, 0, n, b) + block_input_bytes(profile, 0, b)
    mem = MemoryBreakdown(**_baseline(profile, hw, 1), gradients=grads, optimizer=opt_state, buffers=0,
                          activations=int(act), transient=transient_bytes(profile, act))
    return Prediction(plan, step, _steps_per_epoch(profile, plan), step - data - opt, 0.0, 0.0, opt, data, mem, (mem.total,))


# ---- the API ------------------------------------------------------------------------------


def predict_plan(profile: ModelProfile, hardware: HardwareProfile, plan: Plan) -> Prediction:
    """Seconds per step and epoch, peak memory per worker and the time breakdown of ``plan``."""
    kind = plan.kind
    if kind == "serial":
        pred = _serial(profile, hardware, plan)
    elif kind in ("data", "shared"):
        pred = _data_parallel(profile, hardware, plan)
    else:
        pred = _pipeline(profile, hardware, plan)
    threads = _env(hardware, plan).threads
    if threads != profile.threads:
        note = f"model profiled with {profile.threads} threads per worker, plan runs {threads}"
        pred = dataclasses.replace(pred, notes=(*pred.notes, note))
    return pred


def profile_batch_sizes(needed) -> list[int]:
    """Batch sizes to profile so that every size in ``needed`` is interpolated, not extrapolated:
    from the power of two at or below the smallest, by factors of four, up to the largest."""
    lo, hi = min(needed), max(needed)
    size = 2 ** max(0, math.floor(math.log2(max(1.0, lo))))
    sizes = []
    while size < hi:
        sizes.append(size)
        size *= 4
    return sorted({*sizes, math.ceil(hi)})


def check_plan(profile: ModelProfile, plan: Plan) -> str | None:
    """Why ``plan`` cannot run (one line), or None when it can."""
    try:
        cfg = plan.to_config(profile.model, profile.dataset)
    except PartrainError as err:
        return str(err)
    if reason := pipeline_refusal(cfg, len(profile.blocks)):
        return reason
    if plan.batch_size > profile.train_samples:
        return f"batch {plan.batch_size} exceeds the {profile.train_samples} training samples"
    return None


def candidate_plans(workers: int, batch_size: int, optimizer: str = "sgd", momentum: float = 0.9,
                    threads: int | None = None) -> list[Plan]:
    """Every strategy with the parameters that matter for ``workers`` and global ``batch_size``,
    valid or not (``check_plan`` says which cannot run)."""
    common = dict(workers=workers, batch_size=batch_size, optimizer=optimizer, momentum=momentum, threads=threads)
    if workers == 1:
        return [Plan("serial", **common)]
    return _data_plans(common) + _pipeline_plans(common)


def enumerate_plans(profile: ModelProfile, workers: int, batch_size: int, optimizer: str = "sgd", momentum: float = 0.9,
                    threads: int | None = None, with_invalid: bool = False) -> list[Plan] | list[tuple[Plan, str | None]]:
    """The candidate plans that can run this model, or with ``with_invalid`` every candidate
    with the reason it cannot (None when it can). DDP's small buckets are left out when the
    gradients fit one of them anyway."""
    candidates = [
        plan for plan in candidate_plans(workers, batch_size, optimizer, momentum, threads)
        if not (plan.strategy == "ddp" and plan.bucket_mb < 25 and profile.param_bytes <= plan.bucket_mb * MB)
    ]
    checked = [(plan, check_plan(profile, plan)) for plan in candidates]
    return checked if with_invalid else [plan for plan, reason in checked if reason is None]


def _data_plans(common: dict) -> list[Plan]:
    w = common["workers"]
    plans = [Plan("ddp", dp=w, **common), Plan("ddp", dp=w, bucket_mb=1.0, **common)]
    plans += [Plan("local-sgd", dp=w, average_every=k, **common) for k in (1, 8, "epoch")]
    plans += [Plan("fsdp", dp=w, **common), Plan("hogwild", dp=w, **common)]
    return plans


def _pipeline_plans(common: dict) -> list[Plan]:
    workers = common["workers"]
    plans = [Plan("model-parallel", pp=workers, schedule="gpipe", **common)]
    for m in (workers, 2 * workers, 4 * workers):
        plans += [Plan("gpipe", pp=workers, microbatches=m, schedule="gpipe", **common),
                  Plan("1f1b", pp=workers, microbatches=m, schedule="1f1b", **common),
                  Plan("1f1b", pp=workers, microbatches=m, schedule="interleaved-1f1b", stages_per_worker=2, **common)]
    for pp in range(2, workers):
        if workers % pp == 0:
            dp = workers // pp
            for schedule in ("gpipe", "1f1b"):
                plans += [Plan("hybrid", pp=pp, dp=dp, microbatches=m, schedule=schedule, **common) for m in (pp, 2 * pp)]
    return plans


def predictions_table(predictions: list[Prediction], title: str, memory_limit: float | None = None):
    """A rich table of predictions, fastest first, with the time breakdown."""
    from rich.table import Table

    table = Table(title=title)
    for name in ("plan", "s/step", "s/epoch", "MiB/worker", "compute", "comm", "bubble", "optimizer", "data", "fits"):
        table.add_column(name, justify="left" if name == "plan" else "right")
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    for p in sorted(predictions, key=lambda p: p.seconds_per_step):
        fits = "" if memory_limit is None else ("yes" if p.fits(memory_limit) else "NO")
        table.add_row(p.plan.label(), ms(p.seconds_per_step), f"{p.seconds_per_epoch:.1f}",
                      f"{p.memory_bytes_per_worker / 2**20:.0f}", ms(p.compute_s), ms(p.comm_s), ms(p.bubble_s),
                      ms(p.optimizer_s), ms(p.data_s), fits)
    return table
