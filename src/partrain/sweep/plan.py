"""How to spend W workers on a sweep: which k (workers per trial) finishes soonest.

With ``--per-trial k``, W / k trials run side by side, each k-way data parallel (k = 1: one
serial trial per worker). A sweep of N trials then takes about ceil(N / (W / k)) waves of
one trial's time (the brief's model; trials of unequal length even out over many waves).
One trial's time, from the same profiles and predictor as ``partrain predict``:

    trial = epochs x steps per epoch x step time  +  epochs x evaluation
    step  = predict_plan(serial or ddp x k) with its compute stretched by the slowdown of
            W busy workers on the node over the k the prediction assumes (the hardware
            profile's measured compute sharing: cores, caches, memory bandwidth)

averaged over the trial configurations the space draws (every grid point, or a uniform
sample), plus what starting a trial costs, which no profile holds: reading the data,
building the model and, for k > 1, starting k worker processes and their process group.
``measure_start`` times that once per k: a one-step run of the trial's own kind.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

from partrain.config import RunConfig
from partrain.sweep.space import Dimension, trial_config


@dataclass
class KPlan:
    k: int
    slots: int  # trials side by side
    waves: int
    step_s: float  # mean predicted step of one trial, with the other slots computing beside it
    steps: float  # mean optimizer steps per trial
    trial_s: float
    sweep_s: float
    comm_s: float  # of step_s: the gradient allreduce backward does not hide
    slowdown: float  # compute stretch from the other slots
    start_s: float = 0.0  # starting one trial: data, model, and k > 1 worker processes (measured)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def sample_configs(dims: list[Dimension], base: RunConfig, sampler: str, grid_points: int, n: int = 64,
                   seed: int = 0) -> list[RunConfig]:
    """The trial configurations a sweep will draw: the whole grid, or ``n`` uniform draws."""
    if sampler == "grid":
        grid = [{}]
        for d in dims:
            grid = [{**g, d.name: v} for g in grid for v in d.grid(grid_points)]
        return [trial_config(base, g) for g in grid]
    rng = random.Random(seed)

    def draw(d: Dimension):
        if d.choices is not None:
            return rng.choice(d.choices)
        if d.log:
            v = math.exp(rng.uniform(math.log(d.low), math.log(d.high)))
        else:
            v = rng.uniform(d.low, d.high)
        return round(v) if d.integer else v

    return [trial_config(base, {d.name: draw(d) for d in dims}) for _ in range(n)]


def profile_sizes(configs: list[RunConfig], workers: int) -> list[int]:
    """Batch sizes the model profile must cover: every trial's rows per worker, for every k."""
    from partrain.predict.plan import profile_batch_sizes

    return profile_batch_sizes([c.batch_size / k for c in configs for k in divisors(workers)])


def divisors(workers: int) -> list[int]:
    return [k for k in range(1, workers + 1) if workers % k == 0]


MAX_SHAPES = 4  # distinct model shapes (width x depth) profiled one by one; beyond, the base model stands for all


def measure_start(base: RunConfig, k: int) -> float:
    """Seconds to start one trial with k workers and take one step: a run of the trial's own
    kind (serial in this process, or ddp x k spawned), without evaluation."""
    import time

    from partrain.runner import run_training

    cfg = base.replace(strategy="serial" if k == 1 else "ddp", workers=k, steps=1, evaluate=False, epochs=1,
                       batch_size=max(k, base.batch_size - base.batch_size % k))
    start = time.perf_counter()
    run_training(cfg, show_progress=False)
    return time.perf_counter() - start


