"""Benchmark cells across emulated nodes (issue 18): a suite's ``nodes`` and ``link_mbit``.

A cell with ``nodes`` runs in network namespaces made for it alone (``testing.netns``): N
namespaces joined by a link shaped to ``link_mbit``, one ``torchrun`` per namespace starting
``workers_per_node`` workers of ``partrain train``, all meeting at node 0. The namespaces are
torn down when the cell ends, however it ends (``EmulatedNodes`` is a context manager, and a
runner killed outright leaves namespaces that the next one removes).

What predicts such a cell is the hardware profile measured across the same kind of nodes
and link: ``partrain profile --hardware`` under torchrun across fresh namespaces, once per
(nodes, workers per node, link), kept in the profile directory under a name holding all
three (``profile.cache.hardware_path``), where ``validate`` finds it by the cell's stored link.

Costs: making and removing the namespaces, a few tenths of a second per cell; the link's
profile, once per placement and rate, most of it moving the large messages (4 MiB) through
the shaped link: about a minute on 2 nodes of one worker, 2 on 4 nodes, and 3-5.5 on 2
nodes of 2 workers, whose whole world is timed too (run25, issue 18).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from partrain.bench.suite import Cell
from partrain.config import RunConfig
from partrain.distributed.spawn import child_env
from partrain.errors import PartrainError
from partrain.predict.profiles import HardwareProfile
from partrain.profile.cache import hardware_across, hardware_for, hardware_path, profile_dir
from partrain.profile.pipeline_fits import fit_loads
from partrain.testing import netns
from partrain.testing.netns import EmulatedNodes, Link, torchrun_across

LINK_PROFILE_S, LINK_PROFILE_CAP_MB = 0.1, 64.0  # the link profile's largest message: 0.1 s of the rate, at most 64 MiB
# a link profile is not a cell: the suite's timeout per cell bounds it only from below. Across
# 2 nodes of 2 workers at 100 Mbit/s it took 316 s (issue 18), past the nodes suite's 300 s
LINK_PROFILE_TIMEOUT_S = 1200.0

# runs processes with a timeout: bench.processes.run_processes, passed in by the runner
Runner = Callable[..., tuple[str, str | None, dict | None]]


def refusal(cells: list[Cell]) -> str | None:
    """One line when some of ``cells`` run across emulated nodes and none can be made here."""
    across = sum(1 for c in cells if c.nodes)
    if not across or (reason := netns.available()) is None:
        return None
    return (f"{across} of the suite's cells run across emulated nodes, and {reason}: run `partrain bench` as root "
            "(with iproute2), or remove nodes/placements and link_mbit from the suite")


def check_across(cell: Cell, cfg: RunConfig) -> None:
    """``PartrainError`` when the cell's strategy cannot run spread over its nodes (Hogwild's
    shared weights), as ``train`` would refuse it under torchrun."""
    if why := cfg.spec.refusal(cell.workers, cell.workers_per_node, None):
        raise PartrainError(f"across {cell.nodes} nodes: {why}")


def emulated(cell: Cell, tag: str = "c") -> EmulatedNodes:
    """The cell's nodes and link, to enter with ``with``."""
    return EmulatedNodes(cell.nodes, Link(rate_mbit=cell.link_mbit), tag=tag)


def train_across(nodes: EmulatedNodes, cell: Cell, train_args: list[str]) -> list[list[str]]:
    """One torchrun per node, each starting the cell's workers per node of ``partrain train_args``."""
    return torchrun_across(nodes, cell.workers_per_node, ["train", *train_args, "--json", "--quiet"])


def link_profile_path(cell: Cell, directory=None) -> Path:
    """Where the hardware profile measured across the cell's nodes and link is kept."""
    return hardware_path(profile_dir(directory), cell.workers, cell.nodes, link_mbit=cell.link_mbit)


