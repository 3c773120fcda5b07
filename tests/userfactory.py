"""User model factories for tests/test_models.py, imported by spec as 'tests.userfactory:<name>'."""

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


def no_arguments():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))


def not_a_module(input_shape, num_classes):
    return {"layers": 3}


def foreign_blocks(input_shape, num_classes):
    return nn.Linear(4, num_classes), [nn.Linear(4, num_classes)]


NOT_CALLABLE = 3
