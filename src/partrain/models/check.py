"""A model checked against its dataset before any worker starts, at no compute cost.

``checked_model`` builds the model on PyTorch's ``meta`` device (shapes without storage or
arithmetic: a ResNet-152 costs no memory and a few milliseconds) and runs one forward pass
of a two-sample batch. An output that is not one row of ``num_classes`` scores per sample,
or a block that cannot take what the one before it returns, is one line naming the block,
the shapes and the fix, instead of a traceback from inside a worker. A model whose forward
the meta device cannot run (data-dependent control flow, ``.item()``) is not judged here:
its own errors still surface from the worker as they happen.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from partrain.errors import PartrainError
from partrain.models.registry import build_model, model_blocks


def _shape(value) -> str:
    if isinstance(value, torch.Tensor):
        return str(tuple(value.shape))
    if isinstance(value, tuple | list):
        return "(" + ", ".join(_shape(v) for v in value) + ")"
    return type(value).__name__


def _meta_only(err: Exception) -> bool:
    """An error of the meta device itself, not of the model's shapes."""
    return isinstance(err, NotImplementedError) or "meta" in str(err).lower()


def checked_model(name: str, input_shape: tuple[int, ...], num_classes: int, options: dict,
                  input_dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model built on the meta device (or, if its factory cannot build there, on the CPU),
    its forward pass checked; returns that model."""
    try:
        with torch.device("meta"):
            model = build_model(name, input_shape, num_classes, **options)
    except PartrainError as err:
        if err.__cause__ is None or not _meta_only(err.__cause__):
            raise
        model = build_model(name, input_shape, num_classes, **options)  # a real build: two samples' forward
    if not any(p.requires_grad for p in model.parameters()):
        raise PartrainError(f"model {name!r} has no trainable parameters (none that requires grad): "
                            "there is nothing to train or to parallelize")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    x = torch.zeros((2, *input_shape), dtype=input_dtype, device=device)
    model.eval()  # BatchNorm and dropout need no batch statistics for shapes
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as err:  # noqa: BLE001 - located below, block by block
        if _meta_only(err):
            return model
        raise _failing_block(name, model, x, err) from err
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[0] != 2 or out.shape[-1] != num_classes:
        raise PartrainError(
            f"model {name!r} returns {_shape(out)} for a batch of 2 inputs of shape {tuple(input_shape)}, "
            f"but the dataset has {num_classes} classes: its output must be (batch, ..., {num_classes})"
        )
    return model


def _failing_block(name: str, model: nn.Module, x: torch.Tensor, err: Exception) -> PartrainError:
    blocks, value = model_blocks(model), x
    for i, block in enumerate(blocks):
        try:
            with torch.no_grad():
                value = block(value)  # as nn.Sequential chains them: a tuple is one argument
        except Exception as block_err:  # noqa: BLE001 - the user's forward, reported
            reason = str(block_err).splitlines()[0] if str(block_err) else type(block_err).__name__
            return PartrainError(
                f"model {name!r}: block {i} ({type(block).__name__}) failed on input {_shape(value)}: {reason} "
                "(--debug shows the traceback)"
            )
    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    return PartrainError(f"model {name!r}: its forward pass failed on input {_shape(x)}: {reason}")