def ensure_link_profile(cell: Cell, run: Runner, max_mb: float, timeout: float, directory=None,
                        tick: Callable[[], None] = lambda: None) -> str | None:
    """Measure the link profile of the cell's placement unless it is kept already, within
    ``timeout`` seconds or ``LINK_PROFILE_TIMEOUT_S``, the longer; None when it is there, else
    why it could not be measured (the cells still run; validate says they have no profile)."""
    path = link_profile_path(cell, directory)
    try:
        if hardware_across(cell.workers, cell.nodes, cell.link_mbit, directory) is not None:
            return None  # kept, and measured as this partrain measures
    except PartrainError:  # unreadable: measured again, over it
        pass
    # messages up to what the link moves in 0.1 s at least (64 MiB at most): a token bucket lets
    # its burst (``netns.tbf_burst``: 1.25 MB at 10 Gbit/s) through at once, so a profile whose
    # largest message hardly outgrows it times the burst, not the rate (issue 18: with a 4 ms
    # burst, 4 MiB messages "measured" a 10 Gbit/s link at 15.7-17.2 Gbit/s)
    max_mb = max(max_mb, min(LINK_PROFILE_CAP_MB, cell.link_mbit * 1e6 / 8 * LINK_PROFILE_S / 2**20))
    with tempfile.TemporaryDirectory(prefix="partrain-link-") as tmp, emulated(cell, tag="p") as nodes:
        args = ["profile", "--hardware", "--max-mb", f"{max_mb:g}", "--threads", "1", "--profile-dir", tmp, "--json"]
        status, reason, _ = run(torchrun_across(nodes, cell.workers_per_node, args), max(timeout, LINK_PROFILE_TIMEOUT_S),
                                tick, nodes.env(child_env()))
        made = list(Path(tmp).glob(f"hardware-w{cell.workers}-n{cell.nodes}-*.json"))
        if status != "ok" or not made:
            return f"profile --hardware across {cell.placement}: {status}: {reason}"
        measured = HardwareProfile.load(made[0])
    cores = os.cpu_count() or 1
    # more workers than cores: what synchronising after computing side by side costs them is
    # this machine's, measured with as many local workers (measured now if not kept)
    machine = hardware_for(cell.workers, directory)[0] if cell.workers > cores else None
    path.parent.mkdir(parents=True, exist_ok=True)
    shares_cores(measured, cell.nodes, cores, machine.sync_s if machine else None,
                 machine.sync_compute_s if machine else None).save(path)
    return None


def shares_cores(hardware: HardwareProfile, nodes: int, cores: int, machine_sync: dict[int, float] | None = None,
                 machine_sync_compute: dict[int, float] | None = None) -> HardwareProfile:
    """The profile of ``nodes`` emulated nodes that share this machine's ``cores``: their
    compute contends machine-wide (``shared_cores``), the busy workers of every node against
    all the cores, not ``cores`` per node as the profiler saw from inside one. Each node plans
    ``cores / nodes`` of them (at least one) for its workers' threads.

    (Issue 18. Counted per node, 4 nodes on 2 cores were one core each at half speed: the
    cnn's 4-stage pipelines, whose stages idle in the bubble, were predicted 25-59% over their
    measured steps at 1 and 10 Gbit/s. And 2 nodes on 2 cores had a core each, with nothing
    shared, where the cnn's own two workers side by side run 1.12x slower.)

    So is synchronising after computing: k busy workers per node are k x nodes on the
    machine, whose cost ``machine_sync`` holds (the machine's own hardware profile, by busy
    workers); the probe inside one node saw only its own k. (Issue 18: 2x2 and 4x1 nodes on
    2 cores ran their cnn steps 17-34% over predictions that had no such cost at 1-10 Gbit/s.)
    With it, the compute it was timed after (``machine_sync_compute``: ``Env.sync_after``).
    """
    hardware.cores_per_node = max(1, cores // nodes)
    hardware.compute_speed = 1.0
    hardware.shared_cores = cores
    if machine_sync:
        hardware.sync_s = {k: machine_sync[k * nodes] for k in range(1, hardware.workers_per_node + 1)
                           if k * nodes in machine_sync}
        compute = machine_sync_compute or {}
        hardware.sync_compute_s = {k: compute[k * nodes] for k in hardware.sync_s if k * nodes in compute}
    hardware.source = (f"measured across {nodes} emulated nodes sharing {cores} cores ({hardware.cores_per_node} "
                       "per node for threads)")
    return fit_loads(hardware)  # the pipeline probes' loaded runs fitted again on the cores now shared
