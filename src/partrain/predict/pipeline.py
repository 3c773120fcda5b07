"""Pipeline costs: per-stage compute and transfers fed to a simulation of the actual
schedule (``pipeline_sim``), and each rank's memory with the micro-batches it keeps in flight."""

from __future__ import annotations

from dataclasses import replace

from partrain.errors import PartrainError
from partrain.predict import compute
from partrain.predict.comm import collective_time, link_bucket, stage_transfer_time, wire_time
from partrain.predict.cut import balanced_bounds, bounds_from_split_points, untraced_refusal
from partrain.predict.memory import (
    MemoryBreakdown,
    activation_bytes,
    block_input_bytes,
    stage_state,
    transient_bytes,
)
from partrain.predict.pipeline_sim import PipelineCosts, SimResult, StepWork, simulate
from partrain.predict.plan import Plan
from partrain.predict.prediction import (
    Env,
    Prediction,
    _baseline,
    _steps_per_epoch,
    environment,
)
from partrain.predict.profiles import HardwareProfile, ModelProfile
from partrain.predict.schedules import schedule_order


def stage_bounds(profile: ModelProfile, plan: Plan) -> list[tuple[int, int]]:
    """The stage cut the run will use: explicit split points, else the same min-max partition
    over measured block times at the micro-batch size as ``strategies.partition``."""
    n_stages = plan.pp * plan.stages_per_worker
    if reason := untraced_refusal(profile.model, len(profile.blocks), n_stages):
        raise PartrainError(reason)
    if plan.split_points:
        return bounds_from_split_points(list(plan.split_points), len(profile.blocks), n_stages)
    fwd, bwd = compute.block_times(profile, _microbatch(plan))
    return balanced_bounds([f + g for f, g in zip(fwd, bwd)], n_stages)


def pinned_cut(profile: ModelProfile, plan: Plan) -> Plan:
    """``plan`` with the stage cut its prediction is made for written out (``split_points``),
    so that the command it prints runs that cut. Left to itself, ``train`` balances the stages
    by block times it takes at start-up (three timings each), and two runs of one plan may cut
    differently: issue 17's tuple_out, 2-stage 1F1B at batch 32, was cut after block 3 in one
    cell and after block 2 in its twin (a one-replica hybrid), and the two cuts took 7.3 and
    5.9 ms a step on average over ten runs each. Any other plan is returned as it is."""
    if not plan.spec.pipelined or plan.split_points or plan.pp * plan.stages_per_worker < 2:
        return plan
    return replace(plan, split_points=tuple(lo for lo, _ in stage_bounds(profile, plan)[1:]))


def _microbatch(plan: Plan) -> float:
    return plan.batch_size / plan.dp / plan.microbatches


def runs_cold(plan: Plan, env: Env) -> bool:
    """Whether ``plan``'s stages run their blocks from cold caches (``compute.block_times``) after
    they waited (``pipeline_sim.simulate``).

    Where the workers outnumber the cores, a stage that waits for a message gives its core to
    another worker, and its next action starts from caches that worker wrote over. Inside a
    4-stage pipeline on 4 workers on 2 cores, a LayerNorm/GELU block at 4 samples ran 0.25 ms
    forward and 0.33 ms backward, runtime included, where its back-to-back times are 0.06 and
    0.10 and its cold ones 0.15 and 0.22; issue 17's 4-stage cells of small blocks were 13-29%
    under their measure with the back-to-back times. A single pipeline over every worker only:
    a hybrid's replicas are calibrated by the side-by-side probe, whose fit holds the cost of two
    pipelines sharing the cores as a per-step constant (12-14 ms on a 2-core VM, no latency left)
    that cold actions would count again: its stages ran cold too, but the stored hybrid cells,
    predicted again with them, read 8-25 points over in two of four suites."""
    return plan.workers > 1 and plan.dp == 1 and env.oversubscribed()


