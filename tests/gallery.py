"""A gallery of user-model shapes, each a factory for ``--model tests.gallery:<name>``.

Tiny on purpose (a few thousand parameters): ``tests/test_gallery.py`` trains every one with
every strategy on two workers, so each must step in milliseconds. Image factories take MNIST's
``(1, 28, 28)``; token factories take the ``tokens`` dataset's ``(T,)`` ids.

- ``noncontig``:  3-D token activations whose blocks end in a transpose (a non-contiguous view)
- ``tokens3d``:   3-D token activations through pre-norm residual blocks with LayerNorm and GELU
- ``batchnorm``:  convolutions with BatchNorm2d (statistics over what each worker sees)
- ``dropout``:    an MLP with dropout (masks drawn per worker)
- ``tuple_out``:  token ids in; blocks pass ``(activations, ids)`` tuples, ints crossing stages
- ``tied``:       embedding and head share one weight, the two ends of the pipeline
- ``traced``:     a plain ``nn.Module`` (no blocks given), split by pipelining's tracer, views crossing its cuts
- ``traced_tied``: a plain module whose first and last mixing layers share one weight, on either side of a cut
- ``bn_blocks``:  a Sequential whose blocks are single layers, a BatchNorm2d among them
- ``traced_bn``:  a plain module with BatchNorm2d (the tracer folds it into its graphs)
- ``dict_out``:   a block returning a dict with a string in it: refused before any worker starts
- ``untraceable``: a plain module with data-dependent control flow: refused with the fix
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH = 16


class RowsToTokens(nn.Module):
    """[B, 1, 28, 28] -> [B, 28, WIDTH]: each image row is a token."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(28, width)

    def forward(self, x):
        return self.proj(x.flatten(1, 2))


class MixThenTranspose(nn.Module):
    """Mixes along the last axis, then returns the transpose: a non-contiguous view."""

    def __init__(self, size: int):
        super().__init__()
        self.mix = nn.Linear(size, size)

    def forward(self, x):
        return torch.tanh(self.mix(x)).transpose(1, 2)


class MeanHead(nn.Module):
    def __init__(self, width: int, num_classes: int, axis: int = 1):
        super().__init__()
        self.axis = axis
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(x.mean(self.axis))


def noncontig(input_shape, num_classes):
    # [B, 28, W] -> transpose -> [B, W, 28] -> transpose -> [B, 28, W]: both cross a stage as views
    return nn.Sequential(RowsToTokens(WIDTH), MixThenTranspose(WIDTH), MixThenTranspose(28), MeanHead(WIDTH, num_classes))


class PreNormBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def tokens3d(input_shape, num_classes):
    return nn.Sequential(RowsToTokens(WIDTH), PreNormBlock(WIDTH), PreNormBlock(WIDTH), PreNormBlock(WIDTH),
                         nn.Sequential(nn.LayerNorm(WIDTH), MeanHead(WIDTH, num_classes)))


def batchnorm(input_shape, num_classes):
    def conv(c_in, c_out):
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2))

    return nn.Sequential(conv(input_shape[0], 4), conv(4, 8), nn.Sequential(nn.Flatten(), nn.Linear(8 * 7 * 7, num_classes)))


def dropout(input_shape, num_classes, p=0.2):
    return nn.Sequential(
        nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 32), nn.ReLU(), nn.Dropout(p)),
        nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Dropout(p)),
        nn.Linear(32, num_classes),
    )


class EmbedKeepIds(nn.Module):
    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)

    def forward(self, ids):
        return self.embed(ids), ids  # a tuple: float activations and int64 ids


class GateByIds(nn.Module):
    """Consumes and returns ``(h, ids)``: the ids re-enter as a per-token gate (int64 crossing a stage)."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.gate = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)

    def forward(self, pair):
        h, ids = pair
        return h + torch.tanh(self.mix(h)) * torch.sigmoid(self.gate(ids)), ids


class DropIds(nn.Module):
    def __init__(self, width: int, vocab: int):
        super().__init__()
        self.head = nn.Linear(width, vocab)

    def forward(self, pair):
        return self.head(pair[0])


def tuple_out(input_shape, num_classes):
    v = num_classes
    return nn.Sequential(EmbedKeepIds(v, WIDTH), GateByIds(v, WIDTH), GateByIds(v, WIDTH), DropIds(WIDTH, v))


class TiedHead(nn.Module):
    """Logits through the embedding's own weight (Press & Wolf, 2017): the tie crosses stages."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.weight = embedding.weight

    def forward(self, x):
        return x @ self.weight.t()


