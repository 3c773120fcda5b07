"""User model factories for tests/test_models.py, imported by spec as 'tests.userfactory:<name>'."""

import os
import time

import torch
import torch.nn as nn


class TwoPart(nn.Module):
    """Not an nn.Sequential: its blocks are known only from the factory."""

    def __init__(self, in_features: int, num_classes: int, width: int):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, width), nn.Tanh())
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def build(input_shape, num_classes, width=16):
    model = TwoPart(int(torch.tensor(input_shape).prod()), num_classes, width)
    return model, [model.body, model.head]


def plain(input_shape, num_classes, width=16):
    """The same module without its blocks: a plain module, which pipelines cut with the tracer."""
    return TwoPart(int(torch.tensor(input_shape).prod()), num_classes, width)


def no_arguments():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))


def not_a_module(input_shape, num_classes):
    return {"layers": 3}


def foreign_blocks(input_shape, num_classes):
    return nn.Linear(4, num_classes), [nn.Linear(4, num_classes)]


NOT_CALLABLE = 3


def raises(input_shape, num_classes):
    raise ValueError("width must be even")


def exits(input_shape, num_classes):
    import sys

    sys.exit(3)


def wrong_output(input_shape, num_classes):
    """Seven outputs for a ten-class dataset."""
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), 7))


def bad_shapes(input_shape, num_classes):
    """Its second block expects 100 features and gets 32."""
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), 32), nn.Linear(100, num_classes))


class AllocatorFails(nn.Module):
    """Raises the CPU allocator's own error on batches larger than the launcher's check sends,
    as a training step that does not fit in host memory does."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 4:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate 60211200000 bytes. Error code 12 (Cannot allocate memory)")
        return self.body(x)


def out_of_memory(input_shape, num_classes):
    return AllocatorFails(int(torch.tensor(input_shape).prod()), num_classes)


class RefusesLargeBatches(nn.Module):
    """Raises in its own forward once training sends more than the launcher's two-sample
    check, as a user's model with a bug in a branch the check does not take."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 4:
            raise ValueError(f"this model takes at most 4 samples, got {x.shape[0]}")
        return self.body(x)


def raises_in_forward(input_shape, num_classes):
    return RefusesLargeBatches(int(torch.tensor(input_shape).prod()), num_classes)


def batchnorm(input_shape, num_classes):
    """BatchNorm1d trains on no batch of one sample (a last batch of one, or --batch-size 1)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), 16), nn.BatchNorm1d(16),
                         nn.ReLU(), nn.Linear(16, num_classes))


class SleepsOnRank1(nn.Module):
    """Rank 1 sleeps in its third forward: its peers give up waiting for it (``--timeout``)."""

    def __init__(self, features, num_classes):
        super().__init__()
        self.fc = nn.Linear(features, num_classes)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == 3:
            time.sleep(300)
        return self.fc(x.flatten(1))


def slow_rank1(input_shape, num_classes):
    return SleepsOnRank1(int(torch.tensor(input_shape).prod()), num_classes)


def blocks_skip_activations(input_shape, num_classes):
    """Blocks that leave out the model's activations: chained, they are a linear model."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.Tanh(), nn.Linear(16, num_classes))
    return model, [model[0], model[1], model[3]]


def blocks_leave_a_parameter_out(input_shape, num_classes):
    """A scale the forward applies at the end, owned by the model and by none of its blocks."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(784, num_classes))
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return self.body(x) * self.scale

    model = Scaled()
    return model, [model.body]


def positional_only(input_shape, num_classes, /, width=8):
    return nn.Sequential(nn.Flatten(), nn.Linear(784, width), nn.Tanh(), nn.Linear(width, num_classes))


def other_names(shape, n_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(784, n_classes))


def blocks_with_a_spare_head(input_shape, num_classes):
    """An auxiliary head the forward never calls, in no block: trained by no strategy, refused by none."""

    class Spare(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(784, num_classes))
            self.aux = nn.Linear(784, num_classes)

        def forward(self, x):
            return self.body(x)

    model = Spare()
    return model, [model.body[0], model.body[1]]


def blocks_miss_the_forwards_reshape(input_shape, num_classes):
    """The forward flattens its input itself; its blocks do not."""

    class Flattens(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(784, 16), nn.Linear(16, num_classes)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x.flatten(1))))

    model = Flattens()
    return model, [model.fc1, model.fc2]


def positional_only_open(input_shape, num_classes, /, **options):
    return nn.Sequential(nn.Flatten(), nn.Linear(784, options.get("width", 8)), nn.Tanh(), nn.Linear(options.get("width", 8), num_classes))