def _pipeline_costs(profile: ModelProfile, hw: HardwareProfile, plan: Plan, bounds, env: Env) -> PipelineCosts:
    """Per-stage compute, boundary transfers, and each rank's work around the schedule."""
    b = _microbatch(plan)
    n, m = len(bounds), plan.microbatches
    alone = plan.workers == 1  # every stage on one worker: the runtime's costs are the model's own (below)
    action = 0.0 if alone else hw.pipeline_action_s  # the runtime's own cost per micro-batch action, measured on this hardware
    # every micro-batch after the first adds its parameter gradients into .grad (AccumulateGrad),
    # spread here evenly over the stage's m backwards; once the step's backwards are done the
    # schedule divides every gradient by m (scale_grads): one read and one write, 2/3 of that pass
    grad_pass = [compute.gradient_pass_time(profile, range(*bounds[s])) for s in range(n)]

    # every micro-batch pass pays what the whole step pays over its parts at that size (the cache)
    in_step = compute.in_step_factor(profile, b)
    hot_fwd, hot_bwd = ([t * in_step for t in times] for times in compute.stage_times(profile, bounds, b, plan.recompute))

    # each action's worker posts and waits on its messages itself: one a neighbour, its tensors
    # posted together (a forward's from the stage before and to the one after, a backward's the
    # other way, where the gradients of any floating tensors go back). Per tensor, run95u's
    # tuple_out (an activation and its ids a message) read 14.1% against 12.4% per message
    sent = [(profile.blocks[e - 1].out_tensors, profile.blocks[e - 1].out_floats) for _, e in bounds]
    msg = 0.0 if alone else hw.pipeline_message_cpu_s
    posts_fwd = [msg * ((s > 0 and sent[s - 1][0] > 0) + (s < n - 1 and sent[s][0] > 0)) for s in range(n)]
    posts_bwd = [msg * ((s < n - 1 and sent[s][1] > 0) + (s > 0 and sent[s - 1][1] > 0)) for s in range(n)]

    def actions(cold: bool) -> tuple[tuple[float, ...], tuple[float, ...]]:
        fwd, bwd = hot_fwd, hot_bwd
        if cold:  # from caches another worker wrote over: never less than in the step
            cold_fwd, cold_bwd = compute.stage_times(profile, bounds, b, plan.recompute, cold=True)
            fwd, bwd = [max(c, h) for c, h in zip(cold_fwd, fwd)], [max(c, h) for c, h in zip(cold_bwd, bwd)]
        return (tuple(t / env.speed + action + posts_fwd[s] for s, t in enumerate(fwd)),
                tuple((t + grad_pass[s] * (m - 1) / m) / env.speed + action + posts_bwd[s] for s, t in enumerate(bwd)))

    cold = runs_cold(plan, env)
    fwd, bwd = actions(cold=False)
    fwd_cold, bwd_cold = actions(cold=True) if cold else ((), ())
    rank = lambda s: (s % plan.pp) * plan.dp  # noqa: E731  (global rank of replica 0's stage s)
    out = [compute.at(profile, profile.blocks[e - 1].out_bytes, b) for _, e in bounds]
    # per stage, (bytes, from, to) of the message it sends on: none (0 bytes) past either end
    ahead = [(out[s], rank(s), rank(s + 1)) if s < n - 1 else (0.0, 0, 0) for s in range(n)]
    back = [(out[s - 1], rank(s), rank(s - 1)) if s > 0 else (0.0, 0, 0) for s in range(n)]
    # with more workers than cores, a message between stages costs more the longer they compute
    # (measured: ``HardwareProfile.pipeline_world_loaded``); the stages' mean action picks it
    action_s = sum(fwd_cold + bwd_cold if cold else fwd + bwd) / (2 * n)
    send_fwd = tuple(stage_transfer_time(hw, *msg, plan.dp, plan.pp, action_s, sent[s][0]) for s, msg in enumerate(ahead))
    send_bwd = tuple(stage_transfer_time(hw, *msg, plan.dp, plan.pp, action_s, sent[s - 1][1] if s else 1)
                     for s, msg in enumerate(back))  # the gradients of the floating-point tensors stage s took
    wire_fwd, wire_bwd = (tuple(wire_time(hw, *msg) for msg in msgs) for msgs in (ahead, back))
    # a policed link between nodes (a token bucket, measured) paces each message by the credit left
    policed = lambda nbytes, src, dst: (b, nbytes) if nbytes > 0 and (b := link_bucket(hw, src, dst)) else None  # noqa: E731
    bucket_fwd, bucket_bwd = (tuple(policed(*msg) for msg in msgs) for msgs in (ahead, back))
    kind = compute.optimizer_kind(plan.optimizer, plan.momentum)
    data = compute.at(profile, profile.data_s, plan.batch_size / plan.dp) / env.speed
    wrapper = profile.replica_wrapper_s if plan.dp > 1 else 0.0  # a hybrid wraps its stages only then
    before, after = [], []
    for r in range(plan.pp):
        stages = [s for s in range(n) if s % plan.pp == r]
        blocks = [i for s in stages for i in range(*bounds[s])]
        loads = 0 in stages or n - 1 in stages  # PipelineStepper.loads_data: first stage or the loss
        before.append((StepWork("data", data),) if loads else ())
        grad_bytes = sum(profile.blocks[i].param_bytes for i in blocks)
        dp_ranks = [rank(stages[0]) + d for d in range(plan.dp)]
        reduce = collective_time(hw, "allreduce", grad_bytes, dp_ranks)  # hybrid: replicas' gradients
        # ... after the replicas computed side by side: their m micro-batches on the rank's stages
        computed = m * sum(fwd[s] + bwd[s] for s in stages) * env.slowdown(env.local_workers)
        reduce = max(0.0, reduce + env.sync_after(computed, grad_bytes)) if plan.dp > 1 else reduce
        opt = compute.optimizer_time(profile, kind, blocks) / env.speed
        scale = sum(grad_pass[s] for s in stages) * 2 / 3 / env.speed if m > 1 else 0.0
        # the schedule's per-step bookkeeping and gradient scaling, the loop's own, and a hybrid's
        # replica wrapper on its blocks (its cost over the whole model, shared by parameter bytes);
        # the runtime's per-step cost timed on every worker at once holds their sharing of the
        # cores already: it waits in the simulation, where computing would share them again
        runtime = hw.runtime_of(plan.dp, plan.pp)
        # the probe timed that per-step cost over stages whose inputs were in memory, where most of it
        # is a stage waiting on the other; a training step's stages load their batch first, and that
        # fills the wait. Traced (issue 17): the gallery's dropout model, 2-stage 1F1B at batch 64, paid
        # 0.36 ms a step on rank 0 around its schedule, where the probe's fit said 1.2 ms
        runtime_s = (compute.world_of_one_pipeline_time(profile) if alone
                     else max(0.0, runtime.step_s - (data if loads else 0.0)))
        shared = 0.0 if alone or not runtime.side_by_side else runtime_s
        own = (runtime_s - shared + scale
               + (compute.loop_time(profile) + wrapper * grad_bytes / max(1, profile.param_bytes)) / env.speed)
        after.append((StepWork("runtime", own), StepWork("runtime", shared, cpu=False),
                      StepWork("allreduce", reduce, cpu=False), StepWork("optimizer", opt)))
    return PipelineCosts(fwd, bwd, send_fwd, send_bwd, tuple(before), tuple(after), wire_fwd, wire_bwd,
                         fwd_cold, bwd_cold, bucket_fwd, bucket_bwd)