class Mix(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def tied(input_shape, num_classes):
    embed = nn.Embedding(num_classes, WIDTH)
    return nn.Sequential(embed, Mix(WIDTH), Mix(WIDTH), TiedHead(embed))


class ChannelsFirst(nn.Module):
    """A token block on [B, W, T]: it reads a transposed view and returns one."""

    def __init__(self, width: int):
        super().__init__()
        self.block = PreNormBlock(width)

    def forward(self, x):
        return self.block(x.transpose(1, 2)).transpose(1, 2)


class Traced(nn.Module):
    """Not an nn.Sequential and no blocks given: residual glue lives in ``forward``, and what
    goes into each layer is a transposed view ([B, W, T] over a [B, T, W] tensor), so every cut
    the tracer makes between layers sends, and receives into, a non-contiguous tensor."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.stem = RowsToTokens(WIDTH)
        self.layers = nn.ModuleList(ChannelsFirst(WIDTH) for _ in range(3))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, num_classes)

    def forward(self, x):
        h = self.stem(x).transpose(1, 2)
        for layer in self.layers:
            h = layer(h) * 0.5 + h * 0.5
        return self.head(self.norm(h.transpose(1, 2)).mean(1))


def traced(input_shape, num_classes):
    return Traced(num_classes)


class TracedTied(nn.Module):
    """A plain module with a weight used twice: ``Pipe`` copies it per piece, partrain ties it again."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.stem = nn.Linear(28 * 28, WIDTH)
        self.first, self.middle, self.last = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.last.weight = self.first.weight
        self.head = nn.Linear(WIDTH, num_classes)

    def forward(self, x):
        h = torch.tanh(self.stem(x.flatten(1)))
        h = h + torch.tanh(self.first(h))
        h = h + torch.tanh(self.middle(h))
        return self.head(h + torch.tanh(self.last(h)))


def traced_tied(input_shape, num_classes):
    return TracedTied(num_classes)


def bn_blocks(input_shape, num_classes):
    return nn.Sequential(nn.Conv2d(input_shape[0], 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(4),
                         nn.Flatten(), nn.Linear(4 * 7 * 7, num_classes))


class TracedBN(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 7 * 7, num_classes)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        h = F.max_pool2d(F.relu(self.bn2(self.conv2(h)) + h), 2)
        return self.head(h.flatten(1))


def traced_bn(input_shape, num_classes):
    return TracedBN(num_classes)


class ReturnsDict(nn.Module):
    def forward(self, x):
        return {"h": x, "note": "not a tensor"}


class ReadsDict(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        self.head = nn.Linear(28 * 28, num_classes)

    def forward(self, d):
        return self.head(d["h"].flatten(1))


def dict_out(input_shape, num_classes):
    return nn.Sequential(ReturnsDict(), ReadsDict(num_classes))


class Untraceable(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        self.a, self.b = nn.Linear(28 * 28, 16), nn.Linear(16, num_classes)

    def forward(self, x):
        h = self.a(x.flatten(1))
        if h.sum() > 0:  # data-dependent control flow: no graph captures both branches
            h = h * 2
        return self.b(h)


def untraceable(input_shape, num_classes):
    return Untraceable(num_classes)


class FixedProjection(nn.Module):
    """A fixed random projection held in buffers: a block without parameters."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("P", torch.randn(width, width) / width**0.5)

    def forward(self, x):
        return torch.tanh(x @ self.P)


def fixed_tail(input_shape, num_classes):
    """A last block with no parameters: the pipeline worker that holds it steps no optimizer."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes), FixedProjection(num_classes))


class WithSpare(nn.Module):
    """A layer the forward never calls (left over from an experiment): no gradient reaches it."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))
        self.spare = nn.Linear(5, 5)

    def forward(self, x):
        return self.body(x)


def unused(input_shape, num_classes):
    return WithSpare(input_shape, num_classes)


class ScalarGain(nn.Module):
    """A learned scalar gain on the logits: a 0-dimensional parameter."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.body(x) * self.gain


def scalar_gain(input_shape, num_classes):
    return ScalarGain(input_shape, num_classes)


class DictOfParts(nn.Module):
    """Its parts in an nn.ModuleDict, called by key: the tracer cuts between them."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.parts = nn.ModuleDict({
            "encode": nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), WIDTH), nn.Tanh()),
            "decode": nn.Linear(WIDTH, num_classes),
        })

    def forward(self, x):
        return self.parts["decode"](self.parts["encode"](x))


def module_dict(input_shape, num_classes):
    return DictOfParts(input_shape, num_classes)


class ToBFloat16(nn.Module):
    def forward(self, x):
        return x.to(torch.bfloat16)


def bf16_weights(input_shape, num_classes):
    """A model that computes in bfloat16 itself, its weights stored so, whatever --precision says."""
    return nn.Sequential(ToBFloat16(), nn.Flatten(), nn.Linear(math.prod(input_shape), WIDTH, dtype=torch.bfloat16),
                         nn.ReLU(), nn.Linear(WIDTH, num_classes, dtype=torch.bfloat16))
