"""Per-strategy predictions: seconds per step and per epoch, peak memory, and where time goes.

    pred = predict_plan(profile, hardware, plan)      # -> Prediction
    pred.seconds_per_epoch, pred.fits(limit)

Reads profiles only, never a live model. Every model is per worker; times come from
``compute`` (measured blocks), ``comm`` (fitted collectives), ``pipeline_sim`` (the actual
schedule) and ``memory``.
"""

from __future__ import annotations

import dataclasses

from partrain.errors import PartrainError
from partrain.predict import compute
from partrain.predict.data_parallel import _data_parallel
from partrain.predict.memory import (
    MemoryBreakdown,
    activation_bytes,
    block_input_bytes,
    stage_state,
    transient_bytes,
)
from partrain.predict.pipeline import _pipeline
from partrain.predict.plan import Plan
from partrain.predict.prediction import (
    Prediction,
    _baseline,
    _steps_per_epoch,
    environment,
)
from partrain.predict.profiles import HardwareProfile, ModelProfile


def _serial(profile: ModelProfile, hw: HardwareProfile, plan: Plan) -> Prediction:
    """The measured serial step, interpolated to the batch size (the thesis's sequential model)."""
    env = environment(hw, plan)
    slow = env.slowdown(1)
    b = plan.batch_size
    kind = compute.optimizer_kind(plan.optimizer, plan.momentum)
    step = compute.serial_step(profile, b, kind) * slow
    data = compute.at(profile, profile.data_s, b) * slow
    opt = compute.optimizer_time(profile, kind) * slow
    n = len(profile.blocks)
    grads, opt_state = stage_state(profile, 0, n, plan.optimizer, plan.momentum)
    act = activation_bytes(profile, 0, n, b) + block_input_bytes(profile, 0, b)
    mem = MemoryBreakdown(**_baseline(profile, hw, 1), gradients=grads, optimizer=opt_state, buffers=0,
                          activations=int(act), transient=transient_bytes(profile, act))
    return Prediction(plan, step, _steps_per_epoch(profile, plan), step - data - opt, 0.0, 0.0, opt, data, mem, (mem.total,))


def predict_plan(profile: ModelProfile, hardware: HardwareProfile, plan: Plan) -> Prediction:
    """Seconds per step and epoch, peak memory per worker and the time breakdown of ``plan``.
    Refused when the profile was taken with other numerics than the plan runs with: a bf16
    plan is never predicted from an fp32 profile, nor the other way round."""
    asked = {"precision": plan.precision, "channels_last": plan.channels_last, "compile": plan.compile}
    if asked != profile.run_options():
        raise PartrainError(f"the {profile.model} profile was taken with {profile.run_options()}, the plan runs with "
                            f"{asked}: profile with the plan's --precision/--channels-last/--compile")
    cost = plan.spec.cost  # the strategy's cost model, as its StrategySpec names it
    env = environment(hardware, plan)
    threads = env.threads
    hardware, sharing = compute.with_model_sharing(profile, hardware, threads, env.local_workers)  # the model's own
    if cost == "serial":
        pred = _serial(profile, hardware, plan)
    elif cost == "pipeline":
        pred = _pipeline(profile, hardware, plan)
    else:
        pred = _data_parallel(profile, hardware, plan)
    env = environment(hardware, plan)
    if env.local_workers > 1:  # where the factor that slows co-located workers came from
        note = f"compute of {env.local_workers} workers side by side: {env.sharing_slowdown(env.local_workers):.2f}x ({sharing})"
        pred = dataclasses.replace(pred, notes=(*pred.notes, note))
    if threads != profile.threads:
        note = f"model profiled with {profile.threads} threads per worker, plan runs {threads}"
        pred = dataclasses.replace(pred, notes=(*pred.notes, note))
    return pred
