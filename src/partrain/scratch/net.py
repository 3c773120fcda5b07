"""A network is a list of layers whose weights and gradients live in two flat vectors.

Every layer's ``W``/``bias`` is a view into ``net.params`` and every ``gW``/``gbias`` a view
into ``net.grads``. That costs nothing in the forward and backward (a view is an array)
and makes everything parallel simple: one allreduce of ``net.grads`` sums the whole
gradient in one message, one average of ``net.params`` syncs the weights, and the
optimizer is three vector operations.

``replica()`` is the same network reading the *same* weights with gradients and
activations of its own: one per thread, or one per micro-batch in flight.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np

from partrain.errors import PartrainError
from partrain.scratch.layers import (
    Layer,
    Linear,
    ReLU,
    Sigmoid,
    he_normal,
    xavier_uniform,
)

ACTIVATIONS = {"relu": ReLU, "sigmoid": Sigmoid}


class Net:
    def __init__(self, layers: Sequence[Layer], dtype=np.float32, params: np.ndarray | None = None,
                 grads: np.ndarray | None = None, input_grad: bool = False):
        """``params``: a flat weight vector to read (a replica); None copies the layers' own weights.
        ``grads``: a flat vector to write the gradients into (e.g. part of a message buffer).
        ``input_grad``: whether ``backward`` returns the gradient of the input (a pipeline stage
        after the first sends it back); for the whole network it is not computed."""
        self.layers, self.dtype, self.input_grad = list(layers), np.dtype(dtype), input_grad
        if isinstance(self.layers[0], Linear):
            self.layers[0].input_grad = input_grad
        arrays = [(layer, name) for layer in self.layers for name in layer.params]
        size = sum(getattr(layer, name).size for layer, name in arrays)
        self.params = np.zeros(size, self.dtype) if params is None else params
        self.grads = np.zeros(size, self.dtype) if grads is None else grads
        if params is None:
            self.params[:] = np.concatenate([getattr(l, n).ravel() for l, n in arrays]) if arrays else []
        offset = 0
        for layer in self.layers:
            for name, gname in zip(layer.params, layer.grads):
                shape = getattr(layer, name).shape
                n = int(np.prod(shape))
                setattr(layer, name, self.params[offset:offset + n].reshape(shape))
                setattr(layer, gname, self.grads[offset:offset + n].reshape(shape))
                offset += n

    def forward(self, a: np.ndarray) -> np.ndarray:
        for layer in self.layers:
            a = layer.forward(a)
        return a

    def backward(self, gb: np.ndarray) -> np.ndarray:
        for layer in reversed(self.layers):
            gb = layer.backward(gb)
        return gb

    def replica(self) -> Net:
        """The same layers over the same weight vector, with their own gradients and activations."""
        return Net([copy.copy(layer) for layer in self.layers], self.dtype, params=self.params,
                   input_grad=self.input_grad)

    def __repr__(self) -> str:
        return f"Net({', '.join(map(repr, self.layers))}; {self.params.size:,} parameters)"


def mlp(widths: Sequence[int], activation: str = "relu", dtype=np.float32, seed: int = 0) -> list[list[Layer]]:
    """The MLP as blocks: ``[Linear, act]`` per hidden width, then ``[Linear]`` to the classes.

    784-256-128-10 has 784*256+256 + 256*128+128 + 128*10+10 = 235,146 parameters. Init, as
    the zoo's ``mlp``: He normal for ReLU hidden layers, Xavier uniform for the output layer
    and for every sigmoid layer; biases zero. Blocks (not a flat list) so that model
    parallelism can cut between them.
    """
    if activation not in ACTIVATIONS:
        raise PartrainError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    rng = np.random.default_rng(seed)
    blocks = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        linear = Linear(n_in, n_out, dtype)
        is_output = i == len(widths) - 2
        (he_normal if activation == "relu" and not is_output else xavier_uniform)(linear, rng)
        blocks.append([linear] if is_output else [linear, ACTIVATIONS[activation]()])
    return blocks


def flatten(blocks: Sequence[Sequence[Layer]]) -> list[Layer]:
    return [layer for block in blocks for layer in block]


def cut(blocks: Sequence[Sequence[Layer]], stages: int) -> list[list[Layer]]:
    """Consecutive blocks into ``stages`` groups of about equal parameter count (greedy).

    For 784-256-128-10 in 2 stages: [fc1] (200,960 parameters) | [fc2, fc3] (34,186).
    """
    if not 1 <= stages <= len(blocks):
        raise PartrainError(f"model-parallel: {stages} stages for {len(blocks)} layers; use 1 to {len(blocks)} workers")
    sizes = [sum(getattr(l, n).size for l in block for n in l.params) for block in blocks]
    groups, start = [], 0
    for s in range(stages):
        left = stages - s - 1  # blocks that must remain for the stages after this one
        target = sum(sizes[start:]) / (stages - s)
        end, acc = start + 1, sizes[start]
        while end < len(blocks) - left and acc + sizes[end] / 2 <= target:
            acc, end = acc + sizes[end], end + 1
        groups.append(flatten(blocks[start:end]))
        start = end
    return groups


class SGD:
    """SGD with momentum, PyTorch's form (``torch.optim.SGD``):
    ``v = mu v + (g + wd p)``; ``p -= lr v`` (the first step takes ``v = g``).

    Elementwise on the flat vectors, so any slice of the network (a pipeline stage) steps
    exactly as the same slice of the whole network would.
    """

    def __init__(self, net: Net, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        self.net, self.lr, self.momentum, self.weight_decay = net, lr, momentum, weight_decay
        self.velocity = np.zeros_like(net.params)
        self.scratch = np.empty_like(net.params)  # lr * v, written in place: no temporary of the model's size a step

    def step(self, part: slice = slice(None)) -> None:
        """Update the weights ``part`` of the flat vector (all by default); threads update
        disjoint parts at once. Four passes over memory, none allocating."""
        p, g, v, tmp = self.net.params[part], self.net.grads[part], self.velocity[part], self.scratch[part]
        if self.weight_decay:
            np.multiply(p, self.weight_decay, out=tmp)
            g = np.add(g, tmp, out=tmp)
        v *= self.momentum
        v += g
        np.multiply(v, self.lr, out=tmp)
        p -= tmp
