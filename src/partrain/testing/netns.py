"""Emulated nodes: network namespaces on one machine, joined by shaped links.

``EmulatedNodes(n, Link(rate_mbit=1000))`` makes n "nodes" on this machine, each a network
namespace of its own with one interface ``eth0`` at 192.0.2.<i+1>/24 (the documentation
range, RFC 5737: never a real host), all plugged into a bridge that lives in a hub namespace
of its own. Nothing is added to the machine's own namespace: no address, no route, no
interface. Every link is shaped in both directions with ``tc``: a token bucket (``tbf``)
for the rate and, where the kernel has ``sch_netem``, a delay::

    node 0 [eth0 192.0.2.1] ==veth== [bridge in the hub] ==veth== [eth0 192.0.2.2] node 1
          tbf rate R (egress)        tbf rate R (toward each node)

So a message from node 0 to node 1 crosses two shaped queues of rate R: the slower of
them limits it to R, as one link of rate R would. Processes on a node see only ``lo`` and
``eth0``; ``run``/``popen`` start them there with ``GLOO_SOCKET_IFNAME=eth0``.

The namespaces are always torn down: on leaving the ``with`` block, on an exception, on
SIGTERM, at interpreter exit; and namespaces that a killed (SIGKILL) harness left behind
are found by the pid in their name and removed the next time one starts. Needs root and
``iproute2``; ``available()`` says why not where it cannot run, and tests skip on it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field

PREFIX = "ptn"  # namespaces are named ptn<pid>-<tag>: the pid says whether their owner still lives
SUBNET = "192.0.2"  # TEST-NET-1 (RFC 5737), inside the namespaces only


@dataclass(frozen=True)
class Link:
    """How every node reaches the bridge: a rate in Mbit/s (None: unshaped) and a one-way delay
    in ms (needs the kernel's netem; 0 or None: none)."""

    rate_mbit: float | None = None
    delay_ms: float | None = None

    def describe(self) -> str:
        parts = [f"{self.rate_mbit:g} Mbit/s" if self.rate_mbit else "unshaped"]
        if self.delay_ms:
            parts.append(f"{self.delay_ms:g} ms")
        return ", ".join(parts)


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", "netns", "exec", ns, *args] if ns else list(args)
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def available() -> str | None:
    """None if emulated nodes can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "emulated nodes need root (network namespaces)"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "emulated nodes need iproute2 (ip, tc)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("ip", "netns", "del", probe, check=False)
    return None


def has_netem() -> bool:
    """Whether the kernel can delay packets (sch_netem); without it links have a rate only."""
    probe = f"{PREFIX}{os.getpid()}-netem"
    _ip("ip", "netns", "add", probe, check=False)
    try:
        return _ip("tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", ns=probe, check=False).returncode == 0
    finally:
        _ip("ip", "netns", "del", probe, check=False)


def remove_stale() -> list[str]:
    """Remove namespaces left by harnesses that no longer run (killed before their clean-up)."""
    listed = _ip("ip", "netns", "list", check=False).stdout.split()
    stale = []
    for name in listed:
        if not name.startswith(PREFIX) or "-" not in name:
            continue
        pid = name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            _ip("ip", "netns", "del", name, check=False)
            stale.append(name)
    return stale


def _shape(ns: str, dev: str, link: Link, netem: bool) -> None:
    """Egress of ``dev`` in ``ns``: netem for the delay (where it exists), tbf for the rate."""
    parent = ["root"]
    if link.delay_ms and netem:
        _ip("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{link.delay_ms}ms", ns=ns)
        parent = ["parent", "1:1"]
    if link.rate_mbit:
        burst = tbf_burst(link.rate_mbit)
        # TCP hands the device segments of up to 64 KiB (segmentation offload); a bucket smaller
        # than a segment would hold it back below the rate, so the segments are cut to the bucket
        if burst < 65536 and _ip("ip", "link", "set", "dev", dev, "gso_max_size", str(burst), ns=ns,
                                 check=False).returncode != 0:
            burst = 65536  # an older kernel: a bucket of a whole segment, a head start of 64 KiB
        _ip("tc", "qdisc", "add", "dev", dev, *parent, "tbf", "rate", f"{link.rate_mbit}mbit",
            "burst", str(burst), "latency", "100ms", ns=ns)


# every node keeps veth's and the bridge's default MTU; a full frame of it on a link carries the
# Ethernet header (14 bytes, which the token bucket meters) and IPv4 and TCP headers (20 and 32:
# TCP's 20 and the 12 of the timestamps option Linux sends by default) around the payload
MTU, ETHERNET_HEADER, IPV4_TCP_HEADERS = 1500, 14, 52


def payload_share(mtu: int = MTU) -> float:
    """The share of a shaped link's rate that a message's bytes get over TCP: ``tbf`` meters
    whole Ethernet frames (``tc -s qdisc`` counts their bytes), and each full frame moves
    ``mtu - 52`` bytes of payload in ``mtu + 14`` (1448 in 1514 at MTU 1500: 95.6%).

    So a 1 Gbit/s link moves at most 956 Mbit/s of a collective's tensors, as 1 Gigabit
    Ethernet moves about 941 Mbit/s of TCP payload (its wire also carries a preamble and a gap
    between frames, 24 bytes each, that a veth has not). ``profile --hardware`` times the
    payload; the rate of the link it crossed is that over this share
    (``validate_nodes.wire_rate``)."""
    return (mtu - IPV4_TCP_HEADERS) / (mtu + ETHERNET_HEADER)


def tbf_burst(rate_mbit: float) -> int:
    """Bytes of the token bucket shaping a link of ``rate_mbit``: 1 ms of the rate, two
    full-size Ethernet frames at least (``_shape`` cuts TCP's segments to fit it).

    After an idle spell the bucket lets its whole burst through at the veth's own speed, which
    a real link of that rate never does: a link serialises every message at its rate. A training
    step idles on the link while it computes, so the burst is a head start on every message.
    With 4 ms of the rate (500 KB at 1 Gbit/s) the mlp's DDP step over 4 nodes ran 14.1 ms
    against 18.0 ms with 1 ms, and a 1 MiB allreduce after a 10 ms pause moved at 1,258 Mbit/s.
    With a 64 KiB bucket at 100 Mbit/s (TCP's whole segments, before they were cut), 64 KiB
    after a 10 ms pause arrived in 0.6 ms where the rate takes 5.2 ms (4.9 ms with 12.5 kB); the
    cnn's 92 kB stage boundary crossed in 3.7 ms, not 7.4. 1 ms keeps TCP at the rate
    (back-to-back allreduces of 4-8 MiB at 1 Gbit/s: 944-949 Mbit/s, as with 4 ms).

    It still gives a pipeline's messages a head start. Timed on a 2-vCPU VM at 1 Gbit/s, one
    message after 10 ms idle (the rate alone: 1.20 ms for 150 kB, 2.40 for 300 kB), and 4 MiB
    back to back (33.6 ms at the rate):

        burst     150 kB    300 kB    4 MiB
        1 ms      0.38 ms   1.59 ms   37.5 ms
        0.5 ms    0.90      2.14      38.7
        0.3 ms    1.07      2.30      39.1
        0.05 ms   1.62      3.26      49.6

    so the cnn's 4-stage pipelines over 4 nodes (150 kB boundaries) ran only 2.6 ms a step
    slower at 1 Gbit/s than at 10, and were read 27-61% over by a predictor that serialises
    them. A whole pass of issue 18's suite with 0.3 ms (run60, session 60) took the pipelines
    from 9.8-10.6% to 7.1-8.1% MAPE but slowed every collective across 1 Gbit/s far below the
    rate: the mlp's 0.9 MB DDP step over 4 nodes ran 28.9 ms (13.9 with 1 ms; a ring at the
    rate needs about 12), the cnn's 56.4 (35.3), and DDP and local SGD read 12.5% and 10.7%
    (7.4%, 6.6%). Until a shaper that serialises every message keeps collectives at the rate
    (``netem``'s rate, where the kernel has it), 1 ms is the lesser error.
    """
    return max(2 * 1514, round(rate_mbit * 1e6 / 8 * 0.001))


@dataclass
class EmulatedNodes:
    """``n`` namespaces joined by ``link``; a context manager that always tears them down."""

    n: int
    link: Link = field(default_factory=Link)
    tag: str = "n"
    names: list[str] = field(default_factory=list, init=False)
    hub: str = field(default="", init=False)
    netem: bool = field(default=False, init=False)

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def __enter__(self) -> EmulatedNodes:
        if reason := available():
            raise RuntimeError(reason)
        if not 1 <= self.n <= 200:
            raise ValueError(f"between 1 and 200 nodes, got {self.n}")
        remove_stale()
        self.netem = bool(self.link.delay_ms) and has_netem()
        base = f"{PREFIX}{os.getpid()}-{self.tag}"
        self.hub = f"{base}h"
        atexit.register(self.close)
        previous = signal.getsignal(signal.SIGTERM)
        if previous in (signal.SIG_DFL, None):  # a SIGTERM'd harness still cleans up
            signal.signal(signal.SIGTERM, lambda *_: (self.close(), os._exit(143)))
        try:
            _ip("ip", "netns", "add", self.hub)
            self.names.append(self.hub)
            _ip("ip", "link", "add", "br0", "type", "bridge", ns=self.hub)
            _ip("ip", "link", "set", "br0", "up", ns=self.hub)
            for i in range(self.n):
                node = f"{base}{i}"
                _ip("ip", "netns", "add", node)
                self.names.append(node)
                _ip("ip", "link", "set", "lo", "up", ns=node)
                # the pair is born in the hub; one end moves into the node and becomes its eth0
                _ip("ip", "link", "add", f"n{i}", "type", "veth", "peer", "name", f"h{i}", ns=self.hub)
                _ip("ip", "link", "set", f"n{i}", "netns", node, ns=self.hub)
                _ip("ip", "link", "set", f"n{i}", "name", "eth0", ns=node)
                _ip("ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0", ns=node)
                _ip("ip", "link", "set", "eth0", "up", ns=node)
                _ip("ip", "link", "set", f"h{i}", "master", "br0", ns=self.hub)
                _ip("ip", "link", "set", f"h{i}", "up", ns=self.hub)
                _shape(node, "eth0", self.link, self.netem)  # from the node
                _shape(self.hub, f"h{i}", self.link, self.netem)  # toward the node
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for name in reversed(self.names):
            _ip("ip", "netns", "del", name, check=False)
        self.names.clear()

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a process on a node: collectives on eth0, whatever ``extra`` or this
        process's environment say (a local run in this process binds them to loopback, and a
        copy of its environment passed on would send a node's gloo to 127.0.0.1)."""
        return {**os.environ, **(extra or {}), "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}

    def command(self, node: int, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", f"{PREFIX}{os.getpid()}-{self.tag}{node}", *cmd]

    def popen(self, node: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        kwargs.setdefault("env", self.env())
        return subprocess.Popen(self.command(node, cmd), **kwargs)

    def run(self, node: int, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("env", self.env())
        return subprocess.run(self.command(node, cmd), **kwargs)


def torchrun_across(nodes: EmulatedNodes, per_node: int, args: list[str], port: int = 29500,
                    python: list[str] | None = None) -> list[list[str]]:
    """One ``torchrun`` command per node that starts ``per_node`` workers of ``python -m partrain
    args`` there, all meeting at node 0 (a static rendezvous: the c10d store on 192.0.2.1)."""
    import sys

    python = python or [sys.executable, "-P"]
    return [
        nodes.command(i, [*python, "-m", "torch.distributed.run", "--nnodes", str(nodes.n),
                          "--nproc-per-node", str(per_node), "--node-rank", str(i), "--master-addr",
                          nodes.address(0), "--master-port", str(port), "-m", "partrain", *args])
        for i in range(nodes.n)
    ]
