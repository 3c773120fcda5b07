"""The training loop: one worker's whole run, readable top to bottom.

Every strategy runs this same loop. What differs between strategies lives behind the
``Stepper`` they return: which rows of the global batch this worker loads, and how one
optimizer step is taken (plain, DDP, sharded, pipelined, averaged, lock-free).

Per step the loop costs: indexing ``batch_size / dp`` rows out of an in-memory tensor
(or generating them, for synthetic data), one ``train_step``, and appending a detached
0-d loss tensor. Nothing is reduced or printed per step except rank 0's progress bar;
losses and accuracy are reduced once an epoch.

On a GPU nothing in a step waits for the GPU: the data is indexed (or generated) on the
device, or prefetched from the host on a side stream (``data.feed``); losses stay on the
device until the epoch's reduction, and the progress bar reads one at most every 0.25 s.
Step times stay honest without a sync per step: a pair of CUDA events brackets every step,
and their elapsed times are read once, at the epoch's end (``StepClock``). An event
pair measures from when the GPU reaches the step's start to when it finishes the step's
last kernel, which is the step's wall time whether the GPU is the bottleneck (the host has
queued ahead) or the host is (the GPU waits on each launch); a sync per step would add the
queue drain to every step instead. fp16's gradient scaler is the exception: it reads its
overflow flag on the host every step, as it does in any PyTorch loop.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from partrain import __version__, checkpoint, model_file
from partrain.config import RunConfig
from partrain.data import load_dataset
from partrain.data.feed import Feed
from partrain.distributed.context import DistContext, build_mesh
from partrain.distributed.launch import (
    LaunchInfo,
    device_for,
    init_process_group,
    keep_freed_memory,
    leave_process_group,
    set_threads,
)
from partrain.errors import Diverged, PartrainError
from partrain.events import EventLog
from partrain.models import build_model, count_parameters, load_factory, model_blocks
from partrain.progress import StepProgress
from partrain.strategies import PARALLELIZE, Stepper
from partrain.strategies.base import (
    all_reduce_sum,
    gather_model_state,
    loss_fn,
    world_mean_losses,
)
from partrain.strategies.partition import describe
from partrain.strategies.precision import amp_for


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
    steps_per_epoch: int = 0  # of the training split at this batch (the last partial batch dropped)

    @property
    def test_accuracy(self) -> float | None:
        return self.epochs[-1].test_accuracy if self.epochs else None

    def summary(self) -> dict:
        """Headline figures: accuracy, loss, median step time, throughput."""
        median = statistics.median(steady) if (steady := steady_steps(self.step_seconds)) else None
        batch = self.config["batch_size"]
        return {
            "test_accuracy": self.test_accuracy,
            "final_loss": self.step_losses[-1] if self.step_losses else None,
            "steps": len(self.step_losses),
            "seconds_per_step": median,
            "samples_per_s": batch / median if median else None,
            **self._epoch_seconds(median),
        }

    def _epoch_seconds(self, median: float | None) -> dict:
        """Seconds an epoch: the mean of the whole epochs run, else (a run of a few --steps: a
        tenth of an epoch read '0.2 s/epoch') the median step times the epoch's steps, said so."""
        whole = [e.seconds for e in self.epochs if e.steps == self.steps_per_epoch]
        if whole or not (median and self.steps_per_epoch):
            return {"seconds_per_epoch": statistics.mean(whole) if whole else None, "epoch_extrapolated": False}
        return {"seconds_per_epoch": median * self.steps_per_epoch, "epoch_extrapolated": True}

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


def worker_seed(seed: int, rank: int) -> int:
    """The seed of worker ``rank``'s random numbers after the model is built: its own, and none
    a restart of the initial weights' stream (``seed`` itself) on any worker."""
    return ((seed + 1) * 1_000_003 + rank) % 2**63


