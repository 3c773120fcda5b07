"""Data-parallel costs: DDP's overlapped bucketed allreduce, local SGD's averaging, FSDP's
gathers and reduce-scatters, Hogwild's none: compute / W plus what backward cannot hide."""

from __future__ import annotations

from partrain.predict import compute
from partrain.predict.comm import collective_time
from partrain.predict.memory import (
    MemoryBreakdown,
    activation_bytes,
    block_input_bytes,
    stage_state,
    transient_bytes,
)
from partrain.predict.plan import MB, Plan
from partrain.predict.prediction import (
    Prediction,
    _baseline,
    _steps_per_epoch,
    environment,
)
from partrain.predict.profiles import HardwareProfile, ModelProfile


def ddp_buckets(param_bytes: list[int], cap_bytes: float) -> list[tuple[int, int]]:
    """(bytes, first block) of each DDP gradient bucket, in the order backward fills them.

    After its first step DDP rebuilds its buckets in the order gradients become ready,
    i.e. the blocks in reverse, each closed once it holds ``cap_bytes`` (Li et al.,
    "PyTorch Distributed", VLDB 2020, section 3.2.3). A bucket is ready when the earliest
    block with a parameter in it has finished its backward.
    """
    buckets, size, first = [], 0, None
    for i in reversed(range(len(param_bytes))):
        left = param_bytes[i]
        while left > 0:
            take = min(left, cap_bytes - size)
            size, left, first = size + take, left - take, i
            if size >= cap_bytes:
                buckets.append((int(size), first))
                size = 0
    if size > 0:
        buckets.append((int(size), first))
    return buckets


def overlapped_allreduce(ready_s: list[float], comm_s: list[float], backward_s: float) -> float:
    """Communication left after backward: buckets reduced one after another, each from the
    moment it is ready (Li et al. 2020; Sergeev & Del Balso, "Horovod", 2018)."""
    end = 0.0
    for ready, cost in zip(ready_s, comm_s):
        end = max(end, ready) + cost
    return max(0.0, end - backward_s)


def _data_parallel(profile: ModelProfile, hw: HardwareProfile, plan: Plan) -> Prediction:
    env = environment(hw, plan)
    dp, b = plan.dp, plan.batch_size / plan.dp
    slow = env.slowdown(env.local_workers)
    kind = compute.optimizer_kind(plan.optimizer, plan.momentum)
    bwd = compute.block_times(profile, b)[1]  # when each block's gradients are ready (``_ddp_comm``)
    chain_f, chain_b = compute.stage_times(profile, [(0, len(profile.blocks))], b)  # the blocks as one chain, the loss
    fb = (chain_f[0] + chain_b[0] + compute.loop_time(profile, b)) * slow
    data = compute.at(profile, profile.data_s, b) * slow
    opt = compute.optimizer_time(profile, kind) * slow
    ranks = list(range(plan.workers))
    params = [blk.param_bytes for blk in profile.blocks]
    total_params = sum(params)
    notes: list[str] = []
    grads, opt_state = stage_state(profile, 0, len(params), plan.optimizer, plan.momentum)
    act = activation_bytes(profile, 0, len(params), b) + block_input_bytes(profile, 0, b)
    buffers, occasional = 0, 0.0
    cost = plan.spec.cost
    step_compute = data + fb + opt  # what each worker computes side by side between synchronisations
    if cost == "ddp":
        # the step waits after backward for its last bucket (the first blocks' gradients)
        sync = env.sync_after(step_compute, (ddp_buckets(params, plan.bucket_mb * MB) or [(0, 0)])[-1][0])
        # DDP's own work (autograd hooks, copies into and out of the buckets), measured on a world of one
        comm = max(0.0, _ddp_comm(profile, hw, plan, ranks, bwd, slow) + sync) + profile.overhead_s("ddp") * slow
        buffers = total_params  # flat gradient buckets beside the gradients (gradient_as_bucket_view=False)
    elif cost == "local-sgd":
        # average_parameters flattens every parameter into one buffer and allreduces it, a plain
        # synchronous all_reduce (torch.distributed.algorithms.model_averaging.utils), every K
        # steps or once an epoch; the work around it (flatten, scale, unflatten) is what the
        # profile measured for local SGD averaging every step on a world of one
        every = _steps_per_epoch(profile, plan) if plan.average_every == "epoch" else int(plan.average_every)
        local = profile.overhead_s("local-sgd") * slow
        sync = env.sync_after(step_compute * every, total_params)  # K steps since the last averaging
        comm = (max(0.0, collective_time(hw, "allreduce", total_params, ranks) + sync) + local) / every
        buffers = total_params
        if every > 2:
            occasional = comm
            notes.append(f"averaging amortized over {every} steps; the median step has none")
    elif cost == "fsdp":
        comm, buffers = _fsdp_comm(profile, hw, ranks, bwd, slow)
        comm = max(0.0, comm + env.sync_after(step_compute, max(params)))  # a unit's collectives end its step
        grads, opt_state = stage_state(profile, 0, len(params), plan.optimizer, plan.momentum, shards=dp)
    elif cost == "shared":  # hogwild: no communication; workers update shared weights in place
        comm = 0.0
        notes.append("hogwild: lock-free updates modelled without memory-bandwidth contention")
    else:
        raise ValueError(f"{plan.strategy}: no data-parallel cost model {cost!r}")
    mem = MemoryBreakdown(**_baseline(profile, hw, plan.workers), gradients=grads, optimizer=opt_state,
                          buffers=int(buffers), activations=int(act), transient=transient_bytes(profile, act))
    return Prediction(plan, data + fb + comm + opt, _steps_per_epoch(profile, plan), fb, comm, 0.0, opt, data,
                      mem, (mem.total,) * plan.workers, tuple(notes), occasional)


