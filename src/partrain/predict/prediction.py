"""What a prediction says about a plan, and where the plan runs (threads, contention, speed).

Every strategy's cost (``data_parallel``, ``pipeline``, ``predictor``'s serial) returns a
``Prediction``; a step is what ``train.py`` times on rank 0: loading its rows,
``Stepper.train_step`` (forward, backward, communication, optimizer).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from partrain.predict import compute
from partrain.predict.comm import collective_time
from partrain.predict.fits import held_interpolation, nondecreasing
from partrain.predict.memory import MemoryBreakdown
from partrain.predict.plan import Plan, local_workers, threads_for
from partrain.predict.profiles import HardwareProfile, ModelProfile


@dataclass(frozen=True)
class Prediction:
    plan: Plan
    seconds_per_step: float
    steps_per_epoch: int
    compute_s: float  # forward and backward on the measured worker
    comm_s: float  # communication the computation does not hide
    bubble_s: float  # pipeline idle time
    optimizer_s: float
    data_s: float  # loading the worker's rows
    memory: MemoryBreakdown  # the worker with the largest peak
    memory_per_worker: tuple[int, ...]
    notes: tuple[str, ...] = field(default=())
    occasional_s: float = 0.0  # part of seconds_per_step paid by only a few steps (local SGD's averaging)

    @property
    def seconds_per_epoch(self) -> float:
        return self.seconds_per_step * self.steps_per_epoch

    @property
    def median_step_s(self) -> float:
        """The typical step, what a median of step times measures: without averaging that
        happens on fewer than half of the steps."""
        return self.seconds_per_step - self.occasional_s

    @property
    def memory_bytes_per_worker(self) -> int:
        return max(self.memory_per_worker)

    def fits(self, memory_limit: float) -> bool:
        """True when every worker's predicted peak is within ``memory_limit`` bytes."""
        return self.memory_bytes_per_worker <= memory_limit

    def to_dict(self) -> dict:
        return {
            "plan": asdict(self.plan), "label": self.plan.label(), "seconds_per_step": self.seconds_per_step,
            "seconds_per_epoch": self.seconds_per_epoch, "steps_per_epoch": self.steps_per_epoch,
            "compute_s": self.compute_s, "comm_s": self.comm_s, "bubble_s": self.bubble_s,
            "optimizer_s": self.optimizer_s, "data_s": self.data_s, "median_step_s": self.median_step_s,
            "memory_bytes_per_worker": self.memory_bytes_per_worker, "memory_per_worker": list(self.memory_per_worker),
            "memory": {**asdict(self.memory), "total": self.memory.total}, "notes": list(self.notes),
            "cli_args": self.plan.cli_args(),
        }