def _train(cfg: RunConfig, ctx: DistContext, threads: int, show_progress: bool, on_epoch: EpochHook | None = None) -> RunResult:
    # --- data: every worker reads the same files; each loads only its rows of a batch
    data = dict(data_dir=cfg.data_dir, synthetic=cfg.synthetic, seed=cfg.seed)
    train_set = load_dataset(cfg.dataset, "train", limit=cfg.limit, **data)
    test_set = load_dataset(cfg.dataset, "test", limit=cfg.eval_limit, **data) if cfg.evaluate else None
    steps_per_epoch = len(train_set) // cfg.batch_size  # the last partial batch is dropped
    if steps_per_epoch == 0:
        raise PartrainError(f"batch size {cfg.batch_size} exceeds the {len(train_set)} training samples: use a smaller --batch-size")
    total_steps = min(cfg.epochs * steps_per_epoch, cfg.steps or math.inf)
    if cfg.steps and cfg.steps > total_steps and ctx.rank == 0:  # said, not silently fewer
        print(f"note: --steps {cfg.steps} stops at the end of --epochs {cfg.epochs}: {total_steps} steps "
              f"({steps_per_epoch} an epoch); raise --epochs to run them all", file=sys.stderr)

    # --- model: the same seed on every worker gives the same initial weights everywhere
    load_factory(cfg.model)  # a user's module imported before the seed: what its import draws shifts no weights
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, train_set.spec.input_shape, train_set.spec.num_classes, **cfg.model_options)
    if cfg.channels_last:  # 4-D weights in NHWC, as the batches will be (a no-op for other models)
        model.to(memory_format=torch.channels_last)
    blocks = model_blocks(model)
    sample = train_set.get(torch.arange(min(cfg.batch_size, len(train_set))))[0]
    stepper = PARALLELIZE[cfg.strategy](model, blocks, cfg, ctx, sample)
    # from here each worker draws its own random numbers (dropout's masks for its rows): with the
    # seed above on every worker, row j of every replica's share got the same mask
    torch.manual_seed(worker_seed(cfg.seed, ctx.rank))
    stepper.amp = amp_for(cfg, ctx.device, stepper.autocasts_itself, stepper.lockstep_scaler)
    if cfg.compile:  # after wrapping, per stage for pipelines; the first steps pay for the compilation
        stepper.compile()
    # on a GPU the data moves there once (or is prefetched): data.feed
    train_feed = Feed(train_set, ctx.device, cfg.channels_last)
    test_feed = Feed(test_set, ctx.device, cfg.channels_last) if test_set is not None else None
    part = getattr(stepper, "partition", None)
    result = RunResult(cfg.to_dict(), ctx.world_size, ctx.backend, threads, count_parameters(model),
                       steps_per_epoch=steps_per_epoch)
    if part is not None:
        result.partition, result.split_points = describe(part, stepper.cut_blocks), part.split_points

    # --- resume: position, weights, optimizer state and RNG, as they were
    meta = checkpoint.run_meta(cfg, part.split_points if part is not None else None)
    start_epoch, start_step, done = 0, 0, 0
    if cfg.resume:  # the launcher has checked the set against this run (checkpoint.resume_config)
        pos = checkpoint.load(cfg.resume, stepper, ctx.rank, cfg)
        start_epoch, start_step, done = pos["epoch"], pos["step"], pos["global_step"]
        stepper.resumed_at(done)
        result.step_losses = list(pos["step_losses"])
        result.epochs = [EpochResult(**e) for e in pos["epochs"]]
        if done >= total_steps and ctx.rank == 0:  # the summary below is the checkpoint's, not a new run's
            print(f"note: the checkpoint is at step {done}, which this run ends at or before ({total_steps} steps): "
                  "nothing to train; raise --epochs or --steps to go on", file=sys.stderr)

    progress = StepProgress(show_progress, total_steps, done, label=f"{cfg.model}/{cfg.dataset} {cfg.strategy} x{ctx.world_size}")
    with progress:
        for epoch in range(start_epoch, cfg.epochs):
            if done >= total_steps:
                break
            order = train_feed.indices(epoch_order(len(train_set), cfg.seed, epoch))
            first = start_step if epoch == start_epoch else 0
            last = min(steps_per_epoch, first + total_steps - done)
            epoch_start = time.perf_counter()
            local_losses = run_steps(stepper, train_feed, order, range(first, last), cfg.batch_size, result, progress)
            if cfg.min_seconds and done + last - first >= total_steps:  # a benchmark's window (--min-seconds)
                if more := min(steps_per_epoch - last, steps_to_fill(result.step_seconds, cfg.min_seconds, ctx)):
                    progress.extend(more)
                    local_losses += run_steps(stepper, train_feed, order, range(last, last + more), cfg.batch_size, result, progress)
                    last, total_steps = last + more, total_steps + more
            done += last - first
            finished = last == steps_per_epoch
            if finished:
                stepper.end_epoch()
            # every epoch's end, and the run's end mid-epoch: what is evaluated, checkpointed and
            # saved below is one model, whether or not this run evaluates or checkpoints
            stepper.sync_replicas()
            seconds = time.perf_counter() - epoch_start

            # --- once an epoch: reduce the losses, evaluate, checkpoint
            losses = world_mean_losses(stepper, local_losses, ctx.device).tolist()
            check_finite(losses, done - len(losses), cfg.lr, cfg.precision)  # every rank holds the same losses: all stop, or none
            result.step_losses += losses
            ep = EpochResult(epoch + 1, len(losses), statistics.fmean(losses), seconds, len(losses) * cfg.batch_size / seconds)
            if result.epochs and result.epochs[-1].epoch == ep.epoch:  # the rest of an epoch the checkpoint began
                before = result.epochs.pop()
                steps, seconds = before.steps + ep.steps, before.seconds + ep.seconds
                ep = EpochResult(ep.epoch, steps, statistics.fmean(result.step_losses[-steps:]), seconds,
                                 steps * cfg.batch_size / seconds)
            if test_feed is not None and (finished or done >= total_steps):
                ep.test_loss, ep.test_accuracy = evaluate(stepper, test_feed, cfg.batch_size, ctx.device)
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


