"""``--precision``: what every strategy shares of mixed precision, in one place.

Weights, gradients and optimizer state stay float32 in every precision (the "master
weights" of Micikevicius et al., "Mixed Precision Training", ICLR 2018); only the
forward's arithmetic runs in bf16 or fp16:

- ``serial``, ``ddp``, ``local-sgd``, ``hogwild``: ``torch.amp.autocast`` around the
  forward (``Amp.autocast``); the loss is computed from float32 logits.
- ``fsdp`` and the replicas of ``hybrid``: FSDP's own ``MixedPrecisionPolicy``
  (``fsdp_policy``): parameters all-gathered in the low precision, gradients
  reduce-scattered in float32, no autocast.
- pipelines: autocast inside each stage's forward (``pipeline.SpanStage``; a hybrid
  stage has FSDP's policy instead); activations cross stages in the low precision (half
  the bytes); the loss is computed outside the stages, in float32.

fp16 has 5 exponent bits, so small gradients underflow: fp16 scales the loss by a
``torch.amp.GradScaler`` and skips a step whose gradients overflowed. Where workers hold
different gradients (shards, stages, independent replicas) they must skip together, so
the scaler is ``ShardedGradScaler``, which sums "found inf" over the world (one 4-byte
allreduce a step). A scaler reads that flag on the host once a step (``scaler.step``),
as it does in any PyTorch loop; bf16 (float32's exponent range) needs no scaler and no sync.

CPU autocast runs bf16 well (oneDNN); fp16 on CPU is refused: most CPUs have no fp16
arithmetic and ``GradScaler`` on CPU is a late addition, so ``bf16`` is the CPU choice.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from partrain.config import RunConfig
from partrain.errors import PartrainError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NULL = contextlib.nullcontext()


def no_autocast():
    """fp32, or a strategy that casts by itself: the shared no-op context."""
    return _NULL


def check_precision(precision: str, device_type: str) -> None:
    """Refuse a precision this device cannot run (one line, with the fix)."""
    if precision == "fp16" and device_type != "cuda":
        raise PartrainError("--precision fp16 needs a CUDA device; use bf16 on CPU")


def autocast_at(precision: str, device: torch.device):
    """The autocast context of ``precision`` on ``device`` (a shared no-op for fp32); the
    profiler times blocks under the same one (``profile.numerics``)."""
    if precision == "fp32":
        return _NULL
    return torch.amp.autocast(device_type=device.type, dtype=DTYPES[precision])


def autocast_for(cfg: RunConfig, device: torch.device):
    """The autocast context of ``cfg``'s precision on ``device``."""
    return autocast_at(cfg.precision, device)


def low_dtype(cfg: RunConfig) -> torch.dtype | None:
    """The forward's low precision (None for fp32)."""
    return None if cfg.precision == "fp32" else DTYPES[cfg.precision]


def fsdp_policy(cfg: RunConfig):
    """FSDP2's mixed precision for ``cfg`` (None for fp32): low-precision compute, float32 reductions."""
    if cfg.precision == "fp32":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy  # torch >= 2.6 exports it here (2.11 and 2.13 do)

    return MixedPrecisionPolicy(param_dtype=DTYPES[cfg.precision], reduce_dtype=torch.float32)


def shard_norms_in_float32(module: nn.Module, mesh, policy, **kwargs) -> None:
    """Under a low-precision FSDP ``policy``, every BatchNorm in ``module`` its own FSDP unit
    whose parameters stay float32 (FSDP1's mixed precision did the same for BatchNorm), before
    its block is sharded with ``policy``. CUDA's batch norm takes a bf16 input with float32
    weights and running statistics (autocast's mix), but refuses bf16 weights with float32
    statistics ("Expected running_mean to have type BFloat16 but got Float"; the CPU's too).
    The input stays as it comes (``cast_forward_inputs=False``), and so does the output. Each
    such unit gathers its few parameters itself, and is a graph break under ``--compile``."""
    if policy is None:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    keep = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for norm in batchnorms(module):
        if norm.affine:  # frozen ones too: FSDP casts every parameter
            fully_shard(norm, mesh=mesh, mp_policy=keep, **kwargs)


def batchnorms(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def make_scaler(cfg: RunConfig, device: torch.device, lockstep: bool):
    """A gradient scaler for fp16 (None otherwise); ``lockstep``: every worker skips a step together."""
    if cfg.precision != "fp16":
        return None
    check_precision(cfg.precision, device.type)
    if lockstep and dist.is_initialized() and dist.get_world_size() > 1:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device.type, process_group=dist.group.WORLD)
    else:
        scaler = torch.amp.GradScaler(device.type)
    # the scale lives on the device from the start: a pipeline stage without the loss never
    # calls scale() itself, yet unscales its gradients by the same factor in step()
    scaler.scale(torch.ones((), device=device))
    return scaler


class Amp:
    """What a ``Stepper`` needs of the precision: the forward's context, backward and the step."""

    def __init__(self, autocast=no_autocast, scaler=None):
        self.autocast = autocast  # called per use: a fresh context each forward
        self.scaler = scaler

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)  # unscales, skips the step if any gradient is inf/nan
        self.scaler.update()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def amp_for(cfg: RunConfig, device: torch.device, autocasts_itself: bool, lockstep: bool) -> Amp:
    """The ``Amp`` of a stepper: autocast unless the strategy casts by itself (FSDP policy,
    pipeline stages), a scaler for fp16 (``lockstep`` where workers hold different gradients)."""
    check_precision(cfg.precision, device.type)
    autocast = no_autocast if autocasts_itself else (lambda: autocast_for(cfg, device))
    return Amp(autocast, make_scaler(cfg, device, lockstep))
