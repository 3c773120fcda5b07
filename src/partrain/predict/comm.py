"""Communication time of collectives and point-to-point transfers on a hardware profile.

A collective measured at this group size and link tier is read off its fitted curve. Any
other group size is derived from the nearest measured one, and a cluster described only by
its links (TOML) from the point-to-point link itself, by the standard cost of each
algorithm in the alpha-beta model (Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 2005; Patarasuk & Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009), for n bytes on p ranks:

- allreduce (ring): 2(p-1) steps, 2(p-1)/p x n bytes on each link;
- all-gather, reduce-scatter (ring): p-1 steps, (p-1)/p x n (n: the full, gathered size);
- broadcast (binomial tree): ceil(log2 p) steps, each sending all n;
- send/recv: 1 step, n;
- an FSDP unit's step (``fsdp_unit``): its two all-gathers (forward, backward) and its
  reduce-scatter, 3(p-1) steps, 3(p-1)/p x n.

A group spanning nodes is limited by the inter-node link, or by the link within a node where
that is the slower one and the group holds several ranks of a node.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from partrain.predict.fits import CostFit, Segment
from partrain.predict.profiles import HardwareProfile


def algorithm_factors(name: str, p: int) -> tuple[float, float]:
    """(latency steps, bytes per link as a multiple of n) of collective ``name`` on ``p`` ranks."""
    if name == "allreduce":
        return 2 * (p - 1), 2 * (p - 1) / p
    if name in ("all_gather", "reduce_scatter"):
        return p - 1, (p - 1) / p
    if name == "broadcast":
        depth = math.ceil(math.log2(p))
        return depth, depth
    if name == "sendrecv":
        return 1, 1
    if name == "fsdp_unit":
        return 3 * (p - 1), 3 * (p - 1) / p
    raise ValueError(f"unknown collective {name!r}")


def node_of(hw: HardwareProfile, rank: int) -> int:
    """Ranks fill nodes in order, as torchrun, mpirun and srun place them by default."""
    return 0 if hw.nodes <= 1 else rank // hw.workers_per_node


def tier_of(hw: HardwareProfile, ranks: list[int]) -> str:
    return "intra" if len({node_of(hw, r) for r in ranks}) <= 1 else "inter"


def _fit_for(hw: HardwareProfile, name: str, p: int, tier: str) -> CostFit:
    measured = {k: fits[name] for k, fits in hw.collectives.get(tier, {}).items() if name in fits}
    if p in measured:
        return measured[p]
    steps, volume = algorithm_factors(name, p)
    if measured:  # the nearest measured group size, rescaled by the algorithm's cost
        p0 = min(measured, key=lambda k: (abs(math.log(k / p)), -k))
        steps0, volume0 = algorithm_factors(name, p0)
        return measured[p0].scaled(steps / steps0, volume / volume0)
    link = hw.links.get(tier) or hw.links["intra"]
    return link.scaled(steps, volume)


def with_link_bytes_scaled(hw: HardwareProfile, factor: float) -> HardwareProfile:
    """``hw`` with its slowest link (between nodes, else within the node) ``factor`` times
    slower per byte on the wire, latencies and everything else as measured.

    The wire's share of a collective's cost per byte is the bytes its algorithm puts on each
    link (``algorithm_factors``) at the link's own cost per byte for large messages; the rest
    (the CPU's copies and reductions) stays. On issue 18's emulated nodes at 10 Gbit/s, the
    4-node allreduce cost 2.35 ns a byte over a link of 0.81: 1.2 of it on the wire (1.5 x
    0.81), the rest copying. At 1 Gbit/s it cost 11.5; this predicts 13.3, where scaling the
    whole 2.35 by 10 said 23.5, and "with a 10x slower link, serial would win" where local SGD
    was measured fastest. A cluster file's collectives come from its link: they scale whole.
    """
    tier = "inter" if hw.nodes > 1 else "intra"
    if tier not in hw.links:
        return hw
    wire = hw.links[tier].segments[-1].seconds_per_byte

    def scaled(fit: CostFit, volume: float) -> CostFit:
        return CostFit(tuple(
            Segment(s.upto_bytes, s.latency_s, s.seconds_per_byte + (factor - 1) * min(s.seconds_per_byte, volume * wire))
            for s in fit.segments))

    collectives = {t: {p: {name: scaled(fit, algorithm_factors(name, p)[1]) for name, fit in fits.items()}
                       for p, fits in by.items()} if t == tier else by for t, by in hw.collectives.items()}
    links = {t: scaled(fit, 1.0) if t == tier else fit for t, fit in hw.links.items()}
    return replace(hw, links=links, collectives=collectives, points=_sweep_scaled(hw, tier, factor))


def _sweep_scaled(hw: HardwareProfile, tier: str, factor: float) -> dict:
    """``hw.points`` with the ``tier``'s send/recv sweep ``factor`` times slower past its latency:
    a policed link's bucket (``link_bucket``) keeps its burst, at that much the rate."""
    sweep = hw.sendrecv_points(tier)
    if not sweep:
        return hw.points
    latency = _sweep_latency(sweep)
    group = str(hw.nodes) if tier == "inter" else next(iter(hw.points[tier]))
    slower = [[b, latency + max(0.0, t - latency) * factor] for b, t in sweep]
    by_size = {**hw.points[tier], group: {**hw.points[tier][group], "sendrecv": slower}}
    return {**hw.points, tier: by_size}


def _sweep_latency(sweep: list[list[float]]) -> float:
    """A send/recv sweep's latency: the median of its three smallest messages' times."""
    return statistics.median(t for _, t in sweep[:3])


def collective_time(hw: HardwareProfile, name: str, nbytes: float, ranks: list[int]) -> float:
    """Seconds for collective ``name`` of ``nbytes`` over the global ``ranks``."""
    p = len(ranks)
    if p <= 1 or nbytes <= 0:
        return 0.0
    tier = tier_of(hw, ranks)
    seconds = _fit_for(hw, name, p, tier).time(nbytes)
    nodes = [node_of(hw, r) for r in ranks]
    if tier == "inter" and not hw.collectives.get("inter") and len(set(nodes)) < p:
        # a cluster file's ring over nodes with several ranks on a node crosses the link within
        # the node too: the slower of the two paces it (PCIe within, InfiniBand between, say)
        seconds = max(seconds, hw.links["intra"].scaled(*algorithm_factors(name, p)).time(nbytes))
    return seconds


def transfer_time(hw: HardwareProfile, nbytes: float, src: int, dst: int) -> float:
    """Seconds to send ``nbytes`` from global rank ``src`` to ``dst`` (0 on the same worker)."""
    if src == dst or nbytes <= 0:
        return 0.0
    return _fit_for(hw, "sendrecv", 2, tier_of(hw, [src, dst])).time(nbytes)


def wire_time(hw: HardwareProfile, nbytes: float, src: int, dst: int) -> float:
    """Seconds ``nbytes`` from global rank ``src`` to ``dst`` hold their connection: the
    point-to-point fit's cost per byte, without its latency (0 on the same worker)."""
    if src == dst or nbytes <= 0:
        return 0.0
    fit = _fit_for(hw, "sendrecv", 2, tier_of(hw, [src, dst]))
    return nbytes * fit.segment(nbytes).seconds_per_byte


def stage_transfer_time(hw: HardwareProfile, nbytes: float, src: int, dst: int, replicas: int = 1,
                        stages: int = 2, action_s: float | None = None, tensors: int = 1) -> float:
    """Seconds for a pipeline stage's message from global rank ``src`` to ``dst``.

    On a measured machine, what the pipelining runtime adds to a message beyond its link
    (waking the waiting stage, the runtime's send/recv bookkeeping) is the hardware
    profile's two-stage probe (ranks 0 and 1, within a node or, one worker per node, across
    two) less that link's point-to-point time for the probe's message; every hop pays it,
    plus its own link's point-to-point time for its bytes. (Issue 18: across emulated nodes
    the probe's hop was 0.33-0.37 ms on every link, the ping-pong's one-way time a fraction
    of it; the point-to-point fit alone left 2-stage pipelines 35-42% under their measure.)
    ``replicas`` pipelines side by side take the probe run on every worker at once where it
    was measured, and a pipeline over every worker the probe run that way
    (``HardwareProfile.runtime_of``), as it cost over stages whose actions took ``action_s``.
    Without a probe (a cluster file): the point-to-point fit.

    The hop is the probe's, plus the link's time for this message beyond the probe's own
    (``hop + link(n) - link(probe)``, held at 0), as ``profile.pipeline_fits`` fitted it. A
    4-worker profile's pair ping-pong, timed beside two busy workers on 2 cores, can read
    slower than the whole probe's hop (issue 17's run112u: 1.36 ms one way at 16 B to 1 MB,
    the probe's hop 0.49 ms): taking the runtime's part as at least 0 and the ping-pong whole
    on top put 4-stage pipelines of a tuple-returning model 36-51% over their measure, where
    the hop as fitted reads them at -3% to +12%.

    A message of ``tensors`` tensors (a block returning a tuple) is that many point-to-point
    sends, batched by ``batch_isend_irecv``, which on gloo posts each on its own: every one after
    the first pays the link's latency again. Ping-pong on this 2-core VM, 8x16x32 floats and an
    8x16 int64 tensor: 0.055 ms one way alone, 0.095-0.149 with the ids beside them.
    """
    if src == dst or nbytes <= 0:
        return 0.0
    link = transfer_time(hw, nbytes, src, dst) + (tensors - 1) * transfer_time(hw, 1, src, dst)
    runtime = hw.runtime_of(replicas, stages, action_s)
    if runtime.hop_s is None:
        return link
    probe_bytes = (hw.points.get("pipeline") or {}).get("message_bytes", 0)
    return max(0.0, runtime.hop_s + link - transfer_time(hw, probe_bytes, *runtime.probe_ranks))


@dataclass(frozen=True)
class Bucket:
    """A policed link: a token bucket (``tc tbf``, a cloud network's rate limit) lets a message
    through at once while it holds credit, the rest at the policed rate, and refills at that
    rate up to ``burst_bytes`` while the link idles."""

    burst_bytes: float
    rate_s_per_byte: float  # the policed rate

    def wire(self, nbytes: float, credit: float) -> float:
        """Seconds ``nbytes`` hold the link when the bucket holds ``credit`` bytes."""
        return max(0.0, nbytes - max(0.0, credit)) * self.rate_s_per_byte


MIN_BURST_BYTES = 4096  # below a few frames a bucket changes no message's time measurably


def link_bucket(hw: HardwareProfile, src: int, dst: int) -> Bucket | None:
    """The token bucket of the link between the nodes of global ranks ``src`` and ``dst``,
    fitted to the send/recv sweep ``profile --hardware`` timed across them: a message of s
    bytes takes latency + max(0, s - burst) / rate (the burst's own bytes cross at the speed of
    the hosts' interfaces, inside the latency), so each message the rate paces (at least half
    its rate's time, and more than the latency, over the latency) gives burst = s - (time -
    latency) x rate; the burst is their median. Issue 18's links, whose ``tbf`` holds 1 ms of
    the rate: 12.6 kB fitted at 100 Mbit/s (64 kB took 4.57 ms one way, 256 kB 21.0), 128 kB at
    1 Gbit/s (12.5 and 125 shaped). None within a node, without a sweep (a cluster file), or
    where no burst shows: a link that serialises every message at its rate, as a real one does."""
    if src == dst or tier_of(hw, [src, dst]) != "inter":
        return None
    points = hw.sendrecv_points("inter")
    if len(points) < 4 or points[-1][1] <= points[-2][1]:
        return None
    (b1, t1), (b2, t2) = points[-2:]
    rate = (t2 - t1) / (b2 - b1)
    latency = _sweep_latency(points)
    paced = [b - (t - latency) / rate for b, t in points if t - latency > max(0.5 * b * rate, latency)]
    burst = statistics.median(paced) if paced else 0.0
    if burst < MIN_BURST_BYTES:
        return None
    return Bucket(burst, rate)