def check_finite(losses: list[float], before: int, lr: float, precision: str = "fp32") -> None:
    """Stop a run whose loss is no longer a number at the epoch's end (``before`` steps ran
    before these): its weights are NaN or infinite, so more steps, an evaluation, a checkpoint
    or a saved model would all be of nothing. A loss that was infinite for a step and then
    recovered (fp16's gradient scaler skips such a step) is not stopped."""
    if not losses or math.isfinite(losses[-1]):
        return
    since = 1 + max((i for i, v in enumerate(losses) if math.isfinite(v)), default=-1)
    hint = " or train in fp32 (--precision fp32)" if precision != "fp32" else ""
    raise Diverged(f"the training diverged: the loss is {losses[-1]} from step {before + since + 1} on, so the weights "
                   f"are no longer numbers; lower --lr (now {lr:g}){hint}")


def steady_steps(seconds: list[float]) -> list[float]:
    """A run's step times without its warm-up steps (the first five, or a quarter of a short run)."""
    return seconds[min(5, len(seconds) // 4):]


def steps_to_fill(seconds: list[float], min_seconds: float, ctx: DistContext) -> int:
    """Steps still to take for the ``steady_steps`` to last ``min_seconds`` at their median:
    rank 0 counts by its own clock, one 1-element allreduce tells every rank (once a run)."""
    steady, more = steady_steps(seconds), 0
    if ctx.rank == 0 and steady:
        more = max(0, math.ceil(min_seconds / max(statistics.median(steady), 1e-9)) - len(steady))
    return int(all_reduce_sum(torch.tensor([more], dtype=torch.float64), ctx.device).item())


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


def run_steps(stepper: Stepper, feed: Feed, order: torch.Tensor, steps: range, batch: int, result: RunResult,
              progress: StepProgress) -> list[torch.Tensor | None]:
    """The hot loop: load this worker's rows of each global batch, take one step.

    Returns this worker's detached per-step losses (on the device); appends each step's
    wall time (loading included) to ``result.step_seconds``, read once at the end.
    """
    losses = []
    events = stepper.events  # spans cost a method call each when events are off
    clock = StepClock(feed.device)
    rows = (order[step * batch : (step + 1) * batch][stepper.rows] for step in steps)
    batches = feed.batches(rows) if stepper.loads_data else None
    for step in steps:
        clock.start()
        with events.span("step", step=step):
            with events.span("data", step=step):
                x, y = next(batches) if batches is not None else (None, None)
            loss = stepper.train_step(x, y)
            # kept until the epoch ends: a copy of the 4-byte loss, not the step's own tensor,
            # which held on to about 8 MB a step of a token model on CPU (gpt-like, batch 128:
            # peak RSS 374 -> 975 MiB over 80 steps; with the copy 388 -> 407). No host sync.
            losses.append(loss.clone() if loss is not None else None)
        clock.stop()
        progress.advance(losses[-1], batch)
    result.step_seconds += clock.read()
    return losses


class StepClock:
    """Every step's wall time: ``perf_counter`` on a CPU; on a GPU a CUDA event pair per step,
    read once in ``read`` (one sync an epoch; see the module's docstring)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.marks.append(self._mark())

    def stop(self) -> None:
        self.marks.append(self._mark())

    def read(self) -> list[float]:
        pairs = zip(self.marks[::2], self.marks[1::2], strict=True)
        if not self.cuda:
            return [end - begin for begin, end in pairs]
        if self.marks:
            self.marks[-1].synchronize()
        return [begin.elapsed_time(end) / 1000 for begin, end in pairs]  # elapsed_time is in ms


@torch.no_grad()
def evaluate(stepper: Stepper, feed: Feed, batch_size: int, device: torch.device) -> tuple[float, float]:
    """Test loss and accuracy over the whole test split, every worker scoring its rows.

    Batches keep the training shape (pipelines need it); the last one is padded with
    sample 0 and the padding is weighted out of the sums. The sums stay on the device
    until the end: one host read per evaluation, not one per batch.
    """
    n = len(feed)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # summed loss, correct, count
    for start in range(0, n, batch_size):
        idx = torch.arange(start, start + batch_size, device=feed.dataset.device)
        valid = idx < n
        idx = torch.where(valid, idx, 0)
        idx, valid = idx[stepper.rows], valid[stepper.rows]
        x, y = feed.get(idx) if stepper.loads_data else (None, None)
        logits = stepper.eval_logits(x, y)
        if logits is not None:  # per sample, or per token for token logits [n, T, V]
            per = loss_fn(logits.float(), y, reduction="none").view(len(y), -1).double()
            right = (logits.argmax(-1) == y).view(len(y), -1).double()
            weight = valid.to(per.device, torch.float64)[:, None]
            totals += torch.stack([(per * weight).sum(), (right * weight).sum(), weight.sum() * per.shape[1]]).to(device)
    loss, correct, count = all_reduce_sum(totals, device).tolist()
    return loss / count, correct / count


def peak_memory_bytes(device: torch.device) -> int:
    """Allocator peak on a GPU; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
