"""Model parallelism: consecutive layers on consecutive processes, activations sent forward
and gradients sent back point to point, the batch cut into micro-batches to pipeline them.

Schedule (GPipe, Huang et al. 2019): every stage runs all micro-batches' forwards, then
all their backwards in the same order; the last stage turns each forward straight into
its backward. Sends are asynchronous (``isend``), so stage 0 starts micro-batch 2's forward
while stage 1 still works on micro-batch 1: with ``m`` micro-batches on ``p`` stages the
idle "bubble" is about (p - 1) / (m + p - 1) of a step. Each micro-batch in flight needs
its own activations and gradients: one ``Net.replica()`` per micro-batch; their gradients
are summed before the step (each divided by the whole batch's size, as with threads).

Every process builds the whole network from the seed and keeps its stage, so the weights
start equal to serial's, and SGD (elementwise) steps each slice as it would the whole.
"""

from __future__ import annotations

import numpy as np

from partrain.scratch.comm import Comm
from partrain.scratch.layers import Linear, SoftmaxCrossEntropy
from partrain.scratch.local import Timeline, score, shard, sum_grads
from partrain.scratch.net import SGD, Net, cut


class Pipeline:
    def __init__(self, blocks, comm: Comm, microbatches: int, lr: float, momentum: float, weight_decay: float, dtype):
        self.comm, self.m, self.dtype = comm, microbatches, np.dtype(dtype)
        self.stages = cut(blocks, comm.world)
        layers = self.stages[comm.rank]
        self.net = Net(layers, dtype, input_grad=comm.rank > 0)
        linears = [layer for layer in layers if isinstance(layer, Linear)]
        self.width_in, self.width_out = linears[0].W.shape[1], linears[-1].W.shape[0]
        self.first, self.last = comm.rank == 0, comm.rank == comm.world - 1
        self.replicas = [self.net.replica() for _ in range(microbatches)]
        self.opt = SGD(self.net, lr, momentum, weight_decay)

    def rows(self, n: int) -> slice:
        return slice(0, n)  # the first stage needs the inputs, the last the labels

    def step(self, x: np.ndarray, y: np.ndarray, total: int, timeline: Timeline) -> float:
        prev, nxt = self.comm.rank - 1, self.comm.rank + 1
        parts = [shard(len(x), self.m, j) for j in range(self.m)]
        pending, loss = [], 0.0  # sends in flight: (handle, buffer kept alive until it completes)
        for j, rows in enumerate(parts):  # forwards
            a = x[rows] if self.first else self._recv((rows.stop - rows.start, self.width_in), prev, timeline)
            with timeline.phase("compute", "forward", stage=self.comm.rank, mb=j):
                b = self.replicas[j].forward(a)
                if self.last:
                    ce = SoftmaxCrossEntropy()
                    loss += ce.forward(b, y[rows], total)
            if self.last:  # the backward at once: the last stage never waits for itself
                with timeline.phase("compute", "backward", stage=self.comm.rank, mb=j):
                    b = self.replicas[j].backward(ce.backward())
            if self.last and not self.first:
                pending.append(self._send(b, prev, timeline))
            elif not self.last:
                pending.append(self._send(b, nxt, timeline))
        if not self.last:
            for j, rows in enumerate(parts):  # backwards, as the gradients come back
                g = self._recv((rows.stop - rows.start, self.width_out), nxt, timeline)
                with timeline.phase("compute", "backward", stage=self.comm.rank, mb=j):
                    g = self.replicas[j].backward(g)
                if not self.first:
                    pending.append(self._send(g, prev, timeline))
        with timeline.phase("comm", "wait"):  # the sends still in flight
            for handle, _ in pending:
                handle.wait()
        with timeline.phase("reduce"):  # the micro-batches' gradients: m - 1 vector adds
            sum_grads(self.net, self.replicas)
        with timeline.phase("update", "optimizer"):
            self.opt.step()
        return loss  # the batch's loss on the last stage, 0 elsewhere

    def _send(self, a: np.ndarray, dst: int, timeline: Timeline):
        a = np.ascontiguousarray(a)
        with timeline.phase("comm", "send", bytes=a.nbytes, dst=dst):
            return self.comm.isend(a, dst), a

    def _recv(self, shape, src: int, timeline: Timeline) -> np.ndarray:
        with timeline.phase("comm", "recv", src=src):  # includes waiting for the peer: the bubble shows up here
            return self.comm.recv(shape, self.dtype, src)

    def end_epoch(self, timeline: Timeline) -> None:
        pass

    def evaluate(self, x: np.ndarray, y: np.ndarray, chunk: int = 1000) -> tuple[float, float]:
        """Test loss and accuracy: the test set through the pipeline, forward only; the last stage scores."""
        prev, nxt, sums = self.comm.rank - 1, self.comm.rank + 1, np.zeros(2, np.float64)
        for i in range(0, len(x), chunk):
            n = min(chunk, len(x) - i)
            a = x[i:i + n] if self.first else self.comm.recv((n, self.width_in), self.dtype, prev)
            b = self.net.forward(a)
            if self.last:
                sums += score(b, y[i:i + n])
            else:
                self.comm.isend(np.ascontiguousarray(b), nxt).wait()
        self.comm.allreduce_sum(sums)
        return float(sums[0] / len(x)), float(sums[1] / len(x))

    def world_losses(self, losses: list[float]) -> list[float]:
        total = np.array(losses, np.float64)  # nonzero on the last stage only
        self.comm.allreduce_sum(total)
        return list(total)

    def close(self) -> None:
        pass
