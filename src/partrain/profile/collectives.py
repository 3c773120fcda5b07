"""Collective micro-benchmarks on the real backend, and the latency + size/bandwidth fit.

``measure_collectives`` runs in every worker of a process group (gloo on CPU, NCCL on
GPUs) and times allreduce, all-gather, reduce-scatter, broadcast and a send/recv
ping-pong over message sizes from 16 bytes to tens of megabytes, the allreduce once more as
DDP drives it (``ddp_allreduce``: launched from the autograd hook, waited for at the end of
backward, with DDP's bucket copies and bookkeeping), because on a CPU backend that costs
measurably more than the bare collective, and a ``fully_shard`` unit's gathers and
reduce-scatter as FSDP drives them (``fsdp_unit``), for the same reason. ``measure_pipeline_action`` times what
``torch.distributed.pipelining`` adds to each micro-batch forward or backward.

The ``measure_*`` functions run inside a process group; their sweeps are fitted by the pure
``predict.fits`` (latency + size / bandwidth), which the predictor reads.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from partrain.predict.fits import COLLECTIVES


def repeats_for(nbytes: int) -> int:
    """Iterations per timing: many for tiny messages (microseconds), a few for large ones."""
    return max(3, min(30, round(8 * 2**20 / max(nbytes, 1))))


# ---- measurement (runs inside a process group) -------------------------------------------


def _op(name: str, nbytes: int, group, ranks: list[int], device):
    """A zero-argument callable running one ``name`` of ``nbytes`` on ``group``."""
    p = len(ranks)
    numel = max(p, nbytes // 4 // p * p)  # float32 elements, divisible by the group size
    full = torch.ones(numel, device=device)
    part = torch.empty(numel // p, device=device)
    if name == "allreduce":
        return lambda: dist.all_reduce(full, group=group)
    if name == "all_gather":  # nbytes is the gathered (output) size
        return lambda: dist.all_gather_single(full, part, group=group)
    if name == "reduce_scatter":  # nbytes is the input size
        return lambda: dist.reduce_scatter_single(part, full, group=group)
    if name == "broadcast":
        return lambda: dist.broadcast(full, src=ranks[0], group=group)
    raise ValueError(name)


def _ping_pong(nbytes: int, a: int, b: int, device):
    """One round trip between ranks ``a`` and ``b``; the one-way time is half of it."""
    buf = torch.ones(max(1, nbytes // 4), device=device)
    me = dist.get_rank()

    def run():
        if me == a:
            dist.send(buf, b)
            dist.recv(buf, b)
        elif me == b:
            dist.recv(buf, a)
            dist.send(buf, a)

    return run


def _backend_device() -> torch.device:
    """Where the default group's tensors live: NCCL reduces CUDA tensors only (the worker's
    GPU, set when it joined the group), gloo CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _sync(device: torch.device) -> None:
    """Wait for the GPU's queued work (NCCL collectives return before they finish); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(run, repeats: int, trials: int = 3) -> float:
    """Median over ``trials`` of the slowest rank's mean seconds per call (on a GPU until the
    queued collectives have finished, not only been launched)."""
    device = _backend_device()
    run()  # warm-up: connections, buffers
    out = []
    for _ in range(trials):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        _sync(device)
        elapsed = torch.tensor([(time.perf_counter() - start) / repeats], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        out.append(elapsed.item())
    return statistics.median(out)


def _supported(run) -> bool:
    """Run once everywhere; True only if it ran on every rank (so all ranks skip alike)."""
    try:
        run()
        ok = 1
    except (RuntimeError, NotImplementedError):  # e.g. a backend without reduce-scatter
        ok = 0
    flag = torch.tensor([ok], device=_backend_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


@contextlib.contextmanager
def background_load(enabled: bool):
    """Keep one core busy with matrix products while the block runs (when ``enabled``).

    Ranks that sit out a measurement run this, so that a group measured inside a bigger job
    shares the cores as it will in the job, where the other workers compute: with more
    workers than cores, waking a waiting worker then waits for a core too.
    """
    if not enabled:
        yield
        return
    stop = threading.Event()
    a = torch.randn(256, 256)

    def burn():
        while not stop.is_set():
            a @ a  # releases the GIL: the main thread keeps joining the barriers

    thread = threading.Thread(target=burn, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def measure_collectives(group, group_ranks: list[int], pair: tuple[int, int], sizes: list[int], device,
                        alone) -> tuple[dict, list[str]]:
    """Every rank of the world calls this; returns ({collective: [(bytes, seconds)]}, notes).

    The ranks of ``group_ranks`` run the collectives on ``group``; ranks outside it, if
    any, keep a core busy and join the barriers (``background_load``); ``pair`` runs the
    send/recv ping-pong; ``alone`` is this rank's group of one (``ddp_allreduce``'s
    baseline; ``dist.new_subgroups(group_size=1)``). A collective the backend lacks is
    skipped and named in the notes.
    """
    with background_load(dist.get_rank() not in group_ranks):
        return _measure_collectives(group, group_ranks, pair, sizes, device, alone)


def _measure_collectives(group, group_ranks, pair, sizes, device, alone) -> tuple[dict, list[str]]:
    inside = dist.get_rank() in group_ranks
    results: dict[str, list[tuple[int, float]]] = {}
    notes: list[str] = []
    for name in COLLECTIVES:
        if name == "sendrecv":
            results[name] = [(n, _timed(_ping_pong(n, *pair, device), repeats_for(n)) / 2) for n in sizes]
            continue
        if name == "ddp_allreduce":
            results[name] = [(n, _ddp_sync_cost(n, group, alone, inside, device)) for n in sizes]
            continue
        if name == "fsdp_unit":  # a unit's step costs 3 collectives and more: the fit carries it past 16 MiB
            results[name] = [(n, _fsdp_unit_cost(n, group, alone, inside, device)) for n in sizes if n <= 16 * 2**20]
            continue
        make = (lambda n: _op(name, n, group, group_ranks, device)) if inside else (lambda n: (lambda: None))
        if not _supported(make(sizes[0])):
            notes.append(f"{name} skipped: the {dist.get_backend()} backend does not run it")
            continue
        results[name] = [(n, _timed(make(n), repeats_for(n))) for n in sizes]
    return results, notes


class _Flat(nn.Module):
    """One parameter of ``numel`` floats whose gradient backward produces at its very end."""

    def __init__(self, numel: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def _ddp_sync_cost(nbytes: int, group, alone, inside: bool, device) -> float:
    """Seconds DDP on ``group`` adds to a forward + backward whose gradients (``nbytes``, one
    bucket) are ready only when backward ends, over the same DDP step on a world of one
    (``alone``): the allreduce it cannot hide, launched from the autograd hook and waited for
    at the end of backward, and the bucket copies of a bucket that now crosses processes.

    DDP's bookkeeping on a world of one (its hooks, the copies into and out of a bucket) is
    not in it: the model profile measures that for the model itself (``world_of_one_s``),
    with its own parameters and buckets, and the predictor adds it once. (Against the bare
    module, on 2 idle gloo workers, this was 0.83-0.99 ms for a bucket of 16 B to 256 KB, of
    which 0.14-0.24 ms was that world-of-one bookkeeping, counted twice.)"""
    flat = _Flat(max(1, nbytes // 4)).to(device)
    x = torch.ones_like(flat.w)

    def step(module: nn.Module):
        module.zero_grad(set_to_none=True)
        module(x).backward()

    cap = nbytes / 2**20 + 1
    ddp = DistributedDataParallel(flat, process_group=group, bucket_cap_mb=cap) if inside else None
    one = DistributedDataParallel(_Flat(flat.w.numel()).to(device), process_group=alone, bucket_cap_mb=cap) \
        if inside else None
    base = _timed((lambda: step(one)) if inside else (lambda: None), repeats_for(nbytes))
    synced = _timed((lambda: step(ddp)) if inside else (lambda: None), repeats_for(nbytes))
    return max(0.0, synced - base)


class _Unit(nn.Module):
    """A root holding one ``_Flat`` child: the child is an FSDP unit that reshards after forward,
    as ``strategies.fsdp`` wraps each block (FSDP keeps the root's own parameters gathered)."""

    def __init__(self, numel: int):
        super().__init__()
        self.inner = _Flat(numel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _fsdp_unit_cost(nbytes: int, group, alone, inside: bool, device) -> float:
    """Seconds one ``fully_shard`` unit of ``nbytes`` of parameters on ``group`` adds to a
    forward + backward, over the same unit on a world of one (``alone``): its all-gather before
    forward, again before backward, and the reduce-scatter of its gradients, each with the
    copies into and out of its flat buffers, called from the compute thread and waited for
    there (on a CPU nothing overlaps them: FSDP's streams are CUDA's).

    The unit's world-of-one bookkeeping is not in it: the model profile measures FSDP on a
    world of one for the model itself (``world_of_one_s``), and the predictor adds it once.
    (On 2 idle gloo workers: 4.6 ms for a unit of 1 KB to 72 KB, 10.8 ms for 1.5 MiB, where the
    bare collectives' fits, two all-gathers and a reduce-scatter, add to 2.1 and 5.8 ms.)"""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    p = dist.get_world_size(group) if inside else 1
    numel = max(p, nbytes // 4 // p * p)
    x = torch.ones(numel, device=device)

    def wrapped(on) -> nn.Module:
        unit = _Unit(numel).to(device)
        mesh = DeviceMesh.from_group(on, device.type)
        fully_shard(unit.inner, mesh=mesh)
        return fully_shard(unit, mesh=mesh)

    def step(module: nn.Module):
        module.zero_grad(set_to_none=True)
        module(x).backward()

    one, many = (wrapped(alone), wrapped(group)) if inside else (None, None)
    base = _timed((lambda: step(one)) if inside else (lambda: None), repeats_for(nbytes))
    sharded = _timed((lambda: step(many)) if inside else (lambda: None), repeats_for(nbytes))
    return max(0.0, sharded - base)


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


def _median_of(run, repeats: int = 50) -> float:
    run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_pipeline_hops(group, device, width: int = 64, microbatches: tuple[int, ...] = (4, 8), rounds: int = 9,
                         steps: int = 10) -> dict:
    """Step times of a real two-stage pipeline (ranks 0 and 1) over tiny stages, per schedule and
    micro-batch count, with each stage's plain forward and backward: what a message between
    stages costs inside the runtime (waking a waiting worker included), which a ping-pong
    between two busy workers underestimates. The micro-batch counts are those of the default
    (2 x stages) for 2 and 4 stages. Each step time is the median of ``rounds`` medians of
    ``steps`` steps, taken in turn with the others' (each round's median is kept as
    ``rounds_s``). With more workers than cores the machine slows the probe in episodes of a
    second or so: over 4 nodes on 2 cores, two of them busy, GPipe with 4 micro-batches read
    5.4-6.4 ms a step in most rounds and 10-14 ms in runs of a few. Three rounds of 30 steps
    then fitted a per-step overhead of 0.0 to 8.6 ms in 11 profiles of three placements; the
    median of nine rounds of 10 read 6.2-6.9 ms in four runs, in a third of the time. (An
    episode longer than most of the rounds still shows: one of nine link profiles in a
    benchmark.) Ranks 0 and 1 call this; rank 0 gets the result.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank(group)
    module = (nn.Sequential(nn.Linear(width, width), nn.ReLU()) if rank == 0 else nn.Linear(width, 10)).to(device)
    x = torch.randn(2, width, device=device)
    y = torch.randint(0, 10, (2,), device=device)
    runs = []
    for cls, name in ((ScheduleGPipe, "gpipe"), (Schedule1F1B, "1f1b")):
        for m in microbatches:
            stage = PipelineStage(module, rank, 2, device, group=group)
            schedule = cls(stage, m, loss_fn=F.cross_entropy, scale_grads=True)
            xs, ys = x.repeat(m, 1), y.repeat(m)
            if rank == 0:
                run = lambda s=schedule, xs=xs: s.step(xs, losses=[])  # noqa: E731  (bound now: the loop moves on)
            else:
                run = lambda s=schedule, ys=ys: s.step(target=ys, losses=[])  # noqa: E731
            runs.append(({"schedule": name, "microbatches": m}, run, []))
    for _ in range(rounds):  # alternated: a passing slowdown spoils a few rounds of each, not the median
        for _, run, samples in runs:
            samples.append(_median_of(run, repeats=steps))
    timed = [{**key, "step_s": statistics.median(samples), "rounds_s": samples} for key, _, samples in runs]
    inp = x.requires_grad_(rank > 0)
    grad = torch.ones(2, width, device=device)

    def forward_backward():  # the last stage's backward starts from the loss
        out = module(inp)
        (F.cross_entropy(out, y) if rank == 1 else out).backward(None if rank == 1 else grad)

    fwd = _median_of(lambda: module(inp))
    bwd = max(0.0, _median_of(forward_backward) - fwd)
    stage_s = [None, None]
    dist.all_gather_object(stage_s, (fwd, bwd), group=group)
    return {"steps": timed, "stage_s": stage_s, "message_bytes": 2 * width * 4}


def measure_pipelines_side_by_side(device, **probe) -> dict:
    """``measure_pipeline_hops`` on every worker at once, as a hybrid's replicas run: rank i
    with rank i + world/2 (stage s of replica d is rank s * dp + d), each pair its own
    pipeline. Every rank calls this and gets its own pair's probe, its "ranks" named."""
    world, rank = dist.get_world_size(), dist.get_rank()
    half = world // 2
    pairs = [dist.new_group([i, i + half]) for i in range(half)]  # every rank creates every group
    mine = [rank % half, rank % half + half]
    return {**measure_pipeline_hops(pairs[rank % half], device, **probe), "ranks": mine}


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
    conv = torch.nn.Conv2d(32, 32, 3, padding=1).to(device)
    x = torch.randn(8, 32, 28, 28, device=device, requires_grad=True)
    rank = dist.get_rank(group)

    def burn(n: int):
        for _ in range(n):
            conv(x).sum().backward()

    count = torch.tensor([0], device=device)
    if rank == 0:
        burn(3)
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < 0.05:
            burn(1)
            n += 1
        count[0] = max(1, round(n * target_s / (time.perf_counter() - start)))
    dist.broadcast(count, dist.get_global_rank(group, 0), group=group)
    n = int(count.item())
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
