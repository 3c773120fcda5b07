"""A model that fails on purpose, for the benchmark runner's tests: 'tests.bench_models:raises_in_forward'."""

import torch
import torch.nn as nn


class RaisesInForward(nn.Sequential):
    """Builds and passes the preflight's shape check (an eval-mode forward on the meta device),
    but fails on its first training step, as a model with a bug in its training path would."""

    def __init__(self, in_features: int, num_classes: int):
        super().__init__(nn.Flatten(), nn.Linear(in_features, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            raise RuntimeError("bench_models: this model fails on purpose")
        return super().forward(x)


def raises_in_forward(input_shape, num_classes):
    return RaisesInForward(int(torch.tensor(input_shape).prod()), num_classes)
