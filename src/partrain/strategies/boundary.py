"""What crosses a pipeline stage boundary, and the stage module that sends and receives it.

A block may return anything a PyTorch module returns; only tensors, or tuples (lists) of
tensors, can travel between pipeline stages: ``torch.distributed.pipelining`` sends each
tensor of a stage's output with one point-to-point message and rebuilds them as the next
stage's positional arguments. Any dtype and any number of dimensions crosses (token ids
as int64; 2- to 5-D activations); integer tensors carry no gradient back.

``probe_boundaries`` runs the blocks once on a two-sample batch (eval mode, no grad: no
RNG drawn, no BatchNorm statistics touched) and records what each block returns, refusing
before any worker starts what cannot cross (a dict, a string, None), naming the block.
``Stage`` then packs the received arguments back into what the block returned (a tensor
or a tuple) and makes what it sends contiguous: gloo and NCCL send only contiguous
buffers, and a block that ends in a transpose or a slice returns a strided view.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from partrain.errors import PartrainError


@dataclass(frozen=True)
class Crossing:
    """What one block returns: a tensor (``arity`` None) or a tuple of ``arity`` tensors."""

    arity: int | None = None


def _describe(value) -> str:
    if isinstance(value, dict):
        kinds = sorted({type(v).__name__ for v in value.values()})
        return f"a dict of {', '.join(kinds)}"
    if isinstance(value, (tuple, list)):
        kinds = sorted({type(v).__name__ for v in value if not isinstance(v, torch.Tensor)})
        return f"a {type(value).__name__} holding {', '.join(kinds)}"
    return f"a {type(value).__name__}"


def crossing_of(value) -> Crossing | None:
    """The ``Crossing`` a block output needs, or None when it cannot cross a stage."""
    if isinstance(value, torch.Tensor):
        return Crossing()
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return Crossing(len(value))
    return None


@contextlib.contextmanager
def leaves_no_trace(modules: list[nn.Module]):
    """What runs inside draws nothing from the run's random stream (dropout) and leaves the
    modules' buffers (BatchNorm's running statistics) as they were. Eval mode alone does not
    do it for the tracer's pieces: ``torch.export`` recorded their dropout and BatchNorm in
    training mode, and ``eval()`` does not reach inside a graph."""
    buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    try:
        with torch.random.fork_rng(devices=None if torch.cuda.is_available() else []):
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


@contextlib.contextmanager
def probing(modules: list[nn.Module]):
    """A look at what ``modules`` compute that the run never sees: eval mode, no trace left
    (``leaves_no_trace``), and each submodule's training flag as it was afterwards."""
    modes = [(m, m.training) for top in modules for m in top.modules()]
    for top in modules:
        top.eval()
    try:
        with leaves_no_trace(modules):  # eval mode does not reach inside a traced piece
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def _block_name(i: int, block: nn.Module) -> str:
    return f"block {i} ({type(block).__name__})"


@torch.no_grad()
def probe_boundaries(blocks: list[nn.Module], sample) -> list[Crossing]:
    """What every block returns on ``sample`` (two samples suffice); refuses what cannot cross.

    Costs one forward of the model on the sample. Blocks run in eval mode and leave no trace
    (``probing``): dropout draws nothing from the run's random stream and BatchNorm's
    statistics stay as they were, so the run that follows starts exactly as it would have
    without the probe.
    """
    with probing(blocks):
        x, found = sample, []
        for i, block in enumerate(blocks):
            x = block(x)
            kind = crossing_of(x)
            last = i == len(blocks) - 1
            if last and not isinstance(x, torch.Tensor):
                raise PartrainError(
                    f"{_block_name(i, block)} is the model's last block and returns {_describe(x)}: "
                    "the last block must return the logits as one tensor"
                )
            if kind is None:
                raise PartrainError(
                    f"{_block_name(i, block)} returns {_describe(x)}, which cannot cross a pipeline stage: "
                    "return a tensor or a tuple of tensors from it, or use a data-parallel strategy (ddp, fsdp)"
                )
            found.append(kind)
        return found


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; backward makes the gradient contiguous, since it is sent to the previous stage."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    # A no-op for a contiguous tensor; a view costs one copy of its bytes per micro-batch
    # (the bytes the send moves anyway) and the same again for its gradient in backward.
    return t.contiguous()


class Stage(nn.Module):
    """One pipeline stage: consecutive blocks, unpacking what the previous stage sent.

    ``receives`` is what the block before the stage returned (None for the first stage,
    which gets the batch). Outputs leave contiguous; float inputs get contiguous gradients.
    """

    def __init__(self, blocks: list[nn.Module], receives: Crossing | None, sends: torch.dtype | None = None):
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.receives = receives
        self.sends = sends  # float outputs leave in this dtype (--precision: bf16/fp16), whatever autocast chose

    def forward(self, *args):
        if self.receives is not None:
            args = tuple(_ContiguousGrad.apply(a) if a.requires_grad else a for a in args)
        x = tuple(args) if self.receives is not None and self.receives.arity is not None else args[0]
        out = self.blocks(x)
        if isinstance(out, torch.Tensor):
            return self._leaving(out)
        return tuple(self._leaving(t) for t in out)

    def _leaving(self, t: torch.Tensor) -> torch.Tensor:
        # a fixed dtype makes the receiver's buffers (sized once, from stage_examples) right on
        # any device: CPU and CUDA autocast pick different dtypes for a few ops
        if self.sends is not None and t.is_floating_point():
            t = t.to(self.sends)
        return _contiguous(t)


@torch.no_grad()
def stage_examples(stages: list[Stage], mb_sample: torch.Tensor) -> list[tuple[tuple, tuple]]:
    """Each stage's (inputs, outputs) on one micro-batch, as meta tensors: the stages' static metadata.

    Given these, ``PipelineStage`` sizes its send and receive buffers from them instead of
    inferring them by running each stage on uninitialised tensors, which would hand an
    embedding garbage token ids. Costs one forward of the model on one micro-batch (``probing``:
    eval mode, no RNG drawn, no statistics updated). Received floats carry gradients back; the
    first stage's input (the data) does not.
    """
    with probing(stages):
        examples, args = [], (mb_sample,)
        for s, stage in enumerate(stages):
            lowered = s > 0 and stages[s - 1].sends is not None  # --precision's dtype, not the model's own
            out = stage(*(_widened(a, _weights_dtype(stage)) if lowered else a for a in args))
            outs = out if isinstance(out, tuple) else (out,)
            examples.append((tuple(_meta(a, s > 0) for a in args), tuple(_meta(o, True) for o in outs)))
            args = outs
        return examples


def _widened(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # a stage sending bf16/fp16 (--precision) has its receiver run here without autocast, so in
    # its weights' dtype: the example records the dtype that crosses, while the CPU needs no
    # autocast to run it. Float32 weights get float32; a model that computes in bf16 itself
    # (bf16 weights) keeps its bf16 (widened to float32 it met them as "mat1 and mat2 must have
    # the same dtype"). Activations of a model's own dtype are never widened (see the caller).
    return t.to(dtype) if t.dtype in (torch.bfloat16, torch.float16) else t


def _weights_dtype(stage: nn.Module) -> torch.dtype:
    return next((p.dtype for p in stage.parameters() if p.is_floating_point()), torch.float32)


def _meta(t: torch.Tensor, grad: bool) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(grad and t.is_floating_point())
