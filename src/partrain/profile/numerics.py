"""The device and numerics a profile is taken with: the ones the run will train with.

``--precision bf16`` trains under ``torch.autocast`` (fp16 too, with a gradient scaler), so
its blocks run bf16 kernels and keep bf16 activations: a profile at fp32 would be off by the
tensor cores' factor on a GPU. ``--channels-last`` changes which convolution kernels run. A
profile therefore times the blocks under the same autocast and memory format, on the device
the run will use, and records all of it (``ModelProfile.device``, ``precision``, ...) so
that the cache never hands a bf16 profile to an fp32 prediction, nor a CPU one to a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from partrain.errors import PartrainError
from partrain.strategies.precision import DTYPES, autocast_at

DEVICES = ("cpu", "cuda")


def resolve_device(device: str | None) -> torch.device:
    """The device to profile on: ``device`` ("cpu" or "cuda"), else the GPU when there is one,
    as ``partrain train`` picks it (the nccl backend, hence the GPU, whenever CUDA is there)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in DEVICES:
        raise PartrainError(f"unknown --device {device!r}: choose cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise PartrainError("--device cuda, but torch sees no GPU here: profile with --device cpu, or on the GPU machine")
    return torch.device(device)


def device_name(device: torch.device) -> str:
    """What a profile and a results-store cell record as the device: "cpu", or the GPU's name."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def autocast(device: torch.device, precision: str):
    """The forward pass's context at ``precision``: nothing for fp32, else autocast to bf16/fp16."""
    if precision not in DTYPES:
        raise PartrainError(f"unknown --precision {precision!r}: choose {' or '.join(DTYPES)}")
    return autocast_at(precision, device)  # the one the run's strategies use


def place(module: nn.Module, device: torch.device, channels_last: bool) -> nn.Module:
    """``module`` on ``device``, its 4-D weights channels-last when asked (as the run places it)."""
    module = module.to(device)
    return module.to(memory_format=torch.channels_last) if channels_last else module


def place_input(x: torch.Tensor, device: torch.device, channels_last: bool) -> torch.Tensor:
    x = x.to(device, non_blocking=True)
    return x.contiguous(memory_format=torch.channels_last) if channels_last and x.dim() == 4 else x
