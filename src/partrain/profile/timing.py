"""Timing statistics the profiler shares: medians that a burst of other work cannot move."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

MIN_REPEATS, MAX_REPEATS, TARGET_S = 3, 50, 0.25  # timed runs per measurement: at least 3, about 0.25 s


def median_times(run: Callable[[], tuple[float, ...]], warm_up: bool = True,
                  max_repeats: int = MAX_REPEATS) -> list[float]:
    """Per component, the median seconds ``run`` reports, after one warm-up call (unless the
    caller has just run the same work).

    The samples are split in their first and second half and the lower median is kept: a
    burst of work from another process during one half does not move the result.
    """
    if warm_up:
        run()
    samples: list[tuple[float, ...]] = []
    while len(samples) < MIN_REPEATS or (sum(map(sum, samples)) < TARGET_S and len(samples) < max_repeats):
        samples.append(run())
    return [lower_half_median([s[i] for s in samples]) for i in range(len(samples[0]))]


def lower_half_median(samples: list[float]) -> float:
    """The lower of the medians of the first and the second half of ``samples``: a burst of
    other work in one half does not move it. Of three, the median; of two, the lower: a big
    model's world-of-one run times 2 steps, and their mean would take half of one slow step
    into the loop's overhead (resnet18 at batch 4 ran 161 ms a step in one profile, 245 in
    the next)."""
    if len(samples) < 4:
        return statistics.median(samples) if len(samples) == 3 else min(samples)
    half = len(samples) // 2
    return min(statistics.median(samples[:half]), statistics.median(samples[half:]))


def timed(fn: Callable[[], object]) -> Callable[[], tuple[float]]:
    def run() -> tuple[float]:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start,)

    return run
