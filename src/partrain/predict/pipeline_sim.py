"""A discrete-event simulation of the pipeline schedules partrain runs.

Each worker (pipeline rank) executes its list of actions in order, exactly the order
``torch.distributed.pipelining`` uses (``predict.schedules``: GPipe, 1F1B, interleaved 1F1B).

An action starts when its rank is free and its input has arrived: the forward of micro-batch
m on stage s needs stage s-1's forward of m, the backward needs stage s+1's backward of m.
Transfers are rendezvous, as gloo's point-to-point messages are: a message moves once the
sender has issued it and the receiver's notice that it posted the matching receive (sent when
the runtime reaches the action that needs it) has reached the sender; then it takes the
boundary's transfer time and occupies no worker. Each direction between two ranks is one
connection (gloo's pair, one TCP stream): its messages go one after another, each holding it
for the time its bytes take on the wire (on a policed link, what its token bucket's credit
leaves to pace), and a notice travels behind whatever is on its way in its direction. On a
slow link this is what 1F1B pays: a stage posts the receive of its next forward right after
sending a gradient back (``Schedule1F1B`` fuses the two), so the next activation waits for
that gradient to cross first. At the end of a step a rank waits until its sends were
received (the runtime waits on its send requests before returning from ``step``). Actions
computing at once share the machine: each runs ``slowdown(k)`` times longer while k compute,
the slowdown the hardware profile measured for k workers side by side, never less than
processor sharing of the cores (Kleinrock, "Queueing Systems", vol. 2, 1976). On a CPU host,
a stage woken by a message while its sender computes on without a pause (GPipe's first stage
runs its forwards back to back, its last stage its backwards) queues behind the sender on a
core: it starts ``busy_sender_s`` later (measured), or as soon as the sender waits for
anything; a stage that receives right after sending (1F1B's steady state) pauses in gloo's
rendezvous and lets it run. With more workers than cores, an action whose rank waited before
it takes its stage's cold time, where given: another worker ran on its core and wrote over
its caches meanwhile. Several consecutive steps are simulated and rank 0's steady-state
period is the step time, as the training loop measures it there. The bubble is nothing but
the idle time this produces: no closed-form formula is used."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from partrain.predict.schedules import Action

EPS = 1e-12


@dataclass(frozen=True)
class StepWork:
    """Work a rank does outside the schedule each step (loading data, allreduce, optimizer)."""

    name: str
    seconds: float
    cpu: bool = True  # False for communication: it waits, it does not compute


@dataclass(frozen=True)
class PipelineCosts:
    """Seconds per micro-batch at full speed, per stage; transfers per stage boundary."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    send_fwd: tuple[float, ...]  # stage s's output to stage s + 1 (last entry unused)
    send_bwd: tuple[float, ...]  # the gradient of stage s's input to stage s - 1 (first entry unused)
    before: tuple[tuple[StepWork, ...], ...] = ()  # per rank, ahead of the schedule
    after: tuple[tuple[StepWork, ...], ...] = ()  # per rank, after it
    # the part of send_fwd / send_bwd for which the message holds its connection (its bytes on
    # the wire); the rest is latency. Empty: messages never queue (as on a fast link)
    wire_fwd: tuple[float, ...] = ()
    wire_bwd: tuple[float, ...] = ()
    # per stage, its forward and backward from cold caches: what an action takes when its rank
    # waited before it, and another worker used its core meanwhile. Empty: never cold
    fwd_cold: tuple[float, ...] = ()
    bwd_cold: tuple[float, ...] = ()
    # per stage, (comm.Bucket, bytes) of its message where the link polices it (a token bucket);
    # then its wire time depends on the credit left (``simulate``). Empty or None: as measured
    bucket_fwd: tuple = ()
    bucket_bwd: tuple = ()

    def __post_init__(self) -> None:
        # a NaN never compares as later or earlier, so the event loop would wait for it forever
        times = [*self.fwd, *self.bwd, *self.send_fwd, *self.send_bwd, *self.wire_fwd, *self.wire_bwd,
                 *self.fwd_cold, *self.bwd_cold]
        if not all(math.isfinite(t) and t >= 0 for t in times):
            raise ValueError(f"pipeline costs must be finite seconds >= 0, got {times}")

    def without_transfers(self) -> PipelineCosts:
        zero = tuple(0.0 for _ in self.fwd)
        return replace(self, send_fwd=zero, send_bwd=zero, wire_fwd=(), wire_bwd=(), bucket_fwd=(), bucket_bwd=())

    def wire(self, kind: str, stage: int) -> float:
        """How long the message ``kind`` ("F" or "B") of ``stage`` to its neighbour holds its connection."""
        wires = self.wire_fwd if kind == "F" else self.wire_bwd
        return wires[stage] if wires else 0.0

    def bucket(self, kind: str, stage: int):
        buckets = self.bucket_fwd if kind == "F" else self.bucket_bwd
        return buckets[stage] if buckets else None


