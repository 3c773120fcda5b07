"""Measuring this machine's hardware profile (``predict.profiles.HardwareProfile``).

``profile_hardware(workers)`` starts ``workers`` local workers on the real backend (or,
under torchrun/mpirun/srun, runs in the launched workers), times every collective over
message sizes with ``profile.collectives`` and fits latency + size/bandwidth
(``predict.fits``) per collective, per group size and per link tier: ``intra`` (workers of
one node) and, under a multi-node launcher, ``inter`` (one worker per node). A cluster one
does not have is read from TOML instead (``predict.cluster``); ``profile.cache`` keeps both.
The pipeline probes (``profile.step_probes``) are fitted by ``profile.pipeline_fits``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from partrain.errors import PartrainError
from partrain.predict.fits import CostFit, default_sizes, fit_cost
from partrain.predict.machine import fingerprint as machine
from partrain.predict.profiles import HardwareProfile
from partrain.profile.collectives import background_load, measure_collectives, measure_link_alone
from partrain.profile.pipeline_fits import (
    fit_busy_sender,
    fit_loads,
    fit_message_cpu,
    fit_pipeline_runtime,
    world_runs_cold,
)
from partrain.profile.step_probes import (
    measure_compute_sharing,
    measure_pair_loaded,
    measure_pipeline_action,
    measure_pipeline_hops,
    measure_pipelines_side_by_side,
    measure_step_sync,
    measure_world_pipeline,
)
from partrain.profile.timing import cpu_seconds, others_share
from partrain.progress import phase

# ---- measuring this machine ---------------------------------------------------------------

# ``quick``: every probe, with about a third of the rounds each alternates its timings over by
# default (two at least; each probe's docstring says why the full profile takes so many), so
# noisier: a first look at a machine, or a test's. 3 workers on the 2-vCPU VM: 65 s where the full
# profile took 125. Shown, not cached as the machine's profile (``commands.profile``).
QUICK = {"hops": dict(rounds=3), "pair_loaded": dict(rounds=3), "pipelines": dict(rounds=3, loaded_rounds=2),
         "sharing": dict(rounds=2), "step_sync": dict(rounds=2)}


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def group_sizes(local_workers: int) -> list[int]:
    """Group sizes to measure within a node: powers of two below the node's workers, and all of them."""
    sizes, p = [], 2
    while p < local_workers:
        sizes.append(p)
        p *= 2
    return sizes + [local_workers] if local_workers >= 2 else []


def _tier_plans(world: int, local: int) -> list[tuple[str, int, list[list[int]], tuple[int, int] | None]]:
    """(tier, group size, groups, ping-pong pair or None) to measure; ranks are placed node by node.

    Across nodes: one rank per node, and with several workers per node the whole world too,
    the group a data-parallel job's gradients are reduced over. Its ring alternates hops
    within and between nodes, which no rescaling of the one-per-node group tells: on 2
    emulated nodes of 2 workers at 1 Gbit/s that rescaling said 18.4 ms for the mlp's
    allreduce where 4 nodes of one measured 14.0, and the mlp's DDP and local SGD steps there
    were predicted 39-42% over their measure (issue 18). The world's pair between nodes is the
    one-per-node group's, whose ping-pong is not timed twice."""
    nodes = world // local
    plans = [("intra", k, [list(range(n * local, n * local + k)) for n in range(nodes)], (0, 1)) for k in group_sizes(local)]
    if nodes > 1:
        plans.append(("inter", nodes, [[n * local for n in range(nodes)]], (0, local)))
        if local > 1:
            plans.append(("inter", world, [list(range(world))], None))
    return plans


