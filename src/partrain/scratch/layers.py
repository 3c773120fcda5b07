"""The layers, each a forward ``b = forward(a)`` and a backward ``ga = backward(gb)`` written by hand.

A layer keeps what its backward needs from the last forward (the input of a Linear, the
output of a Sigmoid, the mask of a ReLU) and, if it has weights, its own gradient buffers,
which ``backward`` overwrites (never accumulates): one forward, one backward, one step.

Shapes: ``a`` is ``[n, features]``, one row per sample. Weights follow torch's layout,
``W`` is ``[out, in]`` and ``b = a @ W.T + bias``, so the oracle tests compare arrays
with ``torch.nn.Linear``'s as they are.
"""

from __future__ import annotations

import numpy as np


class Layer:
    """A step of the network; ``params`` and ``grads`` name its arrays (none for activations)."""

    params: tuple[str, ...] = ()  # attribute names of the weights, e.g. ("W", "bias")
    grads: tuple[str, ...] = ()  # attribute names of their gradients, in the same order

    def forward(self, a: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def backward(self, gb: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class Linear(Layer):
    """``b = a W^T + bias``. Backward (the chain rule on a matrix product):
    ``gW = gb^T a``, ``gbias = sum over rows of gb``, ``ga = gb W``."""

    params, grads = ("W", "bias"), ("gW", "gbias")
    input_grad = True  # False on a network's first layer: nothing needs the gradient of the data

    def __init__(self, n_in: int, n_out: int, dtype=np.float32):
        self.W = np.zeros((n_out, n_in), dtype)
        self.bias = np.zeros(n_out, dtype)
        self.gW, self.gbias = np.zeros_like(self.W), np.zeros_like(self.bias)
        self.a: np.ndarray | None = None

    def forward(self, a: np.ndarray) -> np.ndarray:
        self.a = a
        return a @ self.W.T + self.bias  # one GEMM, n x in x out multiply-adds; BLAS releases the GIL

    def backward(self, gb: np.ndarray) -> np.ndarray:
        np.matmul(gb.T, self.a, out=self.gW)  # written in place: the buffer may be a view of a flat vector
        np.sum(gb, axis=0, out=self.gbias)
        return gb @ self.W if self.input_grad else None  # skipping it saves a third of fc1's backward

    def __repr__(self) -> str:
        return f"Linear({self.W.shape[1]}, {self.W.shape[0]})"


class ReLU(Layer):
    """``b = max(a, 0)``; ``ga = gb`` where ``a > 0``, else 0."""

    def forward(self, a: np.ndarray) -> np.ndarray:
        self.mask = a > 0
        return a * self.mask

    def backward(self, gb: np.ndarray) -> np.ndarray:
        return gb * self.mask

    def __repr__(self) -> str:
        return "ReLU()"


class Sigmoid(Layer):
    """``b = 1 / (1 + e^-a)``, computed as ``(1 + tanh(a/2)) / 2`` (the same function, no
    overflow for large ``-a``); ``ga = gb * b * (1 - b)``, from the output alone."""

    def forward(self, a: np.ndarray) -> np.ndarray:
        self.b = 0.5 * (1.0 + np.tanh(0.5 * a))
        return self.b

    def backward(self, gb: np.ndarray) -> np.ndarray:
        return gb * self.b * (1.0 - self.b)

    def __repr__(self) -> str:
        return "Sigmoid()"


class SoftmaxCrossEntropy:
    """Mean cross-entropy of softmax(logits) against integer labels, and its gradient.

    ``forward(z, y, total)`` returns ``sum_i -log softmax(z_i)[y_i] / total``; ``total``
    defaults to the rows of ``z`` (the mean). A shard of a batch passes the whole batch's
    size, so that the shards' losses and gradients add up to the batch's exactly: that is
    how threads, processes and micro-batches reproduce serial training.

    Backward of softmax followed by cross-entropy folds into one line (e.g. Bishop, Pattern
    Recognition and Machine Learning, eq. 4.109): ``gz = (softmax(z) - onehot(y)) / total``.
    """

    def forward(self, z: np.ndarray, y: np.ndarray, total: int | None = None) -> float:
        shifted = z - z.max(axis=1, keepdims=True)  # log-sum-exp trick: exp never overflows
        log_norm = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        log_p = shifted - log_norm
        self.p, self.y = np.exp(log_p), y
        self.total = len(z) if total is None else total
        return float(-log_p[np.arange(len(y)), y].sum() / self.total)

    def backward(self, gloss: float = 1.0) -> np.ndarray:
        gz = self.p.copy()
        gz[np.arange(len(self.y)), self.y] -= 1.0
        gz *= gloss / self.total
        return gz


def he_normal(layer: Linear, rng: np.random.Generator) -> None:
    """He et al. 2015 (fan_in, for ReLU): ``W ~ N(0, 2 / fan_in)``; bias 0."""
    fan_in = layer.W.shape[1]
    layer.W[...] = rng.normal(0.0, np.sqrt(2.0 / fan_in), layer.W.shape)
    layer.bias[...] = 0.0


def xavier_uniform(layer: Linear, rng: np.random.Generator) -> None:
    """Glorot and Bengio 2010: ``W ~ U(-r, r)``, ``r = sqrt(6 / (fan_in + fan_out))``; bias 0."""
    fan_out, fan_in = layer.W.shape
    r = np.sqrt(6.0 / (fan_in + fan_out))
    layer.W[...] = rng.uniform(-r, r, layer.W.shape)
    layer.bias[...] = 0.0
