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

from collections import Counter

import torch
import torch.nn as nn
from torch.func import functional_call

from partrain.errors import PartrainError
from partrain.models.registry import _BLOCKS_ATTR, build_model, model_blocks


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
    if getattr(model, _BLOCKS_ATTR, None) is not None:
        _check_blocks_are_the_forward(name, model, x)
    return model


def _check_blocks_are_the_forward(name: str, model: nn.Module, x: torch.Tensor) -> None:
    """The blocks a factory returned with its model are what pipelines train, one after the
    other: they must hold every trainable parameter and call the modules the model's own
    forward calls. Blocks that left out an activation trained a different network under
    gpipe than under ddp, without a word (issue 17)."""
    blocks = model_blocks(model)
    owned = {id(p) for b in blocks for p in b.parameters()}
    unused = set(unused_parameters(model, x))  # a spare layer the forward never calls need be in no block
    for qualname, p in model.named_parameters():
        if p.requires_grad and id(p) not in owned and qualname not in unused:
            raise PartrainError(f"model {name!r}: parameter {qualname} is in none of the blocks its factory returned: "
                                "the blocks must hold the whole model, in the order its forward runs them")
    leaves = {id(m): (qualname or "the model", m) for qualname, m in model.named_modules() if not any(m.children())}
    calls: Counter = Counter()
    hooks = [m.register_forward_hook(lambda m, i, o: calls.update([id(m)])) for _, m in leaves.values()]
    try:
        with torch.no_grad():
            model(x)
            forward, calls = calls, Counter()
            value = x
            for i, block in enumerate(blocks):
                try:
                    value = block(value)
                except Exception as err:  # noqa: BLE001 - the user's blocks, reported in one line
                    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
                    raise PartrainError(
                        f"model {name!r}: block {i} ({type(block).__name__}) of the blocks its factory returned failed "
                        f"on input {_shape(value)} ({reason}), where the model's forward ran: the blocks, one after "
                        "another, must compute the forward (pipelines train the blocks)") from err
    finally:
        for hook in hooks:
            hook.remove()
    for key, (qualname, module) in leaves.items():
        if forward[key] != calls[key]:
            raise PartrainError(
                f"model {name!r}: its forward runs module {qualname!r} ({type(module).__name__}) {forward[key]} time(s), the "
                f"blocks its factory returned {calls[key]}: the blocks, one after another, must compute the forward "
                "(pipelines train the blocks); return them in order, or return the model alone")


def unused_parameters(model: nn.Module, sample: torch.Tensor) -> list[str]:
    """The trainable parameters no gradient reaches from ``model(sample)``, found by a forward
    and backward on the ``meta`` device (shapes only: no arithmetic, no memory; the CPU's random
    generator left as it was, should the forward draw from it); [] where the model cannot run
    there (``.item()``, data-dependent shapes)."""
    params = {n: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
    buffers = {n: torch.empty_like(b, device="meta") for n, b in model.named_buffers()}
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            out = functional_call(model, {**params, **buffers}, (sample.to("meta"),))
            out = out if isinstance(out, torch.Tensor) else out[0]
            out.float().sum().backward()
    except Exception:  # noqa: BLE001 - not judged here: every parameter is taken as used
        return []
    return [n for n, p in params.items() if p.requires_grad and p.grad is None]


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