@record
def hardware_worker(sizes: list[int], backend: str | None, threads: int, quick: bool = False) -> dict | None:
    """One worker of ``profile --hardware`` (``quick``: ``QUICK``'s rounds); rank 0 returns the measurements."""
    from partrain.distributed.launch import (
        detect_launcher,
        device_for,
        init_process_group,
        keep_freed_memory,
        leave_process_group,
    )

    keep_freed_memory()  # as a training worker does
    info = detect_launcher()
    torch.set_num_threads(threads)
    before = _rss_bytes()
    backend = init_process_group(info, backend, timeout_s=600)
    joined = _rss_bytes() - before
    device = device_for(backend, info)
    out: dict = {"tiers": {}, "link_alone": {}, "notes": [], "process_group_rss_bytes": joined, "backend": backend,
                 "world_size": info.world_size, "local_world_size": info.local_world_size}
    say = (lambda text: phase("profile --hardware", text)) if info.rank == 0 else (lambda text: None)  # noqa: E731
    rounds = QUICK if quick else {}
    try:
        say("the pipeline runtime's cost per action and per hop")
        alone, pair = dist.new_group([0]), dist.new_group([0, 1])  # every rank creates every group
        own, _ = dist.new_subgroups(group_size=1)  # a group of one per rank: DDP's world-of-one baseline
        out["pipeline_action_s"] = measure_pipeline_action(alone, device) if info.rank == 0 else 0.0
        dist.barrier()  # the others' background load below starts only after rank 0 timed the runtime alone
        with background_load(info.rank not in (0, 1)):  # the job's other workers compute meanwhile
            out["pipeline_probe"] = measure_pipeline_hops(pair, device, **rounds.get("hops", {})) if info.rank in (0, 1) else None
            if info.rank in (0, 1) and device.type == "cpu":  # a GPU's host waits while its stages compute
                say("the same over stages that compute")
                out["pipeline_probe"]["loaded"] = measure_pair_loaded(pair, device, **rounds.get("pair_loaded", {}))
            dist.barrier()
        if info.world_size >= 3:
            say(f"a {info.world_size}-stage pipeline over every worker")
            out["pipeline_world"] = measure_world_pipeline(device, **rounds.get("pipelines", {}))
            dist.barrier()
        if info.world_size >= 4 and info.world_size % 2 == 0:
            say("2-stage pipelines on every worker at once, as a hybrid's replicas run")
            out["pipeline_side_by_side"] = measure_pipelines_side_by_side(device, **rounds.get("pipelines", {}))
            dist.barrier()
        out["compute_sharing"] = {}
        say(f"compute with 2..{info.local_world_size} workers side by side")
        out["step_sync"] = {}
        for k in range(2, info.local_world_size + 1):  # the first k workers of node 0 busy, the rest idle
            group = dist.new_group(list(range(k)))  # every rank creates every group
            if info.rank < k:
                out["compute_sharing"][k] = measure_compute_sharing(group, device, **rounds.get("sharing", {}))
                if device.type == "cpu":  # beyond the cores too: the probe's compute is the mean call
                    out["step_sync"][k] = measure_step_sync(group, device, **rounds.get("step_sync", {}))
            dist.barrier()
        if info.world_size > info.local_world_size:
            # the whole world across the nodes, as a data-parallel step over them synchronises: keyed by
            # the world, more workers than a node's (``HardwareProfile.step_sync``); where every node's
            # workers have a core each (every rank must agree, or the probe would wait for the others)
            world = dist.new_group(list(range(info.world_size)))  # every rank creates every group
            fits = torch.tensor([int(device.type == "cpu" and info.local_world_size <= machine().cpu_cores)], device=device)
            dist.all_reduce(fits, op=dist.ReduceOp.MIN)
            if fits.item():
                say(f"a step's synchronisation after computing, {info.world_size} workers across the nodes")
                out["step_sync"][info.world_size] = measure_step_sync(world, device, **rounds.get("step_sync", {}))
            dist.barrier()
        for tier, k, groups, pair in _tier_plans(info.world_size, info.local_world_size):
            say(f"collectives in groups of {k} ({tier}), {len(sizes)} message sizes")
            made = [(ranks, dist.new_group(ranks)) for ranks in groups]  # every rank creates every group
            mine = next(((ranks, g) for ranks, g in made if dist.get_rank() in ranks), (groups[0], None))
            points, notes, again = measure_collectives(mine[1], mine[0], pair, sizes, device, alone=own)
            out["tiers"].setdefault(tier, {})[k] = points
            if again:  # what the sweep timed again (``collectives.sweep``), kept to read, not fitted
                out.setdefault("timed_again", {}).setdefault(tier, {})[k] = again
            out["notes"] += [n for n in notes if n not in out["notes"]]
            if tier not in out["link_alone"]:  # the tier's first group is its pair's: the link alone, once
                say(f"the {tier} link alone")
                out["link_alone"][tier] = measure_link_alone(pair, sizes, device)
    finally:
        leave_process_group()
    return out if info.rank == 0 else None


