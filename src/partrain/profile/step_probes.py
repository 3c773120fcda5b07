"""Probes of what a training step pays besides its collectives, run by ``profile --hardware``
inside its process group: what ``torch.distributed.pipelining`` adds to each micro-batch
action, to each message between stages and to each step (one pipeline, and a pipeline per
pair of workers at once), and how much slower workers compute side by side than alone.
``profile.hardware`` fits them; ``profile.collectives`` times the collectives themselves.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def measure_pipeline_action(group, device, width: int = 64, microbatches: int = 8) -> float:
    """Seconds ``torch.distributed.pipelining`` adds to each micro-batch forward or backward.

    A one-stage GPipe schedule on ``group`` (this rank alone) over a small MLP, with 1 and
    with ``microbatches`` micro-batches: the extra time per micro-batch, less the same
    module's plain forward, loss and backward, is the runtime's cost of two actions.
    """
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    module = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)).to(device)
    x, y = torch.randn(2, width, device=device), torch.randint(0, 10, (2,), device=device)

    def schedule_step(m: int):
        stage = PipelineStage(module, 0, 1, device, group=group)
        schedule = ScheduleGPipe(stage, m, loss_fn=F.cross_entropy, scale_grads=True)
        xs, ys = x.repeat(m, 1), y.repeat(m)
        return lambda: schedule.step(xs, target=ys, losses=[])

    def plain():
        F.cross_entropy(module(x), y).backward()

    one, many = (_median_of(schedule_step(m)) for m in (1, microbatches))
    return max(0.0, ((many - one) / (microbatches - 1) - _median_of(plain)) / 2)


def _seconds_per_call_side_by_side(run, seconds: float, group, device, calls: int | None = None) -> float:
    """Wall seconds per call of ``run``, called in a loop on every rank of ``group`` at once
    for ``seconds`` of wall time (or exactly ``calls`` times: a ``run`` ending in a collective
    must be called as often on every rank), averaged over the ranks. Where more workers than cores
    compute, the scheduler lets each run whole short calls between waits of a time slice:
    the median call looks unshared, and so does one rank's first few calls, which may run
    while others wait for a core. A fixed window on every rank keeps them all competing
    throughout, and the mean over ranks is what each gets on average."""
    run()
    dist.barrier(group)
    start, done = time.perf_counter(), 0
    while (done < calls) if calls else (time.perf_counter() - start < seconds):
        run()
        done += 1
    calls = done
    per_call = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64, device=device)
    dist.all_reduce(per_call, group=group)
    return per_call.item() / dist.get_world_size(group)


def _calls(run, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``run``, after one untimed."""
    run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return samples


def _median_of(run, repeats: int = 50) -> float:
    return statistics.median(_calls(run, repeats))


