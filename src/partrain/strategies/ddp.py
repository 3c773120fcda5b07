"""``ddp``: synchronous data parallel on ``DistributedDataParallel``.

DDP packs gradients into buckets of ``--bucket-mb`` and allreduces each bucket as soon as
backward has filled it, overlapping communication with the rest of backward (Horovod's
tensor fusion; Li et al., "PyTorch Distributed", VLDB 2020). Gradients are averaged over
the replicas, so with the same global batch a step equals the serial step.
"""

from __future__ import annotations

import time

import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from partrain.config import RunConfig
from partrain.distributed.context import DistContext
from partrain.events import EventLog
from partrain.models.check import unused_parameters
from partrain.strategies.base import Stepper, make_optimizer, shard_rows


def traced_allreduce_hook(events: EventLog):
    """A DDP comm hook: the default bucket allreduce, with its span recorded.

    Registered only when events are on; the span runs from launch to completion of the
    async allreduce, so it shows how much of it backward hid.
    """

    # no annotations: DDP checks them, and under `from __future__ import annotations` they are strings
    def hook(group, bucket):
        start = time.perf_counter()
        nbytes = bucket.buffer().numel() * bucket.buffer().element_size()

        def done(fut):
            events.record("allreduce", start, time.perf_counter(), bucket=bucket.index(), bytes=nbytes)
            return fut.value()[0] if isinstance(fut.value(), list) else fut.value()

        return default_hooks.allreduce_hook(group, bucket).then(done)

    return hook


def parallelize_ddp(model: nn.Module, blocks: list[nn.Module], cfg: RunConfig, ctx: DistContext, sample) -> Stepper:
    # DDP waits for every parameter's gradient before it ends a step's allreduce; one the forward
    # never uses would keep it waiting, so DDP is told to look for them, at the price of a walk
    # over the autograd graph every step, only where there are some
    unused = unused_parameters(model, sample)
    model.to(ctx.device)
    dp_group = ctx.group("dp")
    ddp = DistributedDataParallel(
        model,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        process_group=dp_group,
        bucket_cap_mb=cfg.bucket_mb,
        find_unused_parameters=bool(unused),
    )
    if ctx.events.enabled:
        ddp.register_comm_hook(dp_group, traced_allreduce_hook(ctx.events))
    rows = shard_rows(cfg.batch_size, ctx.dims.dp, ctx.dp_rank)
    stepper = Stepper(ddp, make_optimizer(ddp.parameters(), cfg), rows, ctx.events)
    stepper.lockstep_scaler = False  # fp16: the allreduced gradients are the same everywhere, so is the verdict
    return stepper
