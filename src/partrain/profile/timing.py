"""Timing statistics the profiler shares: medians that a burst of other work cannot move, and
the clock that times work on the device that runs it (``Stopwatch``)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

MIN_REPEATS, MAX_REPEATS, TARGET_S = 3, 50, 0.25  # timed runs per measurement: at least 3, about 0.25 s
# on a GPU, CUDA events time the device itself and other processes' CPU load does not move
# them: a fifth of the samples does, and a resnet50's profile is seconds shorter for it
CUDA_TARGET_S = 0.05


def median_times(run: Callable[[], tuple[float, ...]], warm_up: bool = True,
                  max_repeats: int = MAX_REPEATS, target_s: float = TARGET_S) -> list[float]:
    """Per component, the median seconds ``run`` reports, after one warm-up call (unless the
    caller has just run the same work).

    The samples are split in their first and second half and the lower median is kept: a
    burst of work from another process during one half does not move the result.
    """
    if warm_up:
        run()
    samples: list[tuple[float, ...]] = []
    while len(samples) < MIN_REPEATS or (sum(map(sum, samples)) < target_s and len(samples) < max_repeats):
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


class Stopwatch:
    """Marks along a piece of work and the seconds between them, on the device that does it.

    On CPU the host's clock. On a GPU, CUDA events recorded on the current stream, read after
    one synchronisation at the end (``laps``): the device's own timeline. The work starts on
    an idle device (``start`` synchronises first), so a lap is the longer of the GPU's time
    and the host's time to enqueue the kernels, which is what a step of a small model costs
    (launch-bound) as well as of a large one (GPU-bound). Cost: one synchronisation before and
    one after, a few microseconds each.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.marks: list = []

    def start(self) -> Stopwatch:
        if self.cuda:
            torch.cuda.synchronize()
        self.marks = []
        self.mark()
        return self

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def laps(self) -> tuple[float, ...]:
        """Seconds between consecutive marks (the last mark is taken now)."""
        self.mark()
        if self.cuda:
            self.marks[-1].synchronize()
            return tuple(a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:]))  # ms -> s
        return tuple(b - a for a, b in zip(self.marks, self.marks[1:]))


def timed(fn: Callable[[], object], device: torch.device | str = "cpu") -> Callable[[], tuple[float]]:
    """A ``median_times`` run of ``fn``: its seconds on ``device`` (``Stopwatch``)."""
    watch = Stopwatch(device)

    def run() -> tuple[float]:
        watch.start()
        fn()
        return watch.laps()

    return run


def core_cache_bytes() -> int:
    """Bytes of a core's level-2 cache (its own, or its SMT siblings'), from sysfs; 2 MiB where
    it does not say."""
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = (index / "level").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if level == "2" and size[:-1].isdigit():
            return int(size[:-1]) * {"K": 2**10, "M": 2**20}.get(size[-1], 1)
    return 2 * 2**20


_EVICT: list[torch.Tensor] = []


def evict_caches() -> None:
    """Write over four times a core's L2 cache: the state a pipeline stage's action starts in
    where the node's workers outnumber its cores, another worker having run on the core while
    it waited (``BlockProfile.fwd_cold_s``). On a 2-core VM (2 MiB L2) a LayerNorm/GELU block's
    forward and backward at 4 samples took 0.15 ms back to back, 0.25 ms after writing as much
    as the L2 holds, 0.29 ms after twice, 0.35 ms after four and after sixteen times; the same
    block inside a 4-stage pipeline on 4 workers ran 0.58 ms, the runtime's own work included."""
    if not _EVICT:
        _EVICT.append(torch.empty(4 * core_cache_bytes() // 4))
    _EVICT[0].add_(1.0)


def cold_run(forward: Callable[[], object], backward: Callable[[object], object],
             prepare: Callable[[], object] = lambda: None) -> Callable[[], tuple[float, float]]:
    """A ``median_times`` run of (forward seconds, backward seconds), each started with the caches
    written over (``evict_caches``), after the untimed ``prepare``: ``backward`` takes ``forward``'s output."""
    def run() -> tuple[float, float]:
        prepare()
        evict_caches()
        start = time.perf_counter()
        out = forward()
        forward_s = time.perf_counter() - start
        evict_caches()
        start = time.perf_counter()
        backward(out)
        return forward_s, time.perf_counter() - start

    return run


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds every process has used, CPU seconds this one and its children have), from /proc/stat."""
    from partrain.distributed.spawn import fork_server_cpu_s

    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    busy = sum(int(v) for i, v in enumerate(fields) if i not in (3, 4))  # all but idle and iowait
    # this process, the children it waited for (the memory probe) and the workers its fork server
    # forked and waited for: what is left is the others'
    children = os.times()
    own = time.process_time() + children.children_user + children.children_system + fork_server_cpu_s()
    return busy / os.sysconf("SC_CLK_TCK"), own


def others_share(before: tuple[float, float], after: tuple[float, float], wall: float) -> float:
    """The share of all cores that other processes kept busy over ``wall`` seconds: time
    measured while they ran is inflated, and the profile says so."""
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others / (wall * (os.cpu_count() or 1)))
