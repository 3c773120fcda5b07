"""``serial``: one worker, plain PyTorch; the baseline every speedup is measured against."""

from __future__ import annotations

import torch.nn as nn

from partrain.config import RunConfig
from partrain.distributed.context import DistContext
from partrain.strategies.base import Stepper, make_optimizer


def parallelize_serial(model: nn.Module, blocks: list[nn.Module], cfg: RunConfig, ctx: DistContext, sample) -> Stepper:
    model.to(ctx.device)
    return Stepper(model, make_optimizer(model.parameters(), cfg), slice(0, cfg.batch_size), ctx.events)