def measure_pipeline_hops(group, device, width: int = 64, microbatches: tuple[int, ...] = (4, 8), rounds: int = 9,
                         steps: int = 10, stages: int = 2, rows: int = 2, depth: int = 1) -> dict:
    """Step times of a real pipeline of ``stages`` ranks (0 and 1 by default) over tiny stages, per schedule and
    micro-batch count, with each stage's plain forward and backward: what a message between
    stages costs inside the runtime (waking a waiting worker included), which a ping-pong
    between two busy workers underestimates, and each rank's own CPU seconds a step (``cpu_s``,
    its thread's: what posting and waiting on the messages costs it besides computing,
    ``profile.pipeline_fits.fit_message_cpu``). The micro-batch counts are those of the default
    (2 x stages) for 2 and 4 stages. Each step time is the median of ``rounds`` medians of
    ``steps`` steps, taken in turn with the others' (each round's median is kept as
    ``rounds_s``). With more workers than cores the machine slows the probe in episodes of a
    second or so: over 4 nodes on 2 cores, two of them busy, GPipe with 4 micro-batches read
    5.4-6.4 ms a step in most rounds and 10-14 ms in runs of a few. Three rounds of 30 steps
    then fitted a per-step overhead of 0.0 to 8.6 ms in 11 profiles of three placements; the
    median of nine rounds of 10 read 6.2-6.9 ms in four runs, in a third of the time. (An
    episode longer than most of the rounds still shows: one of nine link profiles in a
    benchmark.) Each stage is ``depth`` linear layers of ``width`` over micro-batches of ``rows``
    (the defaults compute almost nothing; ``_with_loads`` also loads them). Each stage's
    forward and backward are timed one rank of ``group`` after another, the others waiting: the
    simulation that fits the probe shares the cores itself. The ranks of ``group`` (``stages``
    of them) call this; rank 0 gets the result.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, last = dist.get_rank(group), stages - 1
    layers = [layer for _ in range(depth) for layer in (nn.Linear(width, width), nn.ReLU())]
    module = nn.Sequential(*(layers if rank < last else [*layers[:-2], nn.Linear(width, 10)])).to(device)
    x = torch.randn(rows, width, device=device)
    y = torch.randint(0, 10, (rows,), device=device)
    runs = []
    for cls, name in ((ScheduleGPipe, "gpipe"), (Schedule1F1B, "1f1b")):
        for m in microbatches:
            stage = PipelineStage(module, rank, stages, device, group=group)
            schedule = cls(stage, m, loss_fn=F.cross_entropy, scale_grads=True)
            xs, ys = x.repeat(m, 1), y.repeat(m)
            if rank == 0:
                run = lambda s=schedule, xs=xs: s.step(xs, losses=[])  # noqa: E731  (bound now: the loop moves on)
            elif rank < last:
                run = lambda s=schedule: s.step(losses=[])  # noqa: E731
            else:
                run = lambda s=schedule, ys=ys: s.step(target=ys, losses=[])  # noqa: E731
            runs.append(({"schedule": name, "microbatches": m}, run, [], []))
    for _ in range(rounds):  # alternated: a passing slowdown spoils a few rounds of each, not the median
        for _, run, samples, cpu in runs:
            used = time.thread_time()  # this thread's CPU: computing, posting and waiting on messages
            samples.append(_median_of(run, repeats=steps))
            cpu.append((time.thread_time() - used) / (steps + 1))  # _calls runs one more, untimed
    cpu_s = [None] * stages  # per rank, its median CPU seconds a step in each run
    dist.all_gather_object(cpu_s, [statistics.median(cpu) for *_, cpu in runs], group=group)
    timed = [{**key, "step_s": statistics.median(samples), "rounds_s": samples, "cpu_s": [c[i] for c in cpu_s]}
             for i, (key, _, samples, _) in enumerate(runs)]
    inp = x.requires_grad_(rank > 0)
    grad = torch.ones(rows, width, device=device)

    def backward(out):  # the last stage's backward starts from the loss
        (F.cross_entropy(out, y) if rank == last else out).backward(None if rank == last else grad)

    for turn in range(stages):  # alone: the others wait in the barrier
        dist.barrier(group)
        if turn == rank:
            fwd = _median_of(lambda: module(inp))
            bwd = max(0.0, _median_of(lambda: backward(module(inp))) - fwd)
            cold = _cold_times(module, inp, backward) if torch.device(device).type == "cpu" else None
    dist.barrier(group)
    stage_s, stage_cold_s = [None] * stages, [None] * stages
    dist.all_gather_object(stage_s, (fwd, bwd), group=group)
    dist.all_gather_object(stage_cold_s, cold, group=group)
    return {"steps": timed, "stage_s": stage_s, "message_bytes": rows * width * 4,
            **({"stage_cold_s": stage_cold_s} if cold else {})}


def _cold_times(module: nn.Module, inp: torch.Tensor, backward, repeats: int = 20) -> tuple[float, float]:
    """Median seconds of a probe stage's forward and of its backward, each started with the core's
    caches written over (``timing.evict_caches``), as a stage's actions start where the node's
    workers outnumber its cores (``BlockProfile.fwd_cold_s``)."""
    from partrain.profile.timing import cold_run

    run = cold_run(lambda: module(inp), backward)
    fwd, bwd = zip(*(run() for _ in range(repeats)))
    return statistics.median(fwd), statistics.median(bwd)


# (micro-batch rows, width, layers) of the probes' loaded stages: a forward and backward of
# about 0.2, 0.5 and 1.5 ms a micro-batch on a 2-core VM's core
LOADS = ((16, 256, 2), (32, 512, 2), (64, 512, 3))


def _with_loads(group, device, stages: int, loads, loaded_rounds: int = 5, **probe) -> dict:
    """``measure_pipeline_hops`` over stages that compute almost nothing, then again (8
    micro-batches, fewer rounds) over each of ``loads``, kept as its ``"loaded"`` list.

    Where workers outnumber the cores, a message between stages costs more the more they
    compute, which the first probe's idle stages never show: over 4 workers on 2 cores, one
    pipeline over all of them fitted 0.82, 1.17, 1.91 and 2.57 ms a message for stages of
    0.05, 0.19, 0.49 and 1.45 ms a micro-batch, and issue 17's 4-stage cells, 17-37% under
    their measure with the first alone, needed about as much for their own stages' times
    (gpt at batch 32: 2.0). Taken as waiting for a core in the simulation, it changed nothing:
    the heaviest probe's steps (95-98 ms) left the 2 cores half idle (93 ms of compute)."""
    out = measure_pipeline_hops(group, device, stages=stages, **probe)
    out["loaded"] = [measure_pipeline_hops(group, device, width=width, microbatches=(8,), rounds=loaded_rounds, steps=5,
                                           stages=stages, rows=rows, depth=depth) for rows, width, depth in loads]
    return out


