"""``hogwild``: workers on one node update one shared set of weights without locks.

Recht et al., "Hogwild!", NIPS 2011, and the student reports' OpenMP variant. Rank 0
writes the initial parameters into a shared-memory file (``torch.from_file(...,
shared=True)``, the same mechanism ``torch.multiprocessing`` uses for shared tensors) and
every worker maps it and points its parameters at it. Each worker then runs plain SGD on
its own shard of every global batch; ``optimizer.step()`` writes straight into the shared
weights, racing the others by design. Gradients and momentum stay private. The process
group is used only for the once-an-epoch loss and accuracy reduction, never for weights.
"""

from __future__ import annotations

import os
import uuid

import torch
import torch.distributed as dist
import torch.nn as nn

from partrain.config import RunConfig
from partrain.distributed.context import DistContext
from partrain.errors import PartrainError
from partrain.strategies.base import Stepper, make_optimizer, shard_rows


def _shared_tensors(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]


def share_weights(model: nn.Module, ctx: DistContext) -> None:
    """Make every worker's parameters views of one shared-memory buffer."""
    tensors = _shared_tensors(model)
    total = sum(t.numel() for t in tensors)
    name = [f"/dev/shm/partrain-hogwild-{uuid.uuid4().hex}" if ctx.rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    path = name[0]
    if ctx.rank == 0:
        flat = torch.from_file(path, shared=True, size=total, dtype=torch.float32)
        flat.copy_(torch.cat([t.detach().reshape(-1).float() for t in tensors]))
    dist.barrier()
    if ctx.rank != 0:
        flat = torch.from_file(path, shared=True, size=total, dtype=torch.float32)
    dist.barrier()  # everyone has mapped it: the name can go, the mapping stays
    if ctx.rank == 0:
        os.unlink(path)
    offset = 0
    for t in tensors:
        t.data = flat[offset : offset + t.numel()].view_as(t)
        offset += t.numel()


class HogwildStepper(Stepper):
    def resumed_at(self, global_step: int) -> None:
        # every rank's checkpoint.load copies the set's weights into the one shared copy: a rank
        # that stepped before a slower rank's copy had its updates overwritten by the checkpoint.
        # One barrier, once a resume
        if dist.is_initialized():
            dist.barrier()


def parallelize_hogwild(model: nn.Module, blocks: list[nn.Module], cfg: RunConfig, ctx: DistContext, sample) -> Stepper:
    if ctx.device.type != "cpu":
        raise PartrainError("hogwild shares weights in host memory: run it with --backend gloo")
    if ctx.info.local_world_size != ctx.world_size:
        raise PartrainError("hogwild shares memory, so all its workers must be on one node (got a multi-node launch)")
    if any(not p.is_floating_point() or p.dtype != torch.float32 for p in model.parameters()):
        raise PartrainError("hogwild shares float32 weights; this model has parameters of another dtype")
    if ctx.world_size > 1:
        share_weights(model, ctx)
    rows = shard_rows(cfg.batch_size, ctx.world_size, ctx.rank)
    return HogwildStepper(model, make_optimizer(model.parameters(), cfg), rows, ctx.events)