def fit_measurements(raw: dict) -> tuple[dict[str, CostFit], dict[str, dict[int, dict[str, CostFit]]]]:
    """Fits from ``hardware_worker``'s points: a link per tier (send/recv), every collective."""
    collectives: dict[str, dict[int, dict[str, CostFit]]] = {}
    links: dict[str, CostFit] = {}
    for tier, by_size in raw["tiers"].items():
        for k, points in by_size.items():
            fits = {name: fit_cost([n for n, _ in pts], [t for _, t in pts]) for name, pts in points.items()}
            collectives.setdefault(tier, {})[int(k)] = fits
            if "sendrecv" in fits:  # the tier's first group times its pair
                links.setdefault(tier, fits["sendrecv"])
    return links, collectives


def fit_compute_sharing(probes: dict, cores: int) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """From ``measure_compute_sharing``'s timings per busy-worker count k: (k -> slowdown of
    computing side by side, never below 1; k -> what a synchronisation after computing costs
    beyond the computing and the collective's own time in a tight loop, never below 0, and 0
    where the k single-threaded workers fit on the ``cores``; k -> the compute each worker ran
    side by side before it, ``together_s``, which ``Env.sync_after`` scales it by).

    Beyond the cores the slowdown is the cores' own times k / cores: the extra workers time-slice
    the cores, each slice running as the cores' workers side by side ran. Neither window beyond the
    cores reads the compute alone. Free-running, 4 workers on 2 vCPUs read ``together_s`` 10.7-16.1
    ms in five 4-worker profiles (2.2-3.3x rank 0 alone), above the synchronised ``synced_s`` in
    three of them, as only cores shared unevenly for a window can (session 99). Synchronised, each
    call also pays the 4-byte allreduce's wake-ups, which the step probe's excess
    (``HardwareProfile.step_sync``) adds again: on session 100's VM its 2-worker window read 1.1 ms
    over the compute alone, the 4-worker one 13.1 ms, a ratio of 2.66 (2.20-2.32 on session 99's),
    and issue 17's 4-worker DDP and local SGD cells read -7% to +52% with it (+21% on average).
    Time-sliced instead (the model's own factor at 2 workers times 2), the same cells of that pass
    (run121u) read -20% to +25% (+2%), the pass 10.5% where it read 12.2%; on session 99's VM,
    run120u's tokens3d cells +5% to +13% where its ratio's 2.26 read +16% to +23%.

    A synchronisation costs something of its own only when workers outnumber the cores: the
    last to get its share of them sets when the collective starts, and a waiting worker wakes
    only when a core frees up. It is the probe's ``synced_s - together_s`` whole. Less the
    fitted latency of a hot 4-byte allreduce (as measurement method 4 took it) it came out at
    0-0.2 ms for 4 workers on 2 cores, because that latency is itself the chain of wake-ups
    of ranks sleeping in the collective (2.2-2.5 ms, against 0.35 ms for 2): timed directly
    there, a step of compute and an allreduce of the model's gradients took 2.0 ms (gpt, 2.5
    MB) and 1.6 ms (the gallery's tuple_out) more than the compute and the allreduce in tight
    loops, where the whole difference read 1.9-3.4 ms in seven profiles. With a core each,
    the probe still reads 0.30-0.67 ms for 2 workers on 2 cores (four profiles), about what
    an allreduce started from a step's end costs over one in a tight loop (DDP's 0.67-0.91
    ms against 0.35 ms), which the collective costs the strategies pay already hold: counted,
    it over-predicted the gallery's 2-worker DDP and local SGD cells by 24-45% and turned the
    top-1 hit rate over issue 17's suite from 100% to 75% (issue 17). What a step pays is the
    step probe's instead (``HardwareProfile.step_sync``), with a core each or not: this probe's
    one-element token passes without the wake-ups a real gradient's allreduce waits for, and
    it times one compute length, which ``Env.sync_after`` scaled in proportion. Scaled, issue
    17's small gallery models on 4 workers over 2 cores (2-8 ms of compute side by side, their
    gradients 68-135 KB) were predicted 1.5-3.6 ms a step short, all 24 of their 4-worker
    data-parallel cells 8-30% under (runs run88u, run90u; gpt's, 27-76 ms a step, within
    5%); the step probe at 4 workers read 4.6-5.8 ms of excess after 1.4-4.3 ms of compute,
    where the scaled figure and the sweep's fit made 4.2-5.1."""
    sharing, sync, compute = {}, {}, {}
    probes = {int(k): t for k, t in probes.items()}  # JSON keys are strings
    for k, t in sorted(probes.items()):
        sharing[k] = max(1.0, t["together_s"] / t["alone_s"])
        if k > cores and cores in probes:  # beyond the cores: the cores' own, time-sliced
            sharing[k] = sharing[cores] * k / cores
        sync[k] = max(0.0, t["synced_s"] - t["together_s"]) if k > cores else 0.0
        compute[k] = t["together_s"]
    return sharing, sync, compute