# (micro-batch rows, width, layers) of the two-stage probe's loaded stages: a forward and backward of
# about 0.8 and 5 ms a micro-batch on a 2-core VM's core, longer than a woken stage's wait behind a
# busy one (``measure_pair_loaded``)
PAIR_LOADS = ((32, 512, 2), (64, 1024, 2))


def measure_pair_loaded(group, device, loads=PAIR_LOADS, rounds: int = 9) -> list[dict]:
    """``measure_pipeline_hops`` of the pair ``group`` over each of ``loads``, 4 and 8
    micro-batches of GPipe and 1F1B (``rounds`` rounds of 4 steps; 15 s on a 2-core VM, 30 s
    beside two busy workers): where a message's sender computes on after sending it, its
    receiver waits longer than the idle probe's latency (``profile.pipeline_fits.fit_busy_sender``).
    Both ranks call this; rank 0 gets the result.

    Nine rounds, not three: GPipe's excess over 1F1B is a few ms in steps of 10-100, and one
    round's swung by up to 30 ms on a 2-core VM. Four probes in a row on 2 workers fitted 1.7,
    4.8, 1.5 and 2.3 ms from nine rounds each, 0-6 ms from each third of them; issue 17's
    2-worker GPipe cells of exp100 (three rounds fitted 0.1 ms) read 28.3% under at 0, 11.8% at 2 ms."""
    return [measure_pipeline_hops(group, device, width=width, microbatches=(4, 8), rounds=rounds, steps=4, rows=rows,
                                  depth=depth) for rows, width, depth in loads]


def measure_world_pipeline(device, loads=LOADS, **probe) -> dict:
    """``measure_pipeline_hops`` as one pipeline over every worker (a stage per rank), as a plan
    with as many stages as workers runs: each stage waits in its bubble and is woken by its
    neighbour while the others compute or wait too. The two-stage probe beside busy workers
    is not that: on a 2-core VM (issue 17's run51), 4-stage pipelines of 8 micro-batches on 4
    workers ran 23-35 ms a step where its costs predicted 42-47. Also over stages that compute
    (``_with_loads``). Every rank calls this; rank 0 gets the result."""
    return _with_loads(dist.group.WORLD, device, dist.get_world_size(), loads, **probe)


