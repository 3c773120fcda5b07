"""Models that fail on purpose, imported by spec as 'tests.faulty:<name>'."""

import os
import signal

import torch.nn as nn


class DiesOnRank1(nn.Sequential):
    """An MLP whose worker of rank 1 kills itself (SIGKILL) on its 3rd forward."""

    def __init__(self):
        super().__init__(nn.Flatten(), nn.Linear(784, 10))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


def dies_on_rank1():
    return DiesOnRank1()


class Raises(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Flatten(), nn.Linear(784, 10))

    def forward(self, x):
        raise RuntimeError("this model always fails")


def raises():
    return Raises()
