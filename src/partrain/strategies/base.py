"""What the one training loop steps, whatever the strategy.

A strategy turns a plain model into a ``Stepper``. The loop asks it three things: which
rows of each global batch this worker loads (``rows``; ``loads_data`` is False for the
middle stages of a pipeline), to take one optimizer step on them (``train_step``), and to
score a batch of test rows (``eval_logits``). Losses and accuracy counts are reduced over
the whole world once an epoch, not once a step, so reporting adds no synchronization to
the hot path.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from partrain.config import RunConfig
from partrain.events import EventLog
from partrain.strategies.precision import Amp


def make_optimizer(params, cfg: RunConfig) -> torch.optim.Optimizer:
    # a pipeline worker whose blocks hold no parameters (a fixed projection, a reshape) steps
    # an empty group: torch refuses an optimizer over nothing, not one over an empty group
    params = list(params) or [{"params": []}]
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def compile_forward(module: nn.Module) -> None:
    """``torch.compile`` ``module``'s forward in place: the one graph ``torch.compile(module)``
    makes, without its wrapper (whose ``_orig_mod.`` would rename every state_dict key).

    Not ``module.compile()``: that compiles ``Module.__call__``, whose frame Dynamo skips, as it
    skips ``nn.Sequential.forward`` (torch's own code), so it compiled only the submodules whose
    forward is the user's, each a graph of its own: nothing at all for a Sequential of torch
    layers, and ResNet's residual blocks, one code object at four widths, recompiled per width
    until Dynamo made their shapes dynamic (resnet50 b128 bf16 channels-last on an H200: 35.9 ms
    a step, against 25.7 ms for ``torch.compile(model)``). Hooks on ``module`` run outside the graph.
    The compiled function is bound as a method, so a deep copy of ``module`` runs its own weights.
    """
    forward = module.forward
    if isinstance(forward, types.MethodType) and forward.__self__ is module:
        module.forward = types.MethodType(torch.compile(forward.__func__), module)
    else:  # a forward set on the instance: compiled as it is
        module.forward = torch.compile(forward)


def loss_fn(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over the batch (pipelines apply it per micro-batch and rescale).

    Class logits ``[n, C]`` against ``[n]``; token logits ``[n, T, V]`` against ``[n, T]``
    score every token (the mean is over all ``n * T`` of them, so equal micro-batches still
    average to the batch's loss).
    """
    if logits.dim() > 2:
        logits, target = logits.flatten(0, -2), target.flatten()
    return F.cross_entropy(logits, target, reduction=reduction)


def shard_rows(global_batch: int, parts: int, index: int) -> slice:
    """The contiguous rows of a global batch that replica ``index`` of ``parts`` takes."""
    per = global_batch // parts
    return slice(index * per, (index + 1) * per)


class Stepper:
    """One worker's share of a training step. Subclasses override ``_forward_backward``."""

    has_loss = True  # does this worker compute the loss (False for non-last pipeline stages)
    loads_data = True  # does this worker need the batch (False for middle pipeline stages)
    autocasts_itself = False  # FSDP's precision policy or pipeline stages cast; the stepper does not
    lockstep_scaler = True  # fp16: workers hold different gradients, so they skip overflowed steps together
    replica_group = None  # data-parallel group whose buffers no wrapper keeps equal (fsdp, hybrid dp > 1)

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, rows: slice, events: EventLog):
        self.module = module  # the (possibly wrapped) module this worker runs
        self.optimizer = optimizer
        self.rows = rows
        self.events = events
        self.steps = 0
        self.amp = Amp()  # fp32; the loop sets the run's precision (precision.amp_for)

    def train_step(self, x: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor | None:
        """One optimizer step; returns this worker's detached loss (None without one).

        Nothing here reads a tensor on the host: on a GPU the step is only queued, and the
        loss stays on the device until the epoch's reduction (fp16's scaler excepted).
        """
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._forward_backward(x, y)
        with self.events.span("optimizer", step=self.steps):
            self.amp.step(self.optimizer)
        self.after_step()
        self.steps += 1
        return loss

    def _forward_backward(self, x, y) -> torch.Tensor | None:
        with self.events.span("forward", step=self.steps):
            with self.amp.autocast():
                out = self.module(x)
            loss = loss_fn(out.float(), y)  # the loss in float32 whatever the forward ran in
        with self.events.span("backward", step=self.steps):
            self.amp.scale(loss).backward()
        return loss.detach()

    def compile(self) -> None:
        """``torch.compile`` the model this worker runs, in place (state_dict keys unchanged):
        after wrapping; inside DDP, whose forward stays eager around it (Dynamo's DDPOptimizer
        still splits the graph at DDP's bucket boundaries, the compiled forward running inside DDP's)."""
        compile_forward(self.module.module if isinstance(self.module, DistributedDataParallel) else self.module)

    def after_step(self) -> None:
        """Hook after each optimizer step (local SGD averages parameters here)."""

    def end_epoch(self) -> None:
        """Hook at the end of each epoch (local SGD may average here)."""

    def sync_replicas(self) -> None:
        """Hook at every epoch's end and at a run's end mid-epoch, before the model is evaluated,
        checkpointed or saved: make the data-parallel replicas one model (local SGD averages its
        replicas here when the last step did not).

        Here: average the floating-point buffers over ``replica_group`` where one is set.
        ``fully_shard`` keeps parameters equal but never communicates buffers, so each replica's
        BatchNorm running statistics saw only its own rows. Their mean is the statistic over
        every replica's rows (the running mean is the one serial would hold for the same
        inputs), where rank 0's, as DDP broadcasts it, would drop the others' rows. Costs one
        allreduce of the buffers (kilobytes for BatchNorm's per-channel vectors) an epoch,
        nothing per step; training's losses are unchanged (BatchNorm normalises a training
        batch by its own statistics, and only evaluation reads the running ones).
        """
        if self.replica_group is not None:
            average_buffers(self.module, self.replica_group)

    def resumed_at(self, global_step: int) -> None:
        """Hook once a checkpoint's state is loaded, before the resumed run's first step
        (``global_step`` steps are behind it)."""

    def eval_logits(self, x, y) -> torch.Tensor | None:
        """Logits of this worker's rows in eval mode; None where no logits live (early pipeline stages)."""
        self.module.eval()
        try:
            with self.amp.autocast():
                return self._eval_forward(x, y)
        finally:
            self.module.train()

    def _eval_forward(self, x, y):
        return self.module(x)

    def state_modules(self) -> nn.Module:
        """The module whose state a checkpoint holds on this worker."""
        return self.module


@torch.no_grad()
def average_buffers(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Average ``module``'s floating-point buffers over ``group``: one allreduce per dtype.

    Integer buffers (BatchNorm's ``num_batches_tracked``) are left alone: every replica
    counts the same forwards, so they are equal already.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buf in module.buffers():
        if buf.is_floating_point():
            by_dtype.setdefault(buf.dtype, []).append(buf)
    size = dist.get_world_size(group)
    for bufs in by_dtype.values():
        flat = torch.cat([b.reshape(-1) for b in bufs])
        dist.all_reduce(flat, group=group)
        flat /= size
        for buf, mean in zip(bufs, flat.split([b.numel() for b in bufs]), strict=True):
            buf.copy_(mean.view_as(buf))


def all_reduce_sum(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum a small CPU tensor over the whole world (identity in a world of one)."""
    if not dist.is_initialized():
        return t
    moved = t.to(device)
    dist.all_reduce(moved)
    return moved.cpu()


def world_mean_losses(stepper: Stepper, local: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """Per-step loss averaged over the workers that computed one (one allreduce)."""
    n = len(local)
    buf = torch.zeros(n + 1, dtype=torch.float64)
    if stepper.has_loss:
        buf[:n] = torch.stack(local).double().cpu() if n else buf[:n]  # one copy (one sync), not one per step
        buf[n] = 1.0
    buf = all_reduce_sum(buf, device)
    return buf[:n] / buf[n]


def gather_model_state(model: nn.Module, stepper: Stepper, dp_rank: int) -> dict[str, torch.Tensor] | None:
    """The whole trained model's state_dict on rank 0 (None elsewhere), whatever the strategy.

    Stages, wrappers and shards hold the very parameter objects of ``model``, so each
    worker contributes the entries whose tensors it trains: a pipeline stage its blocks, a
    sharded model its full tensors (``full_tensor`` all-gathers), a replica everything.
    Replicas other than dp rank 0 add nothing, being copies.
    """
    mine = {id(t) for t in stepper.state_modules().state_dict(keep_vars=True).values()}
    mine |= {id(p) for p in stepper.state_modules().parameters()}
    local = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in mine:
            full = t.full_tensor() if isinstance(t, DTensor) else t  # collective for shards
            if dp_rank == 0:
                local[name] = full.detach().cpu().clone()
    if not dist.is_initialized():
        return local
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if parts is not None else None