@dataclass
class SimResult:
    step_s: float  # steady-state seconds per step on rank 0
    busy: list[dict[str, float]]  # per rank: seconds per step spent in each kind of work
    max_in_flight: list[int]  # per stage: most micro-batches forwarded but not yet backwarded
    spans: list[tuple[int, str, int, int, float, float]] = field(default_factory=list)  # (rank, kind, stage, mb, start, end), one step

    def idle(self, rank: int) -> float:
        return max(0.0, self.step_s - sum(self.busy[rank].values()))

    def bubble_fraction(self, rank: int = 0) -> float:
        return self.idle(rank) / self.step_s if self.step_s > 0 else 0.0


@dataclass
class _Op:
    rank: int
    kind: str
    stage: int
    mb: int
    step: int
    work: float
    cpu: bool
    waits: tuple[tuple, ...] = ()  # actions (on other ranks) that must have started first
    start: float = math.nan
    end: float = math.nan
    left: float = 0.0


def _key(op: _Op) -> tuple:
    return op.kind, op.stage, op.mb, op.step


def _consumers(order: list[Action], rank: int, rank_of: dict[int, int], n_stages: int, step: int) -> tuple[tuple, ...]:
    """The actions on other ranks that receive what ``order`` sends."""
    out = []
    for a in order:
        nxt = a.stage + 1 if a.kind == "F" else a.stage - 1
        if 0 <= nxt < n_stages and rank_of[nxt] != rank:
            out.append((a.kind, nxt, a.mb, step))
    return tuple(out)


def _build_ops(orders, costs: PipelineCosts, steps: int, rank_of: dict[int, int]) -> list[list[_Op]]:
    ranks = []
    for r, order in enumerate(orders):
        ops = []
        for k in range(steps):
            for seg in costs.before[r] if costs.before else ():
                ops.append(_Op(r, seg.name, -1, -1, k, seg.seconds, seg.cpu))
            for a in order:
                work = costs.fwd[a.stage] if a.kind == "F" else costs.bwd[a.stage]
                ops.append(_Op(r, a.kind, a.stage, a.mb, k, work, True))
            ops.append(_Op(r, "sends", -1, -1, k, 0.0, False, _consumers(order, r, rank_of, len(costs.fwd), k)))
            for seg in costs.after[r] if costs.after else ():
                ops.append(_Op(r, seg.name, -1, -1, k, seg.seconds, seg.cpu))
        ranks.append(ops)
    return ranks


def no_sharing(computing: int) -> float:
    return 1.0


