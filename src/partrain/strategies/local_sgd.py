"""``local-sgd``: independent replicas whose parameters are averaged every K steps.

The student reports' master/worker weight averaging (and Stich, "Local SGD Converges Fast
and Communicates Little", ICLR 2019). Each worker steps its own copy on its shard of the
global batch; ``PeriodicModelAverager`` allreduces the parameters every K steps, or the
epoch hook averages once an epoch. With K = 1 and plain SGD (no momentum), averaging the
replicas after each step equals the serial step on the global batch.

An averaging averages the floating-point buffers too (BatchNorm's running statistics: each
replica's saw only its rows). Whatever K, the replicas are also averaged at every epoch's
end and at a run's end when the last step did not, so that evaluation, a checkpoint and a
saved model all hold one model, and a run's losses do not depend on whether it evaluates or
checkpoints. A resumed run counts K from the global step it resumes at, as the straight run did.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.model_averaging import utils as averaging
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from partrain.config import RunConfig
from partrain.distributed.context import DistContext
from partrain.strategies.base import Stepper, average_buffers, make_optimizer, shard_rows


class LocalSGDStepper(Stepper):
    def __init__(self, module, optimizer, rows, events, group, every: int | str):
        super().__init__(module, optimizer, rows, events)
        self.group = group
        self.per_epoch = every == "epoch"
        self.in_sync = True  # every replica starts from rank 0's weights
        self.averager = None
        if not self.per_epoch:
            with warnings.catch_warnings():  # "with period 1 use DDP": K=1 is the check against serial
                warnings.filterwarnings("ignore", message="When period is 1", category=UserWarning)
                self.averager = PeriodicModelAverager(period=every, warmup_steps=0, process_group=group)

    def after_step(self) -> None:
        self.in_sync = False
        if self.averager is not None:
            # the averager's own rule (warmup_steps=0): it averages when its count is a multiple of K
            due = self.averager.step % self.averager.period == 0
            with self.events.span("average", step=self.steps):
                self.averager.average_parameters(self.module.parameters())
                if due:  # a second, small allreduce on averaging steps only
                    average_buffers(self.module, self.group)
            self.in_sync = due

    def end_epoch(self) -> None:
        if self.per_epoch:
            self.average()

    def sync_replicas(self) -> None:
        if not self.in_sync:  # the model's allreduce, only where the last step did not average
            self.average()

    def resumed_at(self, global_step: int) -> None:
        # the averager counts its calls from 0: restarted there, a run resumed at step N averaged
        # after its steps N+1, N+1+K, ... where the straight run averages after steps 1, 1+K, ...
        # The checkpoint's replicas are one model (sync_replicas ran before it was written).
        if self.averager is not None:
            self.averager.step = global_step

    def average(self) -> None:
        """Average the replicas now: parameters and floating-point buffers."""
        with self.events.span("average", step=self.steps):
            averaging.average_parameters(iter(self.module.parameters()), self.group)
            average_buffers(self.module, self.group)
        self.in_sync = True


def parallelize_local_sgd(model: nn.Module, blocks: list[nn.Module], cfg: RunConfig, ctx: DistContext, sample) -> Stepper:
    model.to(ctx.device)
    group = ctx.group("dp")
    with torch.no_grad():  # every replica starts from rank 0's weights
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    rows = shard_rows(cfg.batch_size, ctx.dims.dp, ctx.dp_rank)
    return LocalSGDStepper(model, make_optimizer(model.parameters(), cfg), rows, ctx.events, group, cfg.average_every)
