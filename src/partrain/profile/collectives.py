"""Collective micro-benchmarks on the real backend, and the latency + size/bandwidth fit.

``measure_collectives`` runs in every worker of a process group (gloo on CPU, NCCL on
GPUs) and times allreduce, all-gather, reduce-scatter, broadcast and a send/recv
ping-pong over message sizes from 16 bytes to tens of megabytes. ``fit_cost`` turns
each sweep into the alpha-beta ("postal") model t(n) = latency + n / bandwidth (Hockney,
"The communication challenge for MPP", Parallel Computing 1994), fitted piecewise where
one line does not fit: small messages are latency-bound and often take another protocol
or algorithm than large ones (gloo switches allreduce algorithms with the size).

Everything here but ``measure_collectives`` is pure and needs no process group.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

COLLECTIVES = ("allreduce", "all_gather", "reduce_scatter", "broadcast", "sendrecv")


@dataclass(frozen=True)
class Segment:
    """t(n) = latency_s + n * seconds_per_byte, for message sizes up to ``upto_bytes``."""

    upto_bytes: float  # math.inf for the last segment
    latency_s: float
    seconds_per_byte: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second (inf when the fit found no size dependence)."""
        return math.inf if self.seconds_per_byte == 0 else 1.0 / self.seconds_per_byte

    def time(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.seconds_per_byte


@dataclass(frozen=True)
class CostFit:
    """A piecewise alpha-beta model of one collective at one group size."""

    segments: tuple[Segment, ...]

    def time(self, nbytes: float) -> float:
        for seg in self.segments:
            if nbytes <= seg.upto_bytes:
                return seg.time(nbytes)
        return self.segments[-1].time(nbytes)

    def scaled(self, latency_factor: float, volume_factor: float) -> CostFit:
        """The same links driven by another algorithm step count and traffic volume."""
        return CostFit(tuple(
            Segment(s.upto_bytes, s.latency_s * latency_factor, s.seconds_per_byte * volume_factor)
            for s in self.segments
        ))

    def to_dict(self) -> list[dict]:
        """Segments as JSON rows; ``bandwidth_gb_per_s`` is for the reader, ``seconds_per_byte`` is loaded."""
        return [
            {"upto_bytes": None if math.isinf(s.upto_bytes) else s.upto_bytes, "latency_s": s.latency_s,
             "seconds_per_byte": s.seconds_per_byte, "bandwidth_gb_per_s": None if s.seconds_per_byte == 0 else s.bandwidth / 1e9}
            for s in self.segments
        ]

    @classmethod
    def from_dict(cls, rows: list[dict]) -> CostFit:
        return cls(tuple(
            Segment(math.inf if r["upto_bytes"] is None else float(r["upto_bytes"]), float(r["latency_s"]),
                    float(r["seconds_per_byte"]))
            for r in rows
        ))

    @classmethod
    def line(cls, latency_s: float, bandwidth: float) -> CostFit:
        return cls((Segment(math.inf, latency_s, 1.0 / bandwidth),))


def fit_line(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """(latency, seconds per byte) minimising the squared *relative* error, both >= 0.

    Relative weights (1 / t^2) keep the microsecond points of small messages from being
    drowned by the millisecond points of large ones, as an unweighted fit over sizes
    spanning six orders of magnitude would.
    """
    w = [1.0 / t**2 for t in times]
    sw, sn, st = sum(w), sum(wi * n for wi, n in zip(w, sizes)), sum(wi * t for wi, t in zip(w, times))
    snn = sum(wi * n * n for wi, n in zip(w, sizes))
    snt = sum(wi * n * t for wi, n, t in zip(w, sizes, times))
    det = sw * snn - sn * sn
    if det > 0:
        slope = (sw * snt - sn * st) / det
        intercept = (st - slope * sn) / sw
        if slope >= 0 and intercept >= 0:
            return intercept, slope
    # constrained optimum on a boundary: the better of "no latency" and "no bandwidth term"
    slope_only = snt / snn if snn > 0 else 0.0
    latency_only = st / sw
    err = lambda a, b: sum(wi * (a + b * n - t) ** 2 for wi, n, t in zip(w, sizes, times))  # noqa: E731
    return min(((0.0, max(0.0, slope_only)), (max(0.0, latency_only), 0.0)), key=lambda ab: err(*ab))


def _max_relative_error(sizes, times, latency, spb) -> float:
    return max(abs(latency + spb * n - t) / t for n, t in zip(sizes, times))


def fit_cost(sizes: list[float], times: list[float], tolerance: float = 0.15, max_segments: int = 3) -> CostFit:
    """Piecewise alpha-beta fit: one line, split where its worst relative error exceeds ``tolerance``.

    The split point is the one that minimises the larger of the two halves' worst errors;
    each half needs at least two points. Segments are ordered by size.
    """
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    sizes, times = [float(sizes[i]) for i in order], [float(times[i]) for i in order]
    if len(sizes) < 2:
        raise ValueError("a latency/bandwidth fit needs at least two message sizes")
    return CostFit(tuple(_fit_segments(sizes, times, tolerance, max_segments, math.inf)))


def _fit_segments(sizes, times, tolerance, max_segments, upto) -> list[Segment]:
    latency, spb = fit_line(sizes, times)
    if max_segments == 1 or len(sizes) < 4 or _max_relative_error(sizes, times, latency, spb) <= tolerance:
        return [Segment(upto, latency, spb)]

    def worst(k: int) -> float:
        return max(_max_relative_error(sizes[:k], times[:k], *fit_line(sizes[:k], times[:k])),
                   _max_relative_error(sizes[k:], times[k:], *fit_line(sizes[k:], times[k:])))

    k = min(range(2, len(sizes) - 1), key=worst)
    left = _fit_segments(sizes[:k], times[:k], tolerance, 1, sizes[k - 1])
    return left + _fit_segments(sizes[k:], times[k:], tolerance, max_segments - 1, upto)


def default_sizes(max_bytes: int = 64 * 2**20) -> list[int]:
    """Powers of four from 16 bytes up to ``max_bytes``."""
    sizes, n = [], 16
    while n <= max_bytes:
        sizes.append(n)
        n *= 4
    return sizes


def repeats_for(nbytes: int) -> int:
    """Iterations per timing: many for tiny messages (microseconds), a few for large ones."""
    return max(3, min(30, round(8 * 2**20 / max(nbytes, 1))))


# ---- measurement (runs inside a process group) -------------------------------------------


def _op(name: str, nbytes: int, group, ranks: list[int], device):
    """A zero-argument callable running one ``name`` of ``nbytes`` on ``group``."""
    p = len(ranks)
    numel = max(p, nbytes // 4 // p * p)  # float32 elements, divisible by the group size
    full = torch.ones(numel, device=device)
    part = torch.empty(numel // p, device=device)
    if name == "allreduce":
        return lambda: dist.all_reduce(full, group=group)
    if name == "all_gather":  # nbytes is the gathered (output) size
        return lambda: dist.all_gather_single(full, part, group=group)
    if name == "reduce_scatter":  # nbytes is the input size
        return lambda: dist.reduce_scatter_single(part, full, group=group)
    if name == "broadcast":
        return lambda: dist.broadcast(full, src=ranks[0], group=group)
    raise ValueError(name)


def _ping_pong(nbytes: int, a: int, b: int, device):
    """One round trip between ranks ``a`` and ``b``; the one-way time is half of it."""
    buf = torch.ones(max(1, nbytes // 4), device=device)
    me = dist.get_rank()

    def run():
        if me == a:
            dist.send(buf, b)
            dist.recv(buf, b)
        elif me == b:
            dist.recv(buf, a)
            dist.send(buf, a)

    return run


def _timed(run, repeats: int, trials: int = 3) -> float:
    """Median over ``trials`` of the slowest rank's mean seconds per call."""
    run()  # warm-up: connections, buffers
    out = []
    for _ in range(trials):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        elapsed = torch.tensor([(time.perf_counter() - start) / repeats], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        out.append(elapsed.item())
    return statistics.median(out)


def _supported(run) -> bool:
    """Run once everywhere; True only if it ran on every rank (so all ranks skip alike)."""
    try:
        run()
        ok = 1
    except (RuntimeError, NotImplementedError):  # e.g. a backend without reduce-scatter
        ok = 0
    flag = torch.tensor([ok])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def measure_collectives(group, group_ranks: list[int], pair: tuple[int, int], sizes: list[int], device) -> tuple[dict, list[str]]:
    """Every rank of the world calls this; returns ({collective: [(bytes, seconds)]}, notes).

    The ranks of ``group_ranks`` run the collectives on ``group`` (ranks outside it, if
    any, only join the barriers); ``pair`` runs the send/recv ping-pong. A collective the
    backend lacks is skipped and named in the notes.
    """
    inside = dist.get_rank() in group_ranks
    results: dict[str, list[tuple[int, float]]] = {}
    notes: list[str] = []
    for name in COLLECTIVES:
        if name == "sendrecv":
            results[name] = [(n, _timed(_ping_pong(n, *pair, device), repeats_for(n)) / 2) for n in sizes]
            continue
        make = (lambda n: _op(name, n, group, group_ranks, device)) if inside else (lambda n: (lambda: None))
        if not _supported(make(sizes[0])):
            notes.append(f"{name} skipped: the {dist.get_backend()} backend does not run it")
            continue
        results[name] = [(n, _timed(make(n), repeats_for(n))) for n in sizes]
    return results, notes