def simulate(orders: list[list[Action]], costs: PipelineCosts, slowdown: Callable[[int], float] = no_sharing,
             steps: int = 4, busy_sender_s: float = 0.0) -> SimResult:
    """Run ``steps`` steps of the schedule ``orders`` (one action list per rank).

    ``slowdown(k)``: how many times longer each of ``k`` actions computing at once takes than
    it would alone (the cores, caches and memory bandwidth they share); communication waits
    and is never slowed. ``busy_sender_s``: how much later a waiting receiver wakes for a
    message that arrives while its sender computes, at most until the sender stops computing.
    """
    n_stages = len(costs.fwd)
    n_ranks = len(orders)
    rank_of = {a.stage: r for r, order in enumerate(orders) for a in order}
    ranks = _build_ops(orders, costs, steps, rank_of)
    done: dict[tuple, float] = {}
    started: dict[tuple, float] = {}
    idx = [0] * n_ranks
    free = [0.0] * n_ranks
    running: dict[int, _Op] = {}
    in_flight = [0] * n_stages
    max_in_flight = [0] * n_stages
    t = 0.0

    by_key = {_key(op): op for ops in ranks for op in ops if op.kind in ("F", "B")}
    channel: dict[tuple[int, int], float] = defaultdict(float)  # (sender, receiver): when its wire frees up
    credit: dict[tuple[int, int], tuple[float, float]] = {}  # (sender, receiver): a bucket's bytes, as of when
    notice: dict[tuple, float] = {}  # receiving action: when its sender learns the receive is posted
    arrives: dict[tuple, float] = {}  # receiving action: when its input from another rank is in
    goes_on: set[tuple] = set()  # sending actions whose rank computes on without a pause after them
    pauses: list[list[float]] = [[] for _ in range(n_ranks)]  # per rank: when it reached work it waits for

    def message(op: _Op) -> tuple[tuple, int, float, float] | None:
        """The input ``op`` receives: (the action producing it, that action's rank, seconds from
        leaving to arriving, seconds of it on the wire); None for a stage's own first input and
        for work outside the schedule."""
        if op.kind == "F" and op.stage > 0:
            src, hop = op.stage - 1, costs.send_fwd[op.stage - 1]
        elif op.kind == "B" and op.stage < n_stages - 1:
            src, hop = op.stage + 1, costs.send_bwd[op.stage + 1]
        else:
            return None
        return (op.kind, src, op.mb, op.step), rank_of[src], hop, costs.wire(op.kind, src)

    def deliver(op: _Op) -> None:
        """Send ``op``'s input once it is computed and its receive's notice is in, after the
        messages already on the sender's connection to ``op``'s rank. On a policed link the
        message's wire time is what the bucket's credit leaves to pace (``comm.Bucket``): the
        credit refills at the rate while the connection idles, up to the burst."""
        producer, sender, hop, wire = message(op)
        k, way = _key(op), (sender, op.rank)
        if k in arrives or k not in notice or producer not in done:
            return
        start = max(done[producer], notice[k], channel[way])
        if (policed := costs.bucket(op.kind, producer[1])) is not None:
            bucket, nbytes = policed
            have, since = credit.get(way, (bucket.burst_bytes, start))
            have = min(bucket.burst_bytes, have + (start - since) / bucket.rate_s_per_byte)
            paced = bucket.wire(nbytes, have)
            hop, wire = hop - wire + paced, paced
            credit[way] = (have - nbytes, start) if nbytes <= have else (0.0, start + paced)
        channel[way] = start + wire
        arrives[k] = start + hop

    def post(r: int) -> None:
        """Rank ``r`` reached its next action: if its input comes from another rank, post the
        receive, whose notice leaves behind what ``r`` is already sending that way."""
        if idx[r] >= len(ranks[r]):
            return
        op = ranks[r][idx[r]]
        msg = message(op)
        if msg is None or msg[1] == r:
            if not op.cpu or op.work <= EPS or op.waits:
                pauses[r].append(t)
            elif idx[r] > 0 and ranks[r][idx[r] - 1].kind in ("F", "B"):
                goes_on.add(_key(ranks[r][idx[r] - 1]))
            return
        pauses[r].append(t)  # a receive from another rank: gloo's rendezvous waits for its data
        notice[_key(op)] = max(t, channel[r, msg[1]])
        deliver(op)

    def ready_at(op: _Op) -> float | None:
        """When ``op`` can start; None while an action it waits for has not finished."""
        if op.waits:  # the step's end: every message this rank sent has been received
            starts = [started.get(key) for key in op.waits]
            return None if None in starts else max([free[op.rank], *starts])
        msg = message(op)
        if msg is None:
            return free[op.rank]
        producer, sender, _, _ = msg
        if sender == op.rank:
            at = done.get(producer)
            return None if at is None else max(free[op.rank], at)
        at = arrives.get(_key(op))
        if at is None or busy_sender_s <= 0 or at <= free[op.rank] or producer not in goes_on:
            return None if at is None else max(free[op.rank], at)
        # the message came in while the rank waited for it, and its sender went on computing
        # without a pause after sending it: the woken receiver queues behind the sender until
        # the sender pauses (waits for anything) or ``busy_sender_s`` is over
        after = bisect_left(pauses[sender], done[producer])
        pause = pauses[sender][after] if after < len(pauses[sender]) else math.inf
        return max(at, min(at + busy_sender_s, pause))

    def finish(op: _Op) -> None:
        op.end = t
        done[_key(op)] = t
        free[op.rank] = t
        if op.kind in ("F", "B"):  # its output leaves first: the runtime sends before it receives
            nxt = op.stage + 1 if op.kind == "F" else op.stage - 1
            consumer = by_key.get((op.kind, nxt, op.mb, op.step))
            if consumer is not None and consumer.rank != op.rank:
                deliver(consumer)
        idx[op.rank] += 1
        post(op.rank)
        if op.kind == "B":
            in_flight[op.stage] -= 1

    for r in range(n_ranks):
        post(r)

    while any(idx[r] < len(ranks[r]) for r in range(n_ranks)):
        progress = True
        while progress:  # start everything that can start now (zero-length work finishes at once)
            progress = False
            for r in range(n_ranks):
                if r in running or idx[r] >= len(ranks[r]):
                    continue
                op = ranks[r][idx[r]]
                at = ready_at(op)
                if at is None or at > t + EPS:
                    continue
                if op.kind in ("F", "B") and costs.fwd_cold and t > free[r] + EPS:  # it waited, so its
                    op.work = (costs.fwd_cold if op.kind == "F" else costs.bwd_cold)[op.stage]  # caches went cold
                op.start, op.left, progress = t, op.work, True
                started[(op.kind, op.stage, op.mb, op.step)] = t
                if op.kind == "F":
                    in_flight[op.stage] += 1
                    max_in_flight[op.stage] = max(max_in_flight[op.stage], in_flight[op.stage])
                if op.work <= EPS:
                    finish(op)
                else:
                    running[r] = op
        computing = sum(op.cpu for op in running.values())
        shared = 1.0 / slowdown(computing) if computing else 1.0
        rate = {r: shared if op.cpu else 1.0 for r, op in running.items()}
        upcoming = [at for r in range(n_ranks) if r not in running and idx[r] < len(ranks[r])
                    if (at := ready_at(ranks[r][idx[r]])) is not None and at > t + EPS]
        ends = [t + op.left / rate[r] for r, op in running.items()]
        if not upcoming and not ends and all(idx[r] == len(ranks[r]) for r in range(n_ranks)):
            break
        if not upcoming and not ends:
            raise RuntimeError("pipeline simulation deadlocked: the schedule waits on an action that never runs")
        nxt = min(upcoming + ends)
        for r, op in list(running.items()):
            op.left -= (nxt - t) * rate[r]
        t = nxt
        for r, op in list(running.items()):
            # done, or so little left that adding it no longer moves the clock (a float's precision
            # runs out at clocks ~1e16 times the work: waiting for it would loop forever)
            if op.left <= EPS * max(1.0, op.work) or t + op.left / rate[r] <= t:
                del running[r]
                finish(op)
    return _summarize(ranks, steps, max_in_flight)


def _summarize(ranks: list[list[_Op]], steps: int, max_in_flight: list[int]) -> SimResult:
    """Steady state: rank 0's period between the ends of step 1 and of the last step."""
    first, last = 1, steps - 1
    end = lambda r, k: max(op.end for op in ranks[r] if op.step == k)  # noqa: E731
    step_s = (end(0, last) - end(0, first)) / (last - first)
    busy = []
    for ops in ranks:
        per_kind: dict[str, float] = defaultdict(float)
        for op in ops:
            if first < op.step <= last:
                per_kind[op.kind] += (op.end - op.start) / (last - first)
        busy.append(dict(per_kind))
    spans = [(op.rank, op.kind, op.stage, op.mb, op.start, op.end) for ops in ranks for op in ops if op.step == last]
    return SimResult(step_s, busy, max_in_flight, spans)
