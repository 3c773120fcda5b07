"""The training loop: one worker's whole run, readable top to bottom.

Every strategy runs this same loop. What differs between strategies lives behind the
``Stepper`` they return: which rows of the global batch this worker loads, and how one
optimizer step is taken (plain, DDP, sharded, pipelined, averaged, lock-free).

Per step the loop costs: indexing ``batch_size / dp`` rows out of an in-memory tensor
(or generating them, for synthetic data), one ``train_step``, and appending a detached
0-d loss tensor. Nothing is reduced or printed per step except rank 0's progress bar;
losses and accuracy are reduced once an epoch.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from partrain import __version__, checkpoint, model_file
from partrain.config import RunConfig
from partrain.data import load_dataset
from partrain.distributed.context import DistContext, build_mesh
from partrain.distributed.launch import (
    LaunchInfo,
    device_for,
    init_process_group,
    keep_freed_memory,
    leave_process_group,
    set_threads,
)
from partrain.errors import PartrainError
from partrain.events import EventLog
from partrain.models import build_model, count_parameters, model_blocks
from partrain.progress import StepProgress
from partrain.strategies import PARALLELIZE, Stepper
from partrain.strategies.base import (
    all_reduce_sum,
    gather_model_state,
    loss_fn,
    world_mean_losses,
)
from partrain.strategies.partition import describe


@dataclass
class EpochResult:
    epoch: int
    steps: int
    train_loss: float
    seconds: float
    samples_per_s: float
    test_loss: float | None = None
    test_accuracy: float | None = None


@dataclass
class RunResult:
    """What a run reports (rank 0's view; losses and accuracy are world-reduced)."""

    config: dict
    world_size: int
    backend: str
    threads: int
    parameters: int
    epochs: list[EpochResult] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)  # global mean loss of every step
    step_seconds: list[float] = field(default_factory=list)  # rank 0's wall time of every step
    partition: str | None = None
    split_points: list[int] | None = None  # pipelines: the first block of every stage but the first, as cut
    peak_memory_bytes: int = 0  # the largest over the workers
    peak_memory_per_worker: list[int] = field(default_factory=list)
    version: str = __version__
    stopped_early: bool = False  # an ``on_epoch`` hook asked to stop (a pruned sweep trial)

    @property
    def test_accuracy(self) -> float | None:
        return self.epochs[-1].test_accuracy if self.epochs else None

    def summary(self) -> dict:
        """Headline figures: accuracy, loss, median step time, throughput."""
        steady = self.step_seconds[min(5, len(self.step_seconds) // 4):]  # skip warm-up steps
        median = statistics.median(steady) if steady else None
        batch = self.config["batch_size"]
        return {
            "test_accuracy": self.test_accuracy,
            "final_loss": self.step_losses[-1] if self.step_losses else None,
            "steps": len(self.step_losses),
            "seconds_per_step": median,
            "samples_per_s": batch / median if median else None,
            "seconds_per_epoch": statistics.mean(e.seconds for e in self.epochs) if self.epochs else None,
        }

    def to_dict(self) -> dict:
        return {**asdict(self), "summary": self.summary()}


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch: the same on every worker, a function of (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


# Called on rank 0 after every epoch's evaluation; returning True stops training there
# (a hyper-parameter sweep prunes a bad trial this way). Spawned workers get it pickled.
EpochHook = Callable[[EpochResult], bool]


def train_worker(cfg: RunConfig, info: LaunchInfo, show_progress: bool = True,
                 on_epoch: EpochHook | None = None) -> RunResult | None:
    """Run ``cfg`` as the worker ``info`` describes; returns the result on rank 0."""
    keep_freed_memory()  # no page faults on every step's fresh activations
    threads = set_threads(cfg.threads, info.local_world_size, announce=show_progress and info.rank == 0)
    backend = init_process_group(info, cfg.backend, cfg.timeout_s, needed=cfg.strategy != "serial")
    try:
        device = device_for(backend, info)
        ctx = DistContext(info, backend, device, cfg.dims, build_mesh(cfg.dims, device), EventLog(cfg.events, info.rank))
        result = _train(cfg, ctx, threads, show_progress and info.rank == 0, on_epoch)
        # rank 0 also records the plan as it ran (dims and stage cut resolved): `partrain trace` simulates it
        ctx.events.write({"config": cfg.to_dict(), "pp": cfg.dims.pp, "dp": cfg.dims.dp, "world_size": ctx.world_size,
                          "microbatches": cfg.num_microbatches if cfg.pipeline_schedule else None,
                          "split_points": result.split_points} if info.rank == 0 else None)
        return result if info.rank == 0 else None
    finally:
        leave_process_group()


def _train(cfg: RunConfig, ctx: DistContext, threads: int, show_progress: bool, on_epoch: EpochHook | None = None) -> RunResult:
    # --- data: every worker reads the same files; each loads only its rows of a batch
    data = dict(data_dir=cfg.data_dir, synthetic=cfg.synthetic, seed=cfg.seed)
    train_set = load_dataset(cfg.dataset, "train", limit=cfg.limit, **data)
    test_set = load_dataset(cfg.dataset, "test", limit=cfg.eval_limit, **data) if cfg.evaluate else None
    steps_per_epoch = len(train_set) // cfg.batch_size  # the last partial batch is dropped
    if steps_per_epoch == 0:
        raise PartrainError(f"batch size {cfg.batch_size} exceeds the {len(train_set)} training samples: use a smaller --batch-size")
    total_steps = min(cfg.epochs * steps_per_epoch, cfg.steps or math.inf)

    # --- model: the same seed on every worker gives the same initial weights everywhere
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, train_set.spec.input_shape, train_set.spec.num_classes, **cfg.model_options)
    blocks = model_blocks(model)
    sample = train_set.get(torch.arange(min(cfg.batch_size, len(train_set))))[0]
    stepper = PARALLELIZE[cfg.strategy](model, blocks, cfg, ctx, sample)
    part = getattr(stepper, "partition", None)
    result = RunResult(cfg.to_dict(), ctx.world_size, ctx.backend, threads, count_parameters(model))
    if part is not None:
        result.partition, result.split_points = describe(part, getattr(stepper, "cut_blocks", blocks)), part.split_points

    # --- resume: position, weights, optimizer state and RNG, as they were
    meta = checkpoint.run_meta(cfg, part.split_points if part is not None else None)
    start_epoch, start_step, done = 0, 0, 0
    if cfg.resume:  # the launcher has checked the set against this run (checkpoint.resume_config)
        pos = checkpoint.load(cfg.resume, stepper, ctx.rank, cfg)
        start_epoch, start_step, done = pos["epoch"], pos["step"], pos["global_step"]
        result.step_losses = list(pos["step_losses"])
        result.epochs = [EpochResult(**e) for e in pos["epochs"]]

    progress = StepProgress(show_progress, total_steps, done, label=f"{cfg.model}/{cfg.dataset} {cfg.strategy} x{ctx.world_size}")
    with progress:
        for epoch in range(start_epoch, cfg.epochs):
            if done >= total_steps:
                break
            order = epoch_order(len(train_set), cfg.seed, epoch)
            first = start_step if epoch == start_epoch else 0
            last = min(steps_per_epoch, first + total_steps - done)
            epoch_start = time.perf_counter()
            local_losses = run_steps(stepper, train_set, order, range(first, last), cfg.batch_size, ctx.device, result, progress)
            done += last - first
            finished = last == steps_per_epoch
            if finished:
                stepper.end_epoch()
            seconds = time.perf_counter() - epoch_start

            # --- once an epoch: reduce the losses, evaluate, checkpoint
            losses = world_mean_losses(stepper, local_losses, ctx.device).tolist()
            result.step_losses += losses
            ep = EpochResult(epoch + 1, len(losses), statistics.fmean(losses), seconds, len(losses) * cfg.batch_size / seconds)
            if test_set is not None and (finished or done >= total_steps):
                ep.test_loss, ep.test_accuracy = evaluate(stepper, test_set, cfg.batch_size, ctx.device)
            result.epochs.append(ep)
            progress.epoch_done(ep)
            if cfg.checkpoint:
                position = {
                    "epoch": epoch + 1 if finished else epoch,
                    "step": 0 if finished else last,
                    "global_step": done,
                    "step_losses": result.step_losses,
                    "epochs": [asdict(e) for e in result.epochs],
                }
                checkpoint.save(cfg.checkpoint, stepper, ctx.rank, position, meta)
            if on_epoch is not None and _stop_requested(on_epoch, ep, ctx):
                result.stopped_early = True
                break
    result.peak_memory_per_worker = _gather_ints(peak_memory_bytes(ctx.device))
    result.peak_memory_bytes = max(result.peak_memory_per_worker)
    if cfg.save_model:
        state = gather_model_state(model, stepper, ctx.dp_rank)
        if ctx.rank == 0:
            model_file.save(cfg.save_model, cfg.model, cfg.dataset, cfg.model_options, state)
    return result


def _stop_requested(on_epoch: EpochHook, ep: EpochResult, ctx: DistContext) -> bool:
    """Rank 0 asks the hook; every rank learns the answer (one 1-element allreduce an epoch)."""
    stop = bool(on_epoch(ep)) if ctx.rank == 0 else False
    return all_reduce_sum(torch.tensor([float(stop)]), ctx.device).item() > 0


def _gather_ints(value: int) -> list[int]:
    if not dist.is_initialized():
        return [value]
    out = [0] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def run_steps(stepper: Stepper, train_set, order: torch.Tensor, steps: range, batch: int, device, result: RunResult,
              progress: StepProgress) -> list[torch.Tensor | None]:
    """The hot loop: load this worker's rows of each global batch, take one step.

    Returns this worker's detached per-step losses; appends each step's wall time
    (loading included) to ``result.step_seconds``.
    """
    losses = []
    events = stepper.events  # spans cost a method call each when events are off
    for step in steps:
        start = time.perf_counter()
        with events.span("step", step=step):
            with events.span("data", step=step):
                idx = order[step * batch : (step + 1) * batch][stepper.rows]
                x, y = _to(train_set.get(idx), device) if stepper.loads_data else (None, None)
            losses.append(stepper.train_step(x, y))
        result.step_seconds.append(time.perf_counter() - start)
        progress.advance(losses[-1], batch)
    return losses


def _to(batch, device):
    x, y = batch
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


@torch.no_grad()
def evaluate(stepper: Stepper, test_set, batch_size: int, device: torch.device) -> tuple[float, float]:
    """Test loss and accuracy over the whole test split, every worker scoring its rows.

    Batches keep the training shape (pipelines need it); the last one is padded with
    sample 0 and the padding is masked out of the counts.
    """
    n = len(test_set)
    totals = torch.zeros(3, dtype=torch.float64)  # summed loss, correct, count
    for start in range(0, n, batch_size):
        idx = torch.arange(start, start + batch_size)
        valid = idx < n
        idx[~valid] = 0
        idx, valid = idx[stepper.rows], valid[stepper.rows]
        x, y = _to(test_set.get(idx), device) if stepper.loads_data else (None, None)
        logits = stepper.eval_logits(x, y)
        if logits is not None:
            logits, y = logits[valid.to(logits.device)], y[valid.to(y.device)]
            totals += torch.tensor(  # per sample, or per token for token logits [n, T, V]
                [loss_fn(logits, y, reduction="sum").item(), (logits.argmax(-1) == y).sum().item(), y.numel()],
                dtype=torch.float64,
            )
    totals = all_reduce_sum(totals, device)
    return totals[0].item() / totals[2].item(), totals[1].item() / totals[2].item()


def peak_memory_bytes(device: torch.device) -> int:
    """Allocator peak on a GPU; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
