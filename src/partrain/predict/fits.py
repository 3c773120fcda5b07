"""The latency + size/bandwidth fit of collective timings, and the fitted curves themselves.

``fit_cost`` turns a sweep of timings into the alpha-beta ("postal") model
t(n) = latency + n / bandwidth (Hockney, "The communication challenge for MPP", Parallel
Computing 1994), fitted piecewise where one line does not fit: small messages are
latency-bound and often take another protocol or algorithm than large ones (gloo switches
allreduce algorithms with the size). Pure Python: ``profile.collectives`` measures with torch
and fits here; the predictor reads the fits from a hardware profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# fsdp_unit: a fully_shard unit's collectives as FSDP drives them (profile.collectives)
COLLECTIVES = ("allreduce", "all_gather", "reduce_scatter", "broadcast", "sendrecv", "fsdp_unit")


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

    def segment(self, nbytes: float) -> Segment:
        """The segment that prices a message of ``nbytes``."""
        return next((seg for seg in self.segments if nbytes <= seg.upto_bytes), self.segments[-1])

    def time(self, nbytes: float) -> float:
        return self.segment(nbytes).time(nbytes)

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


def _relative_rms(sizes, times, latency, spb) -> float:
    return math.sqrt(sum(((latency + spb * n - t) / t) ** 2 for n, t in zip(sizes, times)) / len(sizes))


def monotone(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool-adjacent-violators; Ayer et
    al., Ann. Math. Statist. 1955): a larger message never costs less, so a timing that dips
    below a smaller one's is noise, averaged with its neighbours instead of bending the fit."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


def fit_cost(sizes: list[float], times: list[float], tolerance: float = 0.1, max_segments: int = 3) -> CostFit:
    """Piecewise alpha-beta fit: one line, or, where its RMS relative error exceeds
    ``tolerance``, the fewest segments (up to ``max_segments``) that bring it within, or the
    best of ``max_segments``.

    The timings are first made non-decreasing in the size (``monotone``). Each segment holds
    at least three points (so that a single noisy timing never gets a line of its own), and
    of all the ways to cut the sizes into that many segments the one with the least summed
    squared relative error wins. (Cutting one point at a time, the first cut taken alone, put
    a 100 Mbit/s link's 16 KiB-4 MiB messages on one line at 19 MB/s: its 16 KiB point pulled
    the slope down, and 4 MiB messages came out 36% short of their measured 346 ms.) Segments
    are ordered by size.
    """
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    # a difference of two timings (fsdp_unit) can come out as zero: a nanosecond, not a division by zero
    sizes, times = [float(sizes[i]) for i in order], monotone([max(float(times[i]), 1e-9) for i in order])
    if len(sizes) < 2:
        raise ValueError("a latency/bandwidth fit needs at least two message sizes")
    cuts: tuple[int, ...] = ()
    for m in range(2, max_segments + 1):
        if _rms_of(sizes, times, cuts) <= tolerance or len(sizes) < 3 * m:
            break
        cuts = min(_cuts(len(sizes), m), key=lambda c: _sum_of_squares(sizes, times, c))
    bounds = (0, *cuts, len(sizes))
    return CostFit(tuple(Segment(sizes[b - 1] if b < len(sizes) else math.inf, *fit_line(sizes[a:b], times[a:b]))
                         for a, b in zip(bounds, bounds[1:])))


def _cuts(n: int, m: int, least: int = 3, start: int = 0) -> list[tuple[int, ...]]:
    """Every way to cut points start..n-1 into m runs of at least ``least``: the cut indices."""
    if m == 1:
        return [()] if n - start >= least else []
    return [(k, *rest) for k in range(start + least, n - least * (m - 1) + 1) for rest in _cuts(n, m - 1, least, k)]


def _sum_of_squares(sizes, times, cuts) -> float:
    """Summed squared relative error of a line fitted to each run between ``cuts``."""
    bounds = (0, *cuts, len(sizes))
    return sum((b - a) * _relative_rms(sizes[a:b], times[a:b], *fit_line(sizes[a:b], times[a:b])) ** 2
               for a, b in zip(bounds, bounds[1:]))


def _rms_of(sizes, times, cuts) -> float:
    return math.sqrt(_sum_of_squares(sizes, times, cuts) / len(sizes))


def longest_increasing(points: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """The most of ``points`` ((x, y) pairs in the order they were measured, each meant to have
    a larger x than the one before) whose x do rise in that order; of equally many, those
    ending lowest. A point that a disturbance moved out of place is dropped rather than
    sorted in among the others: the pipeline probe over idle stages once read 1.6 ms an
    action instead of about 0.05 while another job shared the machine, and sorted by x its
    hop stood for stages of 1.6 ms."""
    if not points:
        return ()
    length, prev = [], []
    for i, (x, _) in enumerate(points):
        before = [j for j in range(i) if points[j][0] < x]
        j = max(before, key=lambda j: (length[j], -points[j][0]), default=None)
        length.append(1 if j is None else length[j] + 1)
        prev.append(j)
    i, out = max(range(len(points)), key=lambda i: (length[i], -points[i][0])), []
    while i is not None:
        out.append(points[i])
        i = prev[i]
    return tuple(reversed(out))


def held_interpolation(points, x: float) -> float:
    """Piecewise-linear y at ``x`` through ``points`` ((x, y) pairs, sorted by x), held at the
    first and last y outside them: a measured curve is not extrapolated."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return points[-1][1]


def nondecreasing(points) -> tuple:
    """``points`` ((x, y) pairs, sorted by x) with each y raised to at least the one before it
    (a running maximum): for a curve that cannot fall, a dip is the noise of its measurement."""
    top, out = float("-inf"), []
    for x, y in points:
        top = max(top, y)
        out.append((x, top))
    return tuple(out)


def default_sizes(max_bytes: int = 64 * 2**20) -> list[int]:
    """Powers of four from 16 bytes up to ``max_bytes``."""
    sizes, n = [], 16
    while n <= max_bytes:
        sizes.append(n)
        n *= 4
    return sizes