def plan_sweep(configs: list[RunConfig], base: RunConfig, trials: int, workers: int, profile_for, hardware_for,
               start_for=lambda k: 0.0) -> list[KPlan]:
    """Predicted sweep time for every k that divides ``workers``, fastest first.

    ``profile_for(model_options)``: the model profile of that shape at the threads each worker
    gets; ``hardware_for(n)``: the hardware profile for n local workers (this machine's,
    measured and cached, or a cluster file); ``start_for(k)``: seconds to start a trial."""
    from partrain.data import dataset_spec
    from partrain.predict import compute
    from partrain.predict.plan import Plan
    from partrain.predict.prediction import environment
    from partrain.predict.predictor import predict_plan

    shapes = sorted({_shape(c) for c in configs})
    if len(shapes) > MAX_SHAPES:
        profiles = dict.fromkeys(shapes, profile_for(base.model_options))
    else:
        profiles = {shape: profile_for(json.loads(shape)) for shape in shapes}
    any_profile = profiles[shapes[0]]
    threads = any_profile.threads
    hw_all = hardware_for(workers)
    train_n = min(any_profile.train_samples, base.limit or math.inf)
    test_n = min(dataset_spec(base.dataset).test_size, base.eval_limit or math.inf) if base.evaluate else 0
    plans = []
    for k in divisors(workers):
        hw = hardware_for(k) if k > 1 else hw_all
        slots = workers // k
        step_sum = steps_sum = trial_sum = comm_sum = 0.0
        for cfg in configs:
            profile = profiles[_shape(cfg)]
            plan = Plan("serial" if k == 1 else "ddp", k, cfg.batch_size, dp=k, optimizer=cfg.optimizer,
                        momentum=cfg.momentum, threads=threads, bucket_mb=base.bucket_mb)
            pred = predict_plan(profile, hw, plan)
            env = environment(hw_all, plan)
            slowdown = env.sharing_slowdown(workers) / env.sharing_slowdown(k)
            step = pred.seconds_per_step + (slowdown - 1) * (pred.compute_s + pred.data_s + pred.optimizer_s)
            per_epoch = train_n // cfg.batch_size
            steps = min(cfg.epochs * per_epoch, cfg.steps or math.inf)
            epochs = math.ceil(steps / per_epoch)
            fwd = sum(compute.block_times(profile, cfg.batch_size / k)[0]) + compute.loss_time(profile, cfg.batch_size / k)
            evaluation = epochs * math.ceil(test_n / cfg.batch_size) * fwd * slowdown
            step_sum += step
            steps_sum += steps
            comm_sum += pred.comm_s
            trial_sum += steps * step + evaluation
        n, start = len(configs), start_for(k)
        waves = math.ceil(trials / slots)
        trial_s = trial_sum / n + start
        plans.append(KPlan(k, slots, waves, step_sum / n, steps_sum / n, trial_s, waves * trial_s, comm_sum / n,
                           slowdown, start))
    return sorted(plans, key=lambda p: p.sweep_s)


def _shape(cfg: RunConfig) -> str:
    return json.dumps(cfg.model_options, sort_keys=True)


def explain(plans: list[KPlan], workers: int, trials: int) -> str:
    """Why the fastest k wins, in a sentence or two."""
    win = plans[0]
    lines = [f"--per-trial {win.k} finishes {trials} trials soonest: {win.slots} trial(s) side by side, "
             f"{win.waves} wave(s) of {win.trial_s:.1f} s ({win.start_s:.1f} s of it starting the trial)."]
    for p in plans[1:]:
        what = ("each trial serial" if p.k == 1 else f"each trial ddp x{p.k}, allreduce {p.comm_s * 1e3:.2f} ms of its "
                f"{p.step_s * 1e3:.2f} ms step") + f", {p.start_s:.1f} s to start"
        lines.append(f"--per-trial {p.k} ({p.slots} side by side, {what}) would take {p.sweep_s:.0f} s, "
                     f"{p.sweep_s / win.sweep_s:.2f}x as long.")
    if win.k == 1:
        lines.append("Data parallelism splits each step's compute but adds a gradient allreduce every step; "
                     "trials side by side share nothing, so every core computes and nothing waits.")
    else:
        lines.append(f"Splitting each step over {win.k} workers costs less in allreduce than it saves in compute, "
                     "and fewer trials side by side compete less for the node.")
    return "\n".join(lines)


def plan_table(plans: list[KPlan], title: str):
    from rich.table import Table

    table = Table(title=title)
    for name in ("per trial k", "side by side", "waves", "ms/step", "of which allreduce", "steps/trial",
                 "start s (measured)", "s/trial", "predicted sweep s"):
        table.add_column(name, justify="right")
    for p in sorted(plans, key=lambda p: p.k):
        table.add_row(str(p.k), str(p.slots), str(p.waves), f"{p.step_s * 1e3:.2f}", f"{p.comm_s * 1e3:.2f}",
                      f"{p.steps:.0f}", f"{p.start_s:.1f}", f"{p.trial_s:.1f}", f"{p.sweep_s:.0f}")
    return table
