"""``local-sgd``: independent replicas whose parameters are averaged every K steps.

The student reports' master/worker weight averaging (and Stich, "Local SGD Converges Fast
and Communicates Little", ICLR 2019). Each worker steps its own copy on its shard of the
global batch; ``PeriodicModelAverager`` allreduces the parameters every K steps, or the
epoch hook averages once an epoch. With K = 1 and plain SGD (no momentum), averaging the
replicas after each step equals the serial step on the global batch.
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
from partrain.strategies.base import Stepper, make_optimizer, shard_rows


class LocalSGDStepper(Stepper):
    def __init__(self, module, optimizer, rows, events, group, every: int | str):
        super().__init__(module, optimizer, rows, events)
        self.group = group
        self.per_epoch = every == "epoch"
        self.averager = None
        if not self.per_epoch:
            with warnings.catch_warnings():  # "with period 1 use DDP": K=1 is the check against serial
                warnings.filterwarnings("ignore", message="When period is 1", category=UserWarning)
                self.averager = PeriodicModelAverager(period=every, warmup_steps=0, process_group=group)

    def after_step(self) -> None:
        if self.averager is not None:
            with self.events.span("average", step=self.steps):
                self.averager.average_parameters(self.module.parameters())

    def end_epoch(self) -> None:
        if self.per_epoch:
            with self.events.span("average", step=self.steps):
                averaging.average_parameters(iter(self.module.parameters()), self.group)


def parallelize_local_sgd(model: nn.Module, blocks: list[nn.Module], cfg: RunConfig, ctx: DistContext, sample) -> Stepper:
    model.to(ctx.device)
    group = ctx.group("dp")
    with torch.no_grad():  # every replica starts from rank 0's weights
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    rows = shard_rows(cfg.batch_size, ctx.dims.dp, ctx.dp_rank)
    return LocalSGDStepper(model, make_optimizer(model.parameters(), cfg), rows, ctx.events, group, cfg.average_every)
