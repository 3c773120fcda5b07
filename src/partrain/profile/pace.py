"""The machine's pace over a profile, so that the memory probe's loop timings are not one throw
of the dice.

On the 2-vCPU VM partrain is developed on, a core runs at one of two speeds in spells of one to
four seconds: the gallery's tokens3d model's step at batch 32, timed in 0.1 s windows over 20 s
with nothing else running, took 1.12-1.3 ms in some spells and 1.7-2.1 in others. The memory
probe (``profile.probe``) times the serial loop in about a second of its own, so it lands in one
or two spells: ten profiles of that model in a row read its world-of-one serial step at batch
4 at 1.08-2.24 ms, and every prediction of the model moved with it (issue 17's run63u: its
serial cell at batch 32 measured 1.68 ms, predicted 3.40). The same bare step timed in windows
spread over 6 s read 1.05-1.28 ms in nine spans.

So the bare serial step at the smallest profiled batch size (load a new batch, forward, loss,
backward, SGD-momentum step: what the probe's bare loop times) is sampled in short windows at
points spread over the whole profile, by the profiler at its phases and by the probe around its
own timings. The probe's time figures are scaled by the median of all the windows over the
median of the probe's own (``probe_pace``): the probe's figures then stand at the machine's
pace over the whole profile, not the pace of the second the probe happened to run in. Each
of the 13 windows costs about ``WINDOW_S`` (or one step of a bigger model): about 0.4 s of a
small gallery model's 6-7 s profile. Spells longer than the profile it cannot see through.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn as nn

from partrain.predict.profiles import ModelProfile
from partrain.profile.numerics import autocast, place_input
from partrain.strategies.base import loss_fn

# a window: about 30 ms, at least one step (resnet18's of 0.19 s at batch 8: 13 windows, 2.5 s of
# its 62 s profile; the median over the windows is what counts)
WINDOW_S, MIN_STEPS = 0.03, 1
# before a window taken after other processes ran (``Pace.sample(warm=True)``: a benchmark's
# pace window after a cell, its process having waited on the cell's): the step runs untimed this
# long first. A process that waited runs its first tenths of a second slow: tokens3d's bare step
# after a quiet second, 30 rounds on the AMD VM (session 94), x1.18 its later pace over the first
# 25 ms, x1.07 at 25-50, x1.04 at 50-75, x1.02 at 75-100, within 1% from 250 ms; a window after
# one untimed step read the slow level where one 0.3 s later read the fast one in 4 of 15
# rounds after a child's 1.5 s of compute. The cells it paces are seconds of steps, their median
# past the ramp: the windows beside run108u's cells read tokens3d's profile at x0.90 where its
# cells ran at about x0.7. Cost: this much wall time a window, one a model every 30 s: at 0.25 s
# (session 94) the 19-25 windows beside each model's cells took 5-7 s of its 14-26 s profile in
# run110u, the profile cost 7.3% of the cells' time (5.2% in run108u, one step); at 0.1 s a window
# starts where the ramp is within 2% (x1.02 at 75-100 ms), for 0.15 s less each.
WAKE_S = 0.1


def still_sgd(net: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum whose steps leave the weights what they were (learning rate 1e-12)."""
    return torch.optim.SGD(net.parameters(), lr=1e-12, momentum=0.9)


def bare_step(net: nn.Module, opt: torch.optim.Optimizer, train_set, batch: int, run: dict) -> Callable[[], None]:
    """One bare serial training step of ``net`` with ``opt`` (``still_sgd``) on a new batch of
    ``batch`` random rows of ``train_set`` (``run``: device, precision, channels_last), as the
    training loop loads one: reading it evicts part of what the last step left in the cache
    (MNIST at batch 128: a step 1.3 ms over the bare step on one batch, where the loading alone
    took 1.0). The gradients are left set (``zero_grad`` first, as the loop does): a caller
    that goes on to time backward passes of ``net`` clears them."""
    device, n = torch.device(run["device"]), len(train_set)

    def step() -> None:
        x, y = train_set.get(torch.randint(0, n, (batch,)))
        x = place_input(x, device, run["channels_last"])
        opt.zero_grad(set_to_none=True)
        with autocast(device, run["precision"]):
            loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()

    return step


def window(step: Callable[[], None], window_s: float = WINDOW_S) -> float:
    """Median seconds of ``step`` over at least ``MIN_STEPS`` calls and about ``window_s``."""
    times, start = [], time.perf_counter()
    while len(times) < MIN_STEPS or time.perf_counter() - start < window_s:
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def paired_ratios(step: Callable[[], None], reference: Callable[[], None], target_s: float) -> list[float]:
    """``step``'s seconds over ``reference``'s right after it, one ratio a pair, pairs until
    ``step`` has taken about ``target_s`` (at least one pair). A spell of the host (``Pace``)
    lasts seconds and slows both sides of a pair alike, where it moves a step timed on its own:
    tokens3d's bare step at batch 64 read 5.67 ms in one profile and 4.21 in the next, 2.8x and
    1.9x its step at batch 4 (cells at batch 32 and 128: 2.39 and 7.59 ms). Each pair runs
    ``reference`` twice and times the second, as a pace window does: after the larger step it
    would start on a cache that step wrote over. Cost: ``step`` plus twice ``reference`` a pair."""
    ratios, spent = [], 0.0
    while not ratios or spent < target_s:
        start = time.perf_counter()
        step()
        mid = time.perf_counter()
        reference()
        ref_start = time.perf_counter()
        reference()
        end = time.perf_counter()
        ratios.append((mid - start) / max(end - ref_start, 1e-9))
        spent += mid - start
    return ratios