def _ddp_comm(profile: ModelProfile, hw: HardwareProfile, plan: Plan, ranks: list[int], bwd: list[float], slow: float) -> float:
    """Exposed bucket allreduce plus DDP's per-forward broadcast of module buffers (BatchNorm
    statistics; ``broadcast_buffers=True`` by default). A bucket costs the plain allreduce of
    its bytes; DDP's work around it is the model profile's world of one (``profile.collectives``
    says what a separate DDP probe measured instead, and why it went)."""
    buckets = ddp_buckets([blk.param_bytes for blk in profile.blocks], plan.bucket_mb * MB)
    backward = [t * slow for t in bwd]
    done_at = [sum(backward[i:]) for i in range(len(backward))]  # backward runs the blocks in reverse
    ready = [done_at[first] for _, first in buckets]
    costs = [collective_time(hw, "allreduce", nbytes, ranks) for nbytes, _ in buckets]
    exposed = overlapped_allreduce(ready, costs, sum(backward))
    buffer_bytes = sum(blk.buffer_bytes for blk in profile.blocks)
    return exposed + collective_time(hw, "broadcast", buffer_bytes, ranks)


def _fsdp_comm(profile: ModelProfile, hw: HardwareProfile, ranks: list[int], bwd: list[float],
               slow: float) -> tuple[float, int]:
    """(exposed communication, gathered-parameter bytes) of ``fully_shard`` per block.

    Forward all-gathers each block's parameters as it is reached and frees them after;
    backward all-gathers them again and reduce-scatters the gradients: 1.5x DDP's traffic
    (Zhao et al., "PyTorch FSDP", VLDB 2023). On GPUs these run on their own CUDA streams,
    prefetched, and backward's hide up to the backward compute; forward's are exposed.

    On CPUs (gloo) FSDP has no streams: every gather and reduce-scatter runs from the compute
    thread and is waited for there, so nothing hides. Each block then costs what one unit
    cost as FSDP drove it in the hardware profile (``fsdp_unit``; from the bare collectives
    on a cluster file). The cnn on 2 workers at batch 64 measured 71 ms a step where hiding
    backward's predicted 40. FSDP's own bookkeeping on a world of one (``world_of_one_s``)
    is added once, as DDP's is.
    """
    params = [blk.param_bytes for blk in profile.blocks]
    machinery = profile.overhead_s("fsdp") * slow
    if hw.backend == "gloo":
        return sum(collective_time(hw, "fsdp_unit", n, ranks) for n in params) + machinery, 2 * max(params)
    gather = [collective_time(hw, "all_gather", n, ranks) for n in params]
    scatter = [collective_time(hw, "reduce_scatter", n, ranks) for n in params]
    backward_comm = sum(gather[:-1]) + sum(scatter)  # the last block's gather is still resident
    exposed = sum(gather) + max(0.0, backward_comm - sum(bwd) * slow)
    return exposed + machinery, 2 * max(params)  # one block unsharded, the next one prefetched