@dataclass(frozen=True)
class Env:
    """Where a plan runs: threads, contention, speed."""

    threads: int
    local_workers: int
    nodes_used: int
    cores: int  # per node
    speed: float  # compute_speed of the hardware relative to the profiling machine
    sharing: dict[int, float]  # measured slowdown of k single-threaded workers computing side by side
    # one synchronisation of the workers after they computed side by side, beyond the collective
    # itself (measured by the hardware probe; 0 if not): with more busy workers than cores, the
    # last to finish its share of the cores sets when the collective can start, and a waiting
    # worker wakes only when a core is free. The collective probes time idle workers, which do
    # not pay it; every strategy that synchronises after computing does (DDP, local SGD when it
    # averages, FSDP, a hybrid's replicas)
    sync_s: float
    shared_cores: int = 0  # nodes on one machine share its cores (``HardwareProfile.shared_cores``); 0: not
    sync_compute_s: float = 0.0  # the compute per worker before the synchronisation sync_s timed; 0: unknown
    # on one machine (more workers than cores too, since MEASUREMENT 25), or over nodes where the
    # profile probed its world across them:
    # by the bytes the probe reduced, (seconds each computed side by side, what the step paid beyond
    # that compute, its allreduce included), by compute (``environment``); empty: ``sync_s``
    sync_points: tuple[tuple[int, tuple[tuple[float, float], ...]], ...] = ()
    # seconds the sweep's fit gives an allreduce of n bytes over the probe's ranks (with ``sync_points``)
    sync_fit: Callable[[float], float] | None = field(default=None, compare=False)

    def sync_after(self, compute_s: float, nbytes: float) -> float:
        """What one synchronisation of ``nbytes`` costs a step whose workers computed
        ``compute_s`` each, side by side, since their last one, beyond the collective's own
        cost in the sweep.

        Where the hardware profile's step probe ran these workers, what it paid at that
        compute (``sync_points``, interpolated, held at its ends; ``HardwareProfile.step_sync``)
        and those bytes (between the sizes it probed, linear in them), less the sweep's fit of
        that allreduce; beyond the probed sizes, the nearest one's excess over its fit. It may
        be negative, where a step pays less than the mean of back-to-back calls the sweep
        fitted (``profile.step_probes.measure_step_sync`` says why). Between probed sizes the
        probe, not the fit, says what the bytes cost: a sweep's fit over 4 emulated nodes at
        10 Gbit/s put 1 MiB at 11.1 ms and 1.6 MB at 6.9 (its points' noise), where the probe
        paid 8.6-11.0 ms for 1 MiB and 12.5-15.9 for 4 MiB after computing. Otherwise
        ``sync_s``, the probe's cost times ``compute_s`` over the compute it
        timed it after, at most all of it. The slowest worker's lead grows with how long they
        share the cores: the probe computed 11.4 ms each side by side (4 workers on 2 cores)
        and read 2.9 ms, where the mlp's 4-worker DDP and local SGD steps, 0.6 ms of compute
        each, ran 20-43% under predictions that added it whole, across emulated nodes as on
        one machine; issue 17's small models on 4 workers, 1-3 ms, 15-53%. Scaled, issue
        18's DDP cells read 7.4% (11.7% whole), local SGD 6.6% (8.4%); issue 17's 8.7% (10.0%)
        and 10.7% (12.7%) (session 59, an AMD EPYC VM)."""
        if self.sync_points:
            paid = [(n, held_interpolation(points, compute_s)) for n, points in self.sync_points]
            n = min(max(nbytes, paid[0][0]), paid[-1][0])  # beyond the probed sizes, the nearest one's excess
            return held_interpolation(paid, n) - self.sync_fit(n)
        if self.sync_compute_s <= 0:
            return self.sync_s
        return self.sync_s * min(1.0, compute_s / self.sync_compute_s)

    def sharing_slowdown(self, busy_workers_per_node: float) -> float:
        """Compute time of a worker while ``busy_workers_per_node`` compute on its node, over
        its time alone: measured by the hardware profile for single-threaded workers (cores,
        SMT siblings, caches and memory bandwidth shared), never below processor sharing of
        the cores (more busy threads than cores cannot each run faster than cores / threads of one).

        Nodes that share one machine's cores (emulated nodes) contend machine-wide: the busy
        workers of all the plan's nodes against the cores they share, and the measured factor of
        as many workers side by side on that machine (why: ``bench.nodes.shares_cores``)."""
        busy, cores = busy_workers_per_node, self.cores
        if self.shared_cores:
            busy, cores = busy_workers_per_node * self.nodes_used, self.shared_cores
        measured = self.sharing.get(round(busy)) if self.threads == 1 else None
        return max(measured or 1.0, compute.contention(busy * self.threads, cores))

    def oversubscribed(self) -> bool:
        """More threads of the plan's workers than cores to run them (machine-wide for nodes
        that share one machine's cores): a worker that waits gives its core to another, whose
        work writes over the caches the waiting one comes back to (``compute.block_times``'s cold)."""
        busy, cores = self.local_workers, self.cores
        if self.shared_cores:
            busy, cores = busy * self.nodes_used, self.shared_cores
        return busy * self.threads > cores

    def slowdown(self, busy_workers_per_node: float) -> float:
        """``sharing_slowdown`` on this hardware's compute speed."""
        return self.sharing_slowdown(busy_workers_per_node) / self.speed


def environment(hw: HardwareProfile, plan: Plan) -> Env:
    local, threads = local_workers(plan.workers, hw), threads_for(plan.workers, hw, plan.threads)
    nodes = math.ceil(plan.workers / local)
    # the step probe timed workers with a core each: not nodes that share one machine's fewer cores
    # (emulated 2 x 2 nodes on 2 cores at 10 Gbit/s read DDP and local SGD 39-41% under with it, 26-29% without)
    fits_cores = not hw.shared_cores or local * nodes <= hw.shared_cores
    # over nodes the whole world synchronises across them: the profile's probe over its world
    # across the nodes where it took one for as many workers, whether or not they outnumber the
    # cores (it ran them as the plan runs), else its node's first ranks'
    across = nodes > 1 and plan.workers in hw.step_sync
    group = plan.workers if across else local
    probed = hw.step_sync.get(group, {}) if plan.workers > 1 and (across or fits_cores) else {}
    # what a step pays after computing rises with the compute (the longer the workers compute, the
    # further apart they finish): a point below the one before it is that probe's noise. The step
    # probe of 2 workers in issue 17's run92u read 0.98 ms after 2.1 ms of compute, 1.39 after 0.7
    # and 1.83 after 7.7: the gallery's 2-worker DDP and local SGD cells, whose gradients sit at
    # that point, all read under (8 of 8 each); held rising, the pass read 9.0%, not 9.6%, its
    # top-1 100%, not 75%, and three other passes moved by 0.1 point at most
    points = tuple((n, nondecreasing(sorted(steps))) for n, steps in sorted(probed.items()))
    return Env(threads, local, nodes, hw.cores_per_node, hw.compute_speed,
               hw.compute_sharing, hw.sync_s.get(local, 0.0) if plan.workers > 1 else 0.0, hw.shared_cores,
               hw.sync_compute_s.get(local, 0.0), points,
               lambda n: collective_time(hw, "allreduce", n, list(range(group))))  # over the probe's ranks


def _baseline(profile: ModelProfile, hw: HardwareProfile, workers: int) -> dict:
    return {"baseline": profile.baseline_rss_bytes, "baseline_peak": profile.baseline_peak_rss_bytes,
            "process_group": hw.process_group_rss_bytes if workers > 1 else 0}


def _steps_per_epoch(profile: ModelProfile, plan: Plan) -> int:
    return max(1, profile.train_samples // plan.batch_size)  # train.py drops the last partial batch