def measure_pipelines_side_by_side(device, loads=LOADS, **probe) -> dict:
    """``measure_pipeline_hops`` on every worker at once, as a hybrid's replicas run: rank i
    with rank i + world/2 (stage s of replica d is rank s * dp + d), each pair its own
    pipeline, also over stages that compute (``_with_loads``). Every rank calls this and gets
    its own pair's probe, its "ranks" named."""
    world, rank = dist.get_world_size(), dist.get_rank()
    half = world // 2
    pairs = [dist.new_group([i, i + half]) for i in range(half)]  # every rank creates every group
    mine = [rank % half, rank % half + half]
    return {**_with_loads(pairs[rank % half], device, 2, loads, **probe), "ranks": mine}


def _training_kernel(group, device, rows: int = 8) -> tuple:
    """(``burn(n)``: n forward + backward passes of a 3x3 convolution on ``rows`` x 32 x 28 x
    28 activations, single-threaded training compute of a few MB at 8 rows (1.5-1.8 ms on a
    2-vCPU VM's core); seconds of one pass, timed by the group's rank 0 alone and the same on
    every rank)."""
    conv = torch.nn.Conv2d(32, 32, 3, padding=1).to(device)
    x = torch.randn(rows, 32, 28, 28, device=device, requires_grad=True)

    def burn(n: int):
        for _ in range(n):
            conv(x).sum().backward()

    one = torch.tensor([0.0], dtype=torch.float64, device=device)
    if dist.get_rank(group) == 0:
        burn(3)
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < 0.05:
            burn(1)
            n += 1
        one[0] = (time.perf_counter() - start) / n
    dist.broadcast(one, dist.get_global_rank(group, 0), group=group)
    return burn, one.item()


def measure_compute_sharing(group, device, target_s: float = 0.005, repeats: int = 20, window_s: float = 0.3,
                            rounds: int = 3) -> dict:
    """How the node runs its workers' compute side by side, and what a synchronisation after
    computing costs. Every rank of ``group`` calls this; its rank 0's timings are returned.

    One fixed piece of single-threaded compute, calibrated by rank 0 alone to about
    ``target_s``, is timed three ways. It is a training kernel: a 3x3 convolution's forward and
    backward on 8 x 32 x 28 x 28 activations, a few MB live, beyond a core's own cache. (A
    product of small cache-resident matrices shared 4 workers on 2 cores at exactly 2.0x;
    this convolution, a 1024 x 1024 product and partrain's cnn all ran 2.2-2.4x slower side
    by side: each time slice starts on a cold cache.) The three ways: on rank 0 alone while
    the others wait (``alone_s``); on every rank at once for ``window_s`` (``together_s``,
    averaged over the ranks: sharing cores, SMT siblings, caches and memory bandwidth, which a
    core count alone does not tell); and on every rank at once, each followed by a 4-byte
    allreduce (``synced_s``). Alone and side by side alternate over ``rounds`` and each
    keeps its median: one run of the 2-worker probe measured 1.31x where others measured
    1.00-1.06x. ``synced_s - together_s`` is what one synchronisation point of a training
    step costs beyond the computation: the slowest rank's lead, and waking ranks that went
    idle waiting, which on a virtual machine takes far longer than a collective between busy
    ranks.
    """
    burn, one = _training_kernel(group, device)
    n = max(1, round(target_s / one))
    rank = dist.get_rank(group)
    token = torch.zeros(1, device=device)
    alone, together, synced = [], [], []
    for _ in range(rounds):  # alternated: a passing slowdown of the machine spoils one round, not the median
        dist.barrier(group)
        alone.append(_median_of(lambda: burn(n), repeats) if rank == 0 else 0.0)
        dist.barrier(group)
        together.append(_seconds_per_call_side_by_side(lambda: burn(n), window_s, group, device))
        # the same window with a synchronisation after each call: measured as ``together`` is (a
        # mean over a window and the ranks), so that their difference is the synchronisation's.
        # (Rank 0's median call against the window's mean read 0.1-4.0 ms for the same 4 workers
        # on 2 cores in three profiles an hour apart: the median of time-sliced calls is not their mean.)
        # (A fixed number of calls, the same on every rank: each call ends in a collective.)
        calls = max(3, round(window_s / together[-1]))  # together[-1] is the same on every rank
        synced.append(_seconds_per_call_side_by_side(lambda: (burn(n), dist.all_reduce(token, group=group)),
                                                     window_s, group, device, calls=calls))
    dist.barrier(group)
    return {"alone_s": statistics.median(alone), "together_s": statistics.median(together),
            "synced_s": statistics.median(synced)}


