"""What a block takes and returns, for the profiler: a tensor, or a tuple of them.

A block may return ``(activations, token ids)`` (issue 17's gallery ``tuple_out``); the next
block takes the tuple as one argument, as ``nn.Sequential`` chains them. The profiler feeds
each block the previous one's output, detached, with a gradient wanted on its floating-point
tensors only (integer ids cannot have one), runs backward from every floating-point output
that needs a gradient, and counts the bytes of every tensor as it is (int64 ids 8 per element).
"""

from __future__ import annotations

import torch


def tensors(x) -> list[torch.Tensor]:
    """The tensors of ``x``: itself, or the items of a tuple or list."""
    return [t for t in x if isinstance(t, torch.Tensor)] if isinstance(x, tuple | list) else [x]


def detached(x, needs_grad: bool):
    """``x`` cut from its graph; its floating-point tensors want a gradient when ``needs_grad``."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_(needs_grad and t.is_floating_point())

    if isinstance(x, tuple | list):
        return type(x)(cut(t) if isinstance(t, torch.Tensor) else t for t in x)
    return cut(x)


def differentiable(out) -> list[torch.Tensor]:
    """The outputs backward starts from: floating-point tensors in the graph."""
    return [t for t in tensors(out) if t.requires_grad]


def backward(out, grads: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Backward from every differentiable output of a block, with ``grads`` (ones when None);
    returns the gradients used, for the next call to reuse."""
    outs = differentiable(out)
    grads = grads if grads is not None else [torch.ones_like(t) for t in outs]
    if outs:
        torch.autograd.backward(outs, grads)
    return grads


def nbytes(x) -> int:
    """Bytes of every tensor in ``x``, at its own element size."""
    return sum(t.numel() * t.element_size() for t in tensors(x))
