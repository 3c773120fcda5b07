"""Data-parallel steppers: serial, threads, ddp (the MPI pattern), hybrid, local SGD.

One class covers the first four: every process holds the whole network and the same
weights, takes its own rows of the global batch, computes their gradient (in one thread or
several), and the gradients are summed over the processes with one allreduce (a no-op
for one process). So ``serial`` is ``DataParallel`` with 1 process x 1 thread, ``threads``
1 x T, ``ddp`` W x 1 and ``hybrid`` W x T.

A stepper answers: which rows of a batch this worker loads (``rows``), one optimizer step on
them (``step``), what happens at an epoch's end (``end_epoch``), the test loss and accuracy of
the weights (``evaluate``), and the world's per-step losses (``world_losses``).
"""

from __future__ import annotations

import numpy as np

from partrain.scratch.comm import Comm
from partrain.scratch.local import Timeline, evaluate, local_grad, shard
from partrain.scratch.net import SGD, Net, flatten


class DataParallel:
    """Gradient allreduce after every mini-batch: synchronous, equal to serial step by step.

    Each process's loss and gradient are of its rows summed / the global batch size, so the
    sum over processes is the batch mean. The loss rides in the same message as the
    gradient, one extra element: one allreduce a step, of (parameters + 1) values.
    """

    def __init__(self, blocks, comm: Comm, threads: int, lr: float, momentum: float, weight_decay: float, dtype):
        self.comm = comm
        layers = flatten(blocks)
        size = sum(getattr(l, n).size for l in layers for n in l.params)
        self.message = np.zeros(size + 1, dtype)  # [gradient..., loss]
        self.net = Net(layers, dtype, grads=self.message[:size])
        self.grad = local_grad(self.net, threads)
        self.opt = SGD(self.net, lr, momentum, weight_decay)

    def rows(self, n: int) -> slice:
        return shard(n, self.comm.world, self.comm.rank)

    def step(self, x: np.ndarray, y: np.ndarray, total: int, timeline: Timeline) -> float:
        self.message[-1] = self.grad(x, y, total, timeline)  # writes net.grads, a view of the message
        if self.comm.world > 1:
            with timeline.phase("comm", "allreduce", bytes=self.message.nbytes):
                self.comm.allreduce_sum(self.message)  # ~2 x message bytes through each process's link (ring)
        with timeline.phase("update", "optimizer"):
            self.grad.each_part(self.opt.step)  # with threads: each updates its part of the weights
        return float(self.message[-1])

    def end_epoch(self, timeline: Timeline) -> None:
        pass

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Test loss and accuracy: each process scores its part of the test set; one allreduce of the sums."""
        mine = shard(len(x), self.comm.world, self.comm.rank)
        sums = np.array([*evaluate(self.net, x[mine], y[mine]), len(y[mine])], np.float64)
        self.comm.allreduce_sum(sums)
        return float(sums[0] / sums[2]), float(sums[1] / sums[2])

    def world_losses(self, losses: list[float]) -> list[float]:
        return losses  # already the global batch's loss on every process

    def close(self) -> None:
        getattr(self.grad, "close", lambda: None)()


class LocalSGD(DataParallel):
    """Independent workers, weights averaged every ``every`` steps (the reports' master/worker
    weight averaging; Lin et al. 2020, "Don't use large mini-batches, use local SGD").

    Each worker steps on the mean gradient of its own rows and its own momentum; every
    ``every`` steps (or at each epoch's end, ``every=None``) one allreduce averages the weights.
    With ``every=1`` this equals ``ddp`` step for step: the average of the workers' SGD
    updates is the SGD update of the average gradient (momentum is linear too).
    Losses are each worker's own, averaged over the workers once, at the end.
    """

    def __init__(self, blocks, comm: Comm, threads: int, lr: float, momentum: float, weight_decay: float, dtype,
                 every: int | None):
        super().__init__(blocks, comm, threads, lr, momentum, weight_decay, dtype)
        self.every, self.steps = every, 0

    def step(self, x: np.ndarray, y: np.ndarray, total: int, timeline: Timeline) -> float:
        loss = self.grad(x, y, len(x), timeline)  # the mean over this worker's own rows
        with timeline.phase("update", "optimizer"):
            self.grad.each_part(self.opt.step)
        self.steps += 1
        if self.every and self.steps % self.every == 0:
            self._average(timeline)
        return loss

    def end_epoch(self, timeline: Timeline) -> None:
        if not self.every or self.steps % self.every:  # test on one model: the average
            self._average(timeline)

    def _average(self, timeline: Timeline) -> None:
        with timeline.phase("comm", "average", bytes=self.net.params.nbytes):
            self.comm.allreduce_sum(self.net.params)
            self.net.params /= self.comm.world

    def world_losses(self, losses: list[float]) -> list[float]:
        total = np.array(losses, np.float64)
        self.comm.allreduce_sum(total)
        return list(total / self.comm.world)