# compute each worker runs side by side between synchronisations in ``measure_step_sync``, and the
# bytes it then reduces: a small model's gradients (the gallery's 68-135 KB), a small zoo model's
# (the mlp's 0.94 MB, the cnn's 1.6) and a bucket's worth beyond them; the sizes a step's compute
# spans on a CPU, from a small model's batch (0.5 ms) to a middle one's (8 ms)
SYNC_COMPUTES_S = (0.0005, 0.002, 0.008)
SYNC_BYTES = (64 * 1024, 2**20, 4 * 2**20)
# a size whose allreduce alone takes longer than this is not probed (its step is the link's, and a
# window of ten of them would take seconds: 4 MiB at 100 Mbit/s is 0.35 s a call); the smallest always is
SYNC_MAX_COLLECTIVE_S = 0.025


def measure_step_sync(group, device, computes_s=SYNC_COMPUTES_S, sizes=SYNC_BYTES, window_s: float = 0.25,
                      rounds: int = 5, max_collective_s: float = SYNC_MAX_COLLECTIVE_S) -> list[dict]:
    """What a synchronous allreduce costs a training step after every worker computed side
    by side, as data-parallel steps end, for each compute length in ``computes_s`` and each
    message size in ``sizes``: the median step of compute and an allreduce of that many bytes
    on ``group``, less the mean step of the same compute alone on every rank at once (no
    collective), on the group's rank 0; each the median of ``rounds`` alternations. Returns
    ``[{"message_bytes", "points": [[compute seconds measured side by side, excess seconds],
    ...]}, ...]`` by size, the sizes whose allreduce alone took at most ``max_collective_s``
    (the smallest always); every rank of ``group`` calls this.

    Sizes, because what a step pays beyond the sweep's fit of its allreduce depends on the
    bytes, not only on the compute before it. Across 2 emulated nodes at 10 Gbit/s (issue 18,
    session 81) the sweep fitted a 64 KiB allreduce at 1.62 ms and a 1 MiB one at 1.77 (its
    back-to-back calls' means, a tail of 4 ms waits in them, hide the wire), while a step after
    0.7 ms of compute paid 1.4 ms for the first and 2.7-3.0 for the second: held at 64 KiB, the
    mlp's 0.94 MB DDP and local SGD steps (about 1 ms of compute) were predicted 1.1-1.4 ms short,
    18 of 18 two-worker data-parallel cells over 2x1 nodes under. Over 4x1 the same sizes read
    as the 64 KiB point and the fit say, within 1.5 ms.

    The compute is the mean call, the wall time a worker's compute spans side by side, as the
    predictor's compute is (``Env.slowdown``): where the group outnumbers the cores (emulated
    nodes on one machine) the cores time-slice the workers, and the median call is one that
    ran whole, unshared (4 workers on 2 cores: 5.4-6.7 ms for 8 ms of compute), while the
    synchronised step pays the sharing (the session-64 probe read 16 ms of excess there, the
    compute's second share among it, which a prediction that had already doubled the compute
    paid again: the cnn's 4-worker cells across nodes +31% to +42%). With a core each the two
    differ by the odd slow call.

    The collective sweep times back-to-back calls between idle workers, whose mean is not
    what a step pays. On a 2-vCPU VM (issue 17, session 61) a 64 KiB allreduce between two
    idle workers took 0.27-0.45 ms in the median call but 1.3-2.2 ms in the mean: one call
    in four or so waited about 4 ms for a halted vCPU to run again. After each worker
    computed C side by side, the median step paid 0.5-0.8 ms more than its compute at C =
    0.5 ms, 1.3-2.1 ms at 2 ms and 0.9-3.4 ms at 5-20 ms: the longer the workers compute,
    the further apart they finish and the likelier the first to wait halts. The gallery's
    2-worker data-parallel steps paid what this says (0.5-1.2 ms over their compute at
    batch 32; tuple_out 2.9-3.2 ms at batch 128, 64 rows a worker, 5 ms of compute), where
    the sweep's mean put 1.2-2.4 ms on each. A 4-byte token does not show it: a one-element
    allreduce took 0.11-0.14 ms, tail or not.

    Rounds: each visits every compute length in turn, so that a slow spell of the machine (of
    seconds) costs one round of each length rather than the median of the length it fell on.
    Across 4 emulated nodes on 2 cores at 10 Gbit/s (session 67), three probes a minute apart,
    3 rounds per length one length after another, read 18.4, 13.4 and 9.5 ms of excess at the
    longest compute (the cnn's 4-worker data-parallel cells, 14 ms of compute, read +16% to
    +39% in run66n against link profiles whose point read 12.3 ms); 9 rounds read 10.9-16.5;
    five rounds in turn, three probes in a row, 13.4-14.1. Held against the same 14 cells on 4
    emulated nodes (run67m), two link profiles by each way within an hour read 43.3% and 7.6%
    MAPE (three rounds, one length after another) and 8.0% and 10.9% (five in turn): a wild
    profile rarer, not ruled out (the second's longest point: 19.1 ms after 10.8 ms of compute,
    where the first read 14.8 after 15.5). A round is a window of each length free and
    synchronised: five cost about a minute there, where every allreduce waits 10 ms, and
    seconds with a core each."""
    burn, one = _training_kernel(group, device, rows=1)  # a fine grain: the shortest compute is a few passes
    rank = dist.get_rank(group)

    def steps_of(run, steps: int) -> list[float]:
        dist.barrier(group)
        return _calls(run, steps)  # every rank out of the barrier at once; one untimed call, then the steps

    def slowest(seconds: float) -> float:  # every rank must agree on what it probes and for how long
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.item()

    bufs, collective = [], []
    for n in sorted(sizes):
        buf = torch.ones(max(1, n // 4), device=device)
        call = slowest(statistics.median(steps_of(lambda buf=buf: dist.all_reduce(buf, group=group), 5)))
        if bufs and call > max_collective_s:
            break
        bufs.append(buf)
        collective.append(call)
    passes = []  # rising: a pass timed in a slow spell (1.4 ms, not 0.2) rounded 0.5 and 2 ms to one pass each
    for target in computes_s:
        passes.append(max(round(target / one), passes[-1] + 1 if passes else 1))
    # a window of each length: its free steps, and as many synced ones as fill it (the same on every rank)
    free_steps = [max(10, round(window_s / target)) for target in computes_s]
    free = [[] for _ in computes_s]
    excess = [[[] for _ in computes_s] for _ in bufs]
    for _ in range(rounds):  # every length and size in each round: a slow spell spoils a round of each
        for i, reps in enumerate(passes):
            free[i].append(statistics.fmean(steps_of(lambda: burn(reps), free_steps[i])))
            for j, buf in enumerate(bufs):
                synced_steps = max(10, round(window_s / (computes_s[i] + collective[j])))
                synced = steps_of(lambda: (burn(reps), dist.all_reduce(buf, group=group)), synced_steps)
                excess[j][i].append(statistics.median(synced) - free[i][-1])
    dist.barrier(group)
    if rank != 0:
        return []
    compute = [statistics.median(f) for f in free]
    return [{"message_bytes": buf.numel() * buf.element_size(),
             "points": [[c, statistics.median(e)] for c, e in zip(compute, by_compute)]}
            for buf, by_compute in zip(bufs, excess)]