class Pace:
    """Windows of one bare step, sampled at the points a profile calls ``sample`` at."""

    def __init__(self, step: Callable[[], None], after: Callable[[], None] | None = None):
        self.step, self.after, self.windows = step, after, []
        step()  # warm: the momentum buffers and the allocator's pages exist before any window

    @classmethod
    def of(cls, net: nn.Module, train_set, batch: int, run: dict) -> Pace:
        """The pace of ``net``'s bare step (``bare_step``) at ``batch``; the windows leave no gradient behind."""
        return cls(bare_step(net, still_sgd(net), train_set, batch, run), after=lambda: net.zero_grad(set_to_none=True))

    def sample(self, warm: bool = False) -> None:
        """A window of the step; ``warm``: after ``WAKE_S`` of untimed steps (at least one), for a
        window right after other processes ran (a benchmark's cell), whose first steps run on
        caches they wrote over and at the slow pace of a process that waited."""
        if warm:
            start = time.perf_counter()
            self.step()
            while time.perf_counter() - start < WAKE_S:
                self.step()
        self.windows.append(window(self.step))
        if self.after is not None:
            self.after()


def probe_pace(profiler: list[float], probe: list[float]) -> float:
    """What the probe's time figures are multiplied by: the median window over the whole
    profile (``profiler``'s windows and ``probe``'s together) over the median of ``probe``'s
    own. 1 where either side took none."""
    if not profiler or not probe:
        return 1.0
    return statistics.median(profiler + probe) / statistics.median(probe)


def at_pace(memory: dict, factor: float) -> dict:
    """The probe's figures (``probe.measure_memory``) with its times multiplied by ``factor``:
    the bare loop, every strategy's world-of-one step and the replica wrapper's cost."""
    return {**memory, "bare_loop": [t * factor for t in memory.get("bare_loop", [])],
            "world_of_one": {k: t * factor for k, t in memory.get("world_of_one", {}).items()},
            "replica_wrapper": memory.get("replica_wrapper", 0.0) * factor}


def later_pace(profile: ModelProfile) -> float:
    """The mean of all ``profile``'s pace windows over the mean of its own; 1 where either side
    took none. The mean, not the median: on a machine of two speeds the windows beside the cells
    fall at both, and their median jumps from one level to the other as the share of slow
    windows crosses a half (a factor of 1 or of 1.4 for much the same hour), where the mean moves
    with that share; on a steady machine the two agree. Read both ways over issue 17's run100u
    and run103u and issue 18's run102n (session 91): 13.9%, 14.9%, 10.9% MAPE with the mean,
    13.3%, 17.6%, 13.3% with the median, the worst cell lower in all three; run104u, taken
    after this was chosen, 14.5% and 14.7% (docs/predictions.md)."""
    if not profile.pace_s or not profile.later_pace_s:
        return 1.0
    return statistics.fmean(profile.pace_s + profile.later_pace_s) / statistics.fmean(profile.pace_s)


def at_later_pace(profile: ModelProfile) -> ModelProfile:
    """``profile`` with every time figure at the machine's pace over the profile and the windows
    taken after it (``ModelProfile.later_pace_s``): multiplied by the mean of all its windows
    over the mean of its own (``later_pace``). A profile is a few seconds of the machine, and this 2-vCPU VM
    runs in spells of minutes too: in issue 18's run73n the mlp's 300-step serial loop read 1.53
    ms before the pass and 2.15 after, and its profile, taken in a fast one, read its 2-node cells
    21% under; ``bench --profile`` samples the same step beside the cells the profile predicts,
    so the cells are predicted at the pace of the hour they ran in, not of their profile's
    seconds. The profile itself as it is where either side took no window."""
    if (factor := later_pace(profile)) == 1.0:
        return profile

    def times(values: list[float]) -> list[float]:
        return [t * factor for t in values]

    def each(by_kind: dict) -> dict:
        return {k: t * factor for k, t in by_kind.items()}

    blocks = [replace(b, fwd_s=times(b.fwd_s), bwd_s=times(b.bwd_s), fwd_cold_s=times(b.fwd_cold_s),
                      bwd_cold_s=times(b.bwd_cold_s), optimizer_s=each(b.optimizer_s)) for b in profile.blocks]
    return replace(profile, blocks=blocks, loss_s=times(profile.loss_s), data_s=times(profile.data_s),
                   optimizer_s=each(profile.optimizer_s), replica_wrapper_s=profile.replica_wrapper_s * factor,
                   world_of_one_s=each(profile.world_of_one_s), loop_s=times(profile.loop_s),
                   chain_s=[times(c) for c in profile.chain_s],
                   accumulate_s=None if profile.accumulate_s is None else profile.accumulate_s * factor)
