"""A user model whose module draws random numbers as it is imported (a fixed random
projection, say): for ``--model tests.import_draws:build`` in tests/test_equality.py."""

import torch
import torch.nn as nn

PROJECTION = torch.randn(3)  # drawn from torch's global generator at import time


def build(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), 32), nn.Tanh(),
                         nn.Linear(32, num_classes))