def simulate_plan(profile: ModelProfile, hw: HardwareProfile, plan: Plan, transfers: bool = True) -> SimResult:
    """The event simulation of ``plan``'s schedule over its measured stage costs: what the
    prediction is made of, and what a timeline draws beside the measured one."""
    env = environment(hw, plan)
    costs = _pipeline_costs(profile, hw, plan, stage_bounds(profile, plan), env)
    orders = schedule_order(plan.schedule or "gpipe", plan.pp, plan.microbatches, plan.stages_per_worker)
    # k actions of the simulated timeline computing at once are k busy workers on each of its dp
    # replicas, which run the same timeline side by side, spread over the nodes the plan uses
    sharing = lambda k: env.sharing_slowdown(k * plan.dp / env.nodes_used)  # noqa: E731
    return simulate(orders, costs if transfers else costs.without_transfers(), sharing, busy_sender_s=hw.busy_sender_s)


def _pipeline(profile: ModelProfile, hw: HardwareProfile, plan: Plan) -> Prediction:
    bounds = stage_bounds(profile, plan)
    sim = simulate_plan(profile, hw, plan)
    no_transfer = simulate_plan(profile, hw, plan, transfers=False)
    busy = sim.busy[0]  # rank 0: the worker whose step time the training loop reports
    compute_s = busy.get("F", 0.0) + busy.get("B", 0.0) + busy.get("runtime", 0.0)
    comm = busy.get("allreduce", 0.0) + max(0.0, sim.step_s - no_transfer.step_s)  # what the transfers add
    data, opt = busy.get("data", 0.0), busy.get("optimizer", 0.0)
    bubble = max(0.0, sim.step_s - compute_s - comm - data - opt)
    memory = [_pipeline_memory(profile, hw, plan, bounds, sim.max_in_flight, r) for r in range(plan.pp)]
    worst = max(memory, key=lambda m: m.total)
    per_worker = tuple(memory[r // plan.dp].total for r in range(plan.workers))
    return Prediction(plan, sim.step_s, _steps_per_epoch(profile, plan), compute_s, comm, bubble, opt, data,
                      worst, per_worker)


def _pipeline_memory(profile: ModelProfile, hw: HardwareProfile, plan: Plan, bounds, in_flight: list[int], rank: int) -> MemoryBreakdown:
    """One pipeline rank: its stages' state, receive buffers, and activations in flight.

    ``PipelineStage`` allocates a receive buffer per micro-batch for its input (all but the
    first stage) and for its output's gradient (all but the last), and keeps every
    in-flight micro-batch's output until its backward (``torch.distributed.pipelining.stage``).
    """
    b = _microbatch(plan)
    n = len(bounds)
    grads = opt = buffers = act = computing = 0.0
    for s in range(rank, n, plan.pp):
        lo, hi = bounds[s]
        g, o = stage_state(profile, lo, hi, plan.optimizer, plan.momentum)
        grads, opt = grads + g, opt + o
        out = compute.at(profile, profile.blocks[hi - 1].out_bytes, b)
        inp = block_input_bytes(profile, lo, b)
        buffers += plan.microbatches * ((inp if s > 0 else 0.0) + (out if s < n - 1 else 0.0))
        keeps_out = 0.0 if profile.blocks[hi - 1].saves_output else out
        act += in_flight[s] * (activation_bytes(profile, lo, hi, b, plan.recompute) + keeps_out)
        computing = max(computing, activation_bytes(profile, lo, hi, b) + block_input_bytes(profile, lo, b))
        if s == 0:
            act += block_input_bytes(profile, 0, plan.batch_size / plan.dp)  # the loaded batch
    return MemoryBreakdown(**_baseline(profile, hw, plan.workers), gradients=int(grads), optimizer=int(opt),
                           buffers=int(buffers), activations=int(act), transient=transient_bytes(profile, act, computing))
