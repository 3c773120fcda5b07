"""``fsdp``: fully sharded data parallel (ZeRO-3) on ``torch.distributed.fsdp.fully_shard``.

Each block is its own FSDP unit, so only one block's full parameters exist at a time:
forward all-gathers a block's shards just before it runs and frees them after; backward
all-gathers again and reduce-scatters the gradients. Parameters, gradients and optimizer
state are each 1/dp per worker (Rajbhandari et al., "ZeRO", SC 2020), at about 1.5x the
communication volume of DDP.

``--precision bf16|fp16`` uses FSDP's ``MixedPrecisionPolicy`` rather than autocast:
parameters are all-gathered in the low precision (half the bytes) and gradients
reduce-scattered in float32; BatchNorm's parameters stay float32, as under autocast.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from partrain.config import RunConfig
from partrain.distributed.context import DistContext
from partrain.errors import PartrainError
from partrain.spec import scalar_refusal
from partrain.strategies.base import Stepper, make_optimizer, shard_rows
from partrain.strategies.precision import fsdp_policy, shard_norms_in_float32


def check_shardable(model: nn.Module, name: str, strategy: str) -> None:
    """Refuse, before any worker starts, a model ``fully_shard`` cannot take: it shards every
    parameter along its first dimension, and a scalar has none (a worker's ValueError, before)."""
    if (scalar := scalar_parameter(model)) is not None:
        raise PartrainError(scalar_refusal(name, scalar, strategy))


def scalar_parameter(model: nn.Module) -> str | None:
    """The name of ``model``'s first 0-dimensional parameter (None when it has none)."""
    return next((qualname for qualname, p in model.named_parameters() if p.dim() == 0), None)


def parallelize_fsdp(model: nn.Module, blocks: list[nn.Module], cfg: RunConfig, ctx: DistContext, sample) -> Stepper:
    check_shardable(model, cfg.model, cfg.strategy)  # preflight's check, for a caller without one (the profiler)
    # FSDP shards contiguous parameters only: with --channels-last the batches alone are NHWC
    # (cuDNN picks NHWC convolutions for NHWC inputs)
    model.to(ctx.device, memory_format=torch.contiguous_format)
    dp_mesh = ctx.mesh["dp"]
    policy = fsdp_policy(cfg)  # bf16/fp16: FSDP casts parameters and inputs itself, reduces in float32
    precision = {"mp_policy": policy} if policy is not None else {}
    shard_norms_in_float32(model, dp_mesh, policy)
    for block in blocks:
        # a block sharing a parameter with another (tied embedding and head) stays in the root
        # unit: a parameter belongs to exactly one FSDP unit
        if isinstance(block, FSDPModule):  # a BatchNorm that is a block of its own: already a unit
            continue
        if block is not model and any(p.requires_grad for p in block.parameters()) and not _shares(block, blocks):
            fully_shard(block, mesh=dp_mesh, **precision)
    fully_shard(model, mesh=dp_mesh, **precision)
    rows = shard_rows(cfg.batch_size, ctx.dims.dp, ctx.dp_rank)
    stepper = Stepper(model, make_optimizer(model.parameters(), cfg), rows, ctx.events)
    stepper.autocasts_itself = policy is not None
    # fully_shard never communicates buffers: the replicas' are averaged before evaluation (Stepper.sync_replicas)
    stepper.replica_group = ctx.group("dp") if ctx.dims.dp > 1 else None
    return stepper


def _shares(block: nn.Module, blocks: list[nn.Module]) -> bool:
    mine = {id(p) for p in block.parameters()}
    return any(mine & {id(p) for p in other.parameters()} for other in blocks if other is not block)
