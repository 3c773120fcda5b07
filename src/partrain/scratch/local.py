"""One process's gradient of a batch: in one thread, or split over threads (the OpenMP pattern).

The OpenMP version of the C MLP did ``#pragma omp parallel for`` over the samples of a
mini-batch, each thread adding into private gradient buffers, then a reduction. Here each
thread runs a ``Net.replica()`` (the shared weights, its own activations and gradients)
on a contiguous shard of the rows; the main thread then sums the replicas' gradient
vectors. Python threads run at the same time only while NumPy is inside BLAS or a ufunc
loop, which release the GIL: the GEMMs that are most of an MLP's time do.

``Timeline`` records the seconds of each phase of each step, so a run can say where its
time went (``compute``, ``reduce``, ``comm``, ``update``), and, with ``--events DIR``, each
phase as a span of partrain's event log (``partrain.events``), the format ``partrain trace``
draws: ``compute`` (and one ``thread T`` row per thread), ``reduce``, ``allreduce``,
``average``, ``send``/``recv``, a pipeline stage's ``forward``/``backward`` per micro-batch,
``optimizer``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

from partrain.events import EventLog
from partrain.scratch.layers import SoftmaxCrossEntropy
from partrain.scratch.net import Net


class Timeline:
    """Seconds per phase, per step: ``steps[i]["compute"]``; each phase also a span of
    ``events`` (when it is enabled; a disabled log costs a method call per phase)."""

    def __init__(self, events: EventLog | None = None):
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = defaultdict(float)
        self.events = events or EventLog()

    @contextmanager
    def phase(self, name: str, span: str | None = None, **attrs):
        """Time a phase ``name`` (compute, reduce, comm, update); its span is called ``span``
        (default: ``name``), with ``attrs`` and the step's index."""
        start = time.perf_counter()  # ~50 ns; a step has a handful of phases
        try:
            yield
        finally:
            end = time.perf_counter()
            self._current[name] += end - start
            self.events.record(span or name, start, end, step=len(self.steps), **attrs)

    def end_step(self) -> None:
        self.steps.append(dict(self._current))
        self._current = defaultdict(float)

    def steady_ms(self, warmup: int = 5) -> dict[str, float]:
        """``mean_ms`` without the start: the first ``warmup`` steps where there are 20 or more,
        else the first quarter, and never the very first step (first-touch page faults, thread
        start: with 3 steps it read 32 ms of communication beside a median step of 8 ms)."""
        return self.mean_ms(skip=min(warmup, max(1, len(self.steps) // 4)))

    def mean_ms(self, skip: int = 0) -> dict[str, float]:
        """Mean milliseconds per step of each phase, over the steps after ``skip``."""
        steps = self.steps[skip:] or self.steps
        names = sorted({name for step in steps for name in step})
        return {name: 1e3 * sum(step.get(name, 0.0) for step in steps) / max(1, len(steps)) for name in names}


# a span's name -> the part of a step it is (threads' own "thread T" spans lie inside "compute")
PARTS = {"data": "data", "compute": "compute", "forward": "compute", "backward": "compute", "reduce": "reduction",
         "allreduce": "communication", "average": "communication", "send": "communication", "recv": "communication",
         "wait": "communication", "optimizer": "update"}


def breakdown(events: list[dict], skip: int = 0) -> dict[int, dict[str, float]]:
    """Mean milliseconds per step of each part (data, compute, reduction, communication,
    update) per rank, from a run's events (``partrain.events.read_events``), leaving out
    the first ``skip`` steps; ``step`` is the whole step, the rest is Python between phases."""
    sums: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    steps: dict[int, set] = defaultdict(set)  # (an epoch's closing average belongs to no step: left out)
    for e in events:
        if e["name"] == "step" and e["step"] >= skip:
            steps[e["rank"]].add(e["step"])
    for e in events:
        part = "step" if e["name"] == "step" else PARTS.get(e["name"])
        if part is not None and e.get("step") in steps[e["rank"]]:
            sums[e["rank"]][part] += e["end"] - e["start"]
    return {rank: {part: 1e3 * s / max(1, len(steps[rank])) for part, s in parts.items()} for rank, parts in sorted(sums.items())}


def loss_and_grad(net: Net, x: np.ndarray, y: np.ndarray, total: int) -> float:
    """Forward, loss (summed over these rows / ``total``), backward: ``net.grads`` is written."""
    ce = SoftmaxCrossEntropy()
    loss = ce.forward(net.forward(x), y, total)
    net.backward(ce.backward())
    return loss


class SerialGrad:
    """The whole batch in this thread."""

    def __init__(self, net: Net):
        self.net = net

    def __call__(self, x: np.ndarray, y: np.ndarray, total: int, timeline: Timeline) -> float:
        with timeline.phase("compute"):
            return loss_and_grad(self.net, x, y, total)

    def each_part(self, fn) -> None:
        fn(slice(None))


class ThreadedGrad:
    """The batch's rows split over ``threads`` replicas, their gradients summed into ``net.grads``.

    Every shard's loss and gradient are divided by the whole batch's size (``total``), so
    their sum is the batch mean, equal to serial's up to the order of floating-point adds.

    Two things keep the fixed cost of a step down (at batch 64 a step is ~1 ms, so tens
    of microseconds matter): the calling thread works on part 0 itself, as OpenMP's
    master thread does, so a parallel region wakes ``threads - 1`` pool threads, not
    ``threads``; and part 0's replica is the network itself, so its gradient is written
    straight into ``net.grads`` and the reduction adds the others to it (no copy pass
    over the gradient vector).
    """

    def __init__(self, net: Net, threads: int):
        self.net, self.threads = net, threads
        self.replicas = [net] + [net.replica() for _ in range(threads - 1)]  # own gradients: 4 bytes x params each
        self.pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="scratch")

    def __call__(self, x: np.ndarray, y: np.ndarray, total: int, timeline: Timeline) -> float:
        shards = [shard(len(x), self.threads, t) for t in range(self.threads)]
        step, events = len(timeline.steps), timeline.events

        def work(t: int) -> float:
            start = time.perf_counter()
            loss = loss_and_grad(self.replicas[t], x[shards[t]], y[shards[t]], total)
            events.record(f"thread {t}", start, time.perf_counter(), step=step)  # list.append: thread-safe
            return loss

        with timeline.phase("compute"):  # the parallel region
            losses = self._parallel(work, range(self.threads))
        with timeline.phase("reduce"):  # (threads - 1) vector adds, each thread on its part of the vector
            self.each_part(self._reduce)
        return sum(losses)

    def _reduce(self, part: slice) -> None:
        for replica in self.replicas[1:]:  # replica 0 wrote net.grads itself
            self.net.grads[part] += replica.grads[part]

    def each_part(self, fn) -> None:
        """``fn(part)`` on every thread at once, each on a contiguous part of the weight vector
        (OpenMP's ``parallel for`` over the weights): the reduction and the update are
        elementwise, so they parallelize too, and give bit-identical results."""
        self._parallel(fn, [shard(self.net.params.size, self.threads, t) for t in range(self.threads)])

    def _parallel(self, fn, items) -> list:
        """``[fn(item) for item in items]``, item 0 in this thread, the others in the pool at once."""
        first, *rest = items
        futures = [self.pool.submit(fn, item) for item in rest]
        return [fn(first)] + [f.result() for f in futures]

    def close(self) -> None:
        self.pool.shutdown()


def sum_grads(net: Net, replicas: list[Net], part: slice = slice(None)) -> None:
    """``net.grads[part]`` = the sum of the replicas' ``grads[part]``: len(replicas) - 1 vector adds."""
    np.copyto(net.grads[part], replicas[0].grads[part])
    for replica in replicas[1:]:
        net.grads[part] += replica.grads[part]


def shard(n: int, parts: int, index: int) -> slice:
    """Part ``index`` of ``n`` rows (or elements) cut into ``parts`` contiguous parts (sizes differ by <= 1)."""
    bounds = np.linspace(0, n, parts + 1).astype(int)
    return slice(bounds[index], bounds[index + 1])


def local_grad(net: Net, threads: int):
    return ThreadedGrad(net, threads) if threads > 1 else SerialGrad(net)


def score(logits: np.ndarray, y: np.ndarray) -> tuple[float, int]:
    """The summed cross-entropy and the number right of one chunk of a test set."""
    return SoftmaxCrossEntropy().forward(logits, y, total=1), int((logits.argmax(axis=1) == y).sum())


def evaluate(net: Net, x: np.ndarray, y: np.ndarray, chunk: int = 1000) -> tuple[float, int]:
    """``score`` summed over ``x``, the forward in chunks (a test set's activations at once would be large)."""
    parts = [score(net.forward(x[i:i + chunk]), y[i:i + chunk]) for i in range(0, len(x), chunk)]
    return sum(p[0] for p in parts), sum(p[1] for p in parts)
