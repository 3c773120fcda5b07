"""Collective micro-benchmarks on the real backend, and the latency + size/bandwidth fit.

``measure_collectives`` runs in every worker of a process group (gloo on CPU, NCCL on
GPUs) and times allreduce, all-gather, reduce-scatter, broadcast and a send/recv
ping-pong over message sizes from 16 bytes to tens of megabytes, and a ``fully_shard``
unit's gathers and reduce-scatter as FSDP drives them (``fsdp_unit``), because on a CPU
backend that costs measurably more than the bare collectives.

DDP's bucket allreduce is the plain one: DDP's own work around it (hooks, bucket copies) is
in the model profile, measured with the model's own buckets on a world of one. (Until session
56 the allreduce was timed once more as DDP drives it, and its excess over the plain one fitted
from the two sweeps. On emulated nodes at 10 Gbit/s that excess read 0.7-2.3 ms for a 1 MiB
bucket and predicted the mlp's DDP step 1.68x its local SGD's; measured, DDP over local SGD
averaging every step was 0.98-0.99 in the median of 69 pairs of cells over three runs.)

It runs inside a process group; its sweeps are fitted by the pure ``predict.fits``
(latency + size / bandwidth), which the predictor reads. What a step pays besides the
collectives (the pipelining runtime, computing side by side) is ``profile.step_probes``'.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn

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
    run()  # warm-up: connections, buffers
    return statistics.median(_time_once(run, repeats) for _ in range(trials))


def _time_once(run, repeats: int) -> float:
    """The slowest rank's mean seconds per call over ``repeats`` calls, started together."""
    device = _backend_device()
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / repeats], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def interleaved(makes: dict, sizes: list[int], time_once=_time_once, trials: int = 3) -> dict[tuple[str, int], float]:
    """``{(name, n): seconds}``: the median over ``trials`` passes, each of which times every
    collective of ``makes`` (``name -> make(n)``, a callable running one call of ``n`` bytes)
    at every size once, in turn, with ``time_once(run, repeats_for(n))``.

    Passes rather than a point's trials back to back: an episode of a few seconds in which this
    VM's vCPUs run other work then slows one trial of the points it overlaps, which the median
    drops, as long as it is shorter than a pass, where back to back it slowed every trial of the
    points it overlapped. (Issue 18: a 4-node link profile at 100 Mbit/s read the 4 KiB-1 MiB
    allreduce 32-100% slow, the same sizes' other collectives and the 4 MiB allreduce timed
    seconds later as usual, and every cell over that link was then predicted 19-23% over.)"""
    seen: dict[tuple[str, int], list[float]] = {}
    for trial in range(trials):
        for name, make in makes.items():
            for n in sizes:
                run = make(n)
                if trial == 0:
                    run()  # warm-up: connections, buffers
                seen.setdefault((name, n), []).append(time_once(run, repeats_for(n)))
    return {key: statistics.median(times) for key, times in seen.items()}


def sweep(time_of, sizes: list[int], slack: float = 1.5, margin_s: float = 50e-6, retries: int = 2,
          first: dict[int, float] | None = None, timed_again: dict | None = None) -> list[tuple[int, float]]:
    """``[(n, time_of(n))]`` over ``sizes``, where a size that took longer than ``slack`` times a
    larger size, or than ``slack`` times the line through the sizes either side of it (and
    ``margin_s`` more, either way), is timed again, up to ``retries`` times, the shortest time kept.

    A bigger message never takes less time on the same link, so such a point was slowed by
    something else: on a 2-core VM, an episode of a second or so in which the vCPUs run
    other work. One profile of a 1 Gbit/s emulated link read 0.80 and 0.65 ms one way at 4
    and 16 KiB and 0.39 ms at 64 KiB, where eight others read 0.07-0.08 ms at 4-16 KiB; the
    monotone fit then put every message of 1-64 KiB at 0.61 ms, and the mlp's 2-stage GPipe
    over that link, whose messages are that size, 40% over its measure (issue 18, run52).
    Timed again a sweep later, past the episode, the point reads what the link does.

    Nor does a message cost more than the line through its neighbours by much: between two
    sizes a collective's time is latency plus bytes over a rate (``predict.fits``), which that
    line follows. A 100 Mbit/s link read 0.50 ms at 4 KiB between 0.10 at 1 KiB and 0.71 at
    16 KiB (0.22 on the line; the same link's other profiles 0.18-0.23), under 1.5x the larger
    size; the fit through it put the mlp's 16 KB stage messages at 0.91 ms, and its 2-stage
    1F1B over that link 42% over its measure (issue 18, run85n). In 34 stored profiles 73 of
    2,472 points sat that far above their neighbours' line, about 2 a profile, a second to time
    again. ``time_of`` returns the same value on every rank (``_timed`` takes the slowest), so
    every rank times the same sizes again. ``first``: the sizes' times taken already
    (``interleaved``); ``timed_again``, where given, gets ``{n: [first time, time kept]}`` for
    every size timed again, so that a profile shows where the rules fired."""
    times = dict(first) if first is not None else {n: time_of(n) for n in sizes}

    def again(n: int, bound: float) -> None:
        for _ in range(retries):
            if times[n] <= slack * bound + margin_s:
                return
            was, times[n] = times[n], min(times[n], time_of(n))
            if timed_again is not None:
                timed_again[n] = [timed_again.get(n, [was])[0], times[n]]

    floor = math.inf  # the shortest time of any larger size
    for n in sorted(sizes, reverse=True):
        again(n, floor)
        floor = min(floor, times[n])
    ordered = sorted(sizes)
    for lo, n, hi in zip(ordered, ordered[1:], ordered[2:]):  # then against its neighbours' line
        again(n, times[lo] + (times[hi] - times[lo]) * (n - lo) / (hi - lo))
    return [(n, times[n]) for n in sizes]


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