def profile_hardware(workers: int, sizes: list[int] | None = None, backend: str | None = None, threads: int = 1,
                     quick: bool = False) -> HardwareProfile:
    """Measure the collectives with ``workers`` workers (or the launcher's) and fit them; ``quick``: ``QUICK``."""
    from partrain.distributed.launch import detect_launcher
    from partrain.distributed.spawn import check_local_workers, spawn

    sizes = sizes or default_sizes()
    info = detect_launcher()
    if info.launched:
        raw = hardware_worker(sizes, backend, threads, quick)
        if raw is None:
            return None  # not rank 0: rank 0 writes the profile
        others = 0.0  # the other ranks are not this process's children: their load cannot be told apart
    else:
        if workers < 2:
            raise PartrainError("profile --hardware needs at least 2 workers to time collectives: use --workers 2 or more")
        check_local_workers(workers, "measure bigger machines there (profile --hardware under torchrun), or describe "
                                     "them with --cluster FILE (examples/cluster.toml)")
        before, started = cpu_seconds(), time.perf_counter()
        raw = spawn(hardware_worker, (sizes, backend, threads, quick), workers)[0]
        others = others_share(before, cpu_seconds(), time.perf_counter() - started)  # the workers: its waited-for children, or its fork server's
    links, collectives = fit_measurements(raw)
    cuda = raw["backend"] == "nccl"  # a GPU's host posts its messages while the device computes
    message_cpu_s = 0.0 if cuda else fit_message_cpu(raw["pipeline_probe"], raw["pipeline_action_s"])
    step_s, hop_s = fit_pipeline_runtime(raw["pipeline_probe"], raw["pipeline_action_s"], message_cpu_s=message_cpu_s)
    side, world = raw.get("pipeline_side_by_side"), raw.get("pipeline_world")
    here = machine()
    sharing, sync, sync_compute = fit_compute_sharing(raw["compute_sharing"], here.cpu_cores)
    local = raw["local_world_size"]
    hw = HardwareProfile(
        fingerprint=here.hash,
        description=here.describe(),
        backend=raw["backend"],
        nodes=raw["world_size"] // local,
        workers_per_node=local,
        cores_per_node=here.cpu_cores,
        device_memory_bytes=torch.cuda.get_device_properties(0).total_memory if cuda else here.memory_gib * 2**30,
        shared_memory=not cuda,
        links=links,
        collectives=collectives,
        process_group_rss_bytes=raw["process_group_rss_bytes"],
        pipeline_action_s=raw["pipeline_action_s"],
        pipeline_step_s=step_s,
        pipeline_hop_s=hop_s,
        pipeline_message_cpu_s=message_cpu_s,
        compute_sharing=sharing,
        sync_s=sync,
        sync_compute_s=sync_compute,
        step_sync={int(k): {int(size["message_bytes"]): tuple(map(tuple, size["points"])) for size in probe}
                   for k, probe in raw.get("step_sync", {}).items()},
        notes=raw["notes"],
        other_load=others,
        points=json.loads(json.dumps({**{tier: {str(k): v for k, v in by.items()} for tier, by in raw["tiers"].items()},
                                      "pipeline": raw["pipeline_probe"], "compute_sharing": raw["compute_sharing"],
                                      "step_sync": raw.get("step_sync", {}),
                                      "link_alone": raw["link_alone"],
                                      **({"timed_again": raw["timed_again"]} if raw.get("timed_again") else {}),
                                      **({"pipeline_side_by_side": side} if side else {}),
                                      **({"pipeline_world": world} if world else {})})),
    )
    hw.busy_sender_s = fit_busy_sender(hw)  # then the probes over more stages, with their messages delayed so
    fit = lambda probe, cold=False: fit_pipeline_runtime(probe, hw.pipeline_action_s,  # noqa: E731
                                                         busy_sender_s=hw.busy_sender_s, cold=cold,
                                                         message_cpu_s=message_cpu_s)
    hw.pipeline_side_by_side = fit(side) if side else None
    hw.pipeline_world = fit(world, world_runs_cold(hw, threads)) if world else None
    return fit_loads(hw, threads)