def measure_collectives(group, group_ranks: list[int], pair: tuple[int, int] | None, sizes: list[int], device,
                        alone) -> tuple[dict, list[str], dict]:
    """Every rank of the world calls this; returns ({collective: [(bytes, seconds)]}, notes,
    {collective: {bytes: [first seconds, seconds kept]}} of the sizes ``sweep`` timed again).

    The ranks of ``group_ranks`` run the collectives on ``group``; ranks outside it, if
    any, keep a core busy and join the barriers (``background_load``); ``pair`` runs the
    send/recv ping-pong (None: not timed, another group of the tier times it); ``alone`` is
    this rank's group of one (``fsdp_unit``'s baseline; ``dist.new_subgroups(group_size=1)``).
    A collective the backend lacks is skipped and named in the notes.
    """
    with background_load(dist.get_rank() not in group_ranks):
        return _measure_collectives(group, group_ranks, pair, sizes, device, alone)


def _measure_collectives(group, group_ranks, pair, sizes, device, alone) -> tuple[dict, list[str], dict]:
    inside = dist.get_rank() in group_ranks
    makes: dict[str, object] = {}  # name -> make(n): one call of n bytes (a round trip for sendrecv)
    halves = {"sendrecv": 2}  # a ping-pong's one-way time is half its round trip
    notes: list[str] = []
    for name in COLLECTIVES:
        if name == "sendrecv":
            if pair is not None:  # None: not timed, another group of the tier times it
                makes[name] = lambda n: _ping_pong(n, *pair, device)
            continue
        if name == "fsdp_unit":  # timed after the others, alone: it builds a module per size
            continue
        make = (lambda n, name=name: _op(name, n, group, group_ranks, device)) if inside else (lambda n: (lambda: None))
        if not _supported(make(sizes[0])):
            notes.append(f"{name} skipped: the {dist.get_backend()} backend does not run it")
            continue
        makes[name] = make
    first = interleaved(makes, sizes)
    results: dict[str, list[tuple[int, float]]] = {}
    again: dict[str, dict[int, list[float]]] = {}
    for name, make in makes.items():
        half = halves.get(name, 1)
        results[name] = sweep(lambda n, make=make, half=half: _timed(make(n), repeats_for(n)) / half, sizes,
                              first={n: first[name, n] / half for n in sizes}, timed_again=again.setdefault(name, {}))
    # a unit's step costs 3 collectives and more: the fit carries it past 16 MiB
    results["fsdp_unit"] = [(n, _fsdp_unit_cost(n, group, alone, inside, device)) for n in sizes if n <= 16 * 2**20]
    return results, notes, {name: by_size for name, by_size in again.items() if by_size}


def measure_link_alone(pair: tuple[int, int], sizes: list[int], device) -> list[tuple[int, float]]:
    """One-way send/recv seconds between ``pair`` at the two largest ``sizes``, with every other
    rank idle in the barriers: the link's own rate, which ``link_rate`` reads as the marginal
    rate between the two (the latency cancels out).

    The collective sweep keeps the ranks outside a group busy, as the job's other workers are
    (``background_load``): right for predicting a step, but on emulated nodes with more workers
    than cores it measured the network, not the link: 2 nodes x 2 workers on 2 cores read a
    10 Gbit/s link at 7.0 Gbit/s (-30%) beside two busy ranks and at 9.6 Gbit/s (-4%) with them
    idle (issue 18)."""
    return [(n, _timed(_ping_pong(n, *pair, device), repeats_for(n), trials=1) / 2) for n in sorted(sizes)[-2:]]


class _Flat(nn.Module):
    """One parameter of ``numel`` floats whose gradient backward produces at its very end."""

    def __init__(self, numel: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def _excess_over_alone(wrap, numel: int, nbytes: int, group, alone, inside: bool, device) -> float:
    """Seconds a forward + backward of ``wrap(group)`` takes beyond ``wrap(alone)``'s, the same
    module on this rank's world of one (``wrap(on)``: a new module over ``numel`` floats, its
    parallel wrapper on process group ``on``). Ranks outside ``group`` time nothing but join
    every barrier."""
    x = torch.ones(numel, device=device)

    def step(module: nn.Module):
        module.zero_grad(set_to_none=True)
        module(x).backward()

    one, many = (wrap(alone), wrap(group)) if inside else (None, None)
    base = _timed((lambda: step(one)) if inside else (lambda: None), repeats_for(nbytes))
    return max(0.0, _timed((lambda: step(many)) if inside else (lambda: None), repeats_for(nbytes)) - base)


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
    numel = max(p, nbytes // 4 // p * p)  # shards evenly

    def wrapped(on) -> nn.Module:
        unit = _Unit(numel).to(device)
        mesh = DeviceMesh.from_group(on, device.type)
        fully_shard(unit.inner, mesh=mesh)
        return fully_shard(unit, mesh=mesh)

    return _excess_over_alone(wrapped, numel, nbytes, group, alone, inside, device)
