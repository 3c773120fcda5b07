"""The hardware profile: nodes, workers, memory, and fitted collective costs per link tier.

Two ways to get one:

- ``profile_hardware(workers)`` measures this machine: it starts ``workers`` local workers
  on the real backend (or, under torchrun/mpirun/srun, runs in the launched workers),
  times every collective over message sizes with ``profile.collectives`` and fits
  latency + size/bandwidth per collective, per group size and per link tier: ``intra``
  (workers of one node) and, under a multi-node launcher, ``inter`` (one worker per node).
- ``load_cluster(path)`` reads a cluster TOML describing hardware one does not have at hand
  (see ``examples/cluster.toml``): links are given as bandwidth and latency, and every
  collective is derived from them with the ring formulas in ``predict.comm``.

Profiles are JSON files in the profile directory (``--profile-dir``, else
``$PARTRAIN_PROFILE_DIR``, else ``~/.partrain/profiles``), named by worker count and the
hardware fingerprint so a profile taken on other hardware is never reused by mistake.
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from partrain.bench.hardware import fingerprint as machine
from partrain.errors import PartrainError
from partrain.profile.collectives import (
    CostFit, background_load, default_sizes, fit_cost, measure_collectives, measure_compute_sharing,
    measure_pipeline_action, measure_pipeline_hops,
)

PROFILE_DIR_ENV = "PARTRAIN_PROFILE_DIR"
DEFAULT_PROFILE_DIR = Path("~/.partrain/profiles")


def profile_dir(path: str | os.PathLike | None = None) -> Path:
    """Where profiles are cached: ``path``, else $PARTRAIN_PROFILE_DIR, else ~/.partrain/profiles."""
    chosen = Path(path if path is not None else os.environ.get(PROFILE_DIR_ENV) or DEFAULT_PROFILE_DIR).expanduser()
    if chosen.exists() and not chosen.is_dir():  # found now, not after minutes of profiling
        raise PartrainError(f"--profile-dir {chosen}: a file is in the way; give a directory")
    return chosen.absolute()


def fingerprint() -> str:
    """This machine's hardware hash, the one the results store keys its measurements by."""
    return machine().hash


class JsonProfile:
    """Saving and loading for a profile dataclass with ``to_dict`` and ``from_dict``."""

    kind = "profile"  # named in the error when a file cannot be read

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike):
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise PartrainError(f"{cls.kind} {path} is unreadable ({err}): delete it or profile again") from None


@dataclass
class HardwareProfile(JsonProfile):
    """What the predictor knows about the hardware a job runs on."""

    kind = "hardware profile"

    fingerprint: str
    description: str
    backend: str
    nodes: int
    workers_per_node: int
    cores_per_node: int  # CPU contention: more busy threads than this slows every worker
    device_memory_bytes: int  # per GPU; on CPU, the host RAM that a node's workers share
    shared_memory: bool  # True on CPU: a node's workers share device_memory_bytes
    compute_speed: float = 1.0  # relative to the machine that measured the model profile
    links: dict[str, CostFit] = field(default_factory=dict)  # tier -> point-to-point fit
    collectives: dict[str, dict[int, dict[str, CostFit]]] = field(default_factory=dict)  # tier -> group size -> name -> fit
    process_group_rss_bytes: int = 0  # resident memory a worker gains by joining the process group
    pipeline_action_s: float = 0.0  # what the pipelining runtime adds to each micro-batch forward or backward
    pipeline_step_s: float = 0.0  # what it adds once per step (splitting the batch, merging losses)
    pipeline_hop_s: float | None = None  # latency of one message between stages inside the runtime
    # k busy workers on a node -> their compute time over one worker's alone (measured; else k / cores)
    compute_sharing: dict[int, float] = field(default_factory=dict)
    # k workers -> what one synchronisation after computing costs beyond a collective between busy ranks
    sync_s: dict[int, float] = field(default_factory=dict)
    source: str = "measured"
    notes: list[str] = field(default_factory=list)
    points: dict = field(default_factory=dict)  # raw: tier -> group size -> name -> [[bytes, s]]; "pipeline": the probe

    def memory_limit_per_worker(self, local_workers: int) -> int:
        return self.device_memory_bytes // max(1, local_workers) if self.shared_memory else self.device_memory_bytes

    def to_dict(self) -> dict:
        return {
            "fingerprint": self.fingerprint, "description": self.description, "backend": self.backend,
            "nodes": self.nodes, "workers_per_node": self.workers_per_node, "cores_per_node": self.cores_per_node,
            "device_memory_bytes": self.device_memory_bytes, "shared_memory": self.shared_memory,
            "compute_speed": self.compute_speed,
            "links": {tier: fit.to_dict() for tier, fit in self.links.items()},
            "collectives": {
                tier: {str(p): {name: fit.to_dict() for name, fit in fits.items()} for p, fits in sizes.items()}
                for tier, sizes in self.collectives.items()
            },
            "process_group_rss_bytes": self.process_group_rss_bytes, "pipeline_action_s": self.pipeline_action_s,
            "pipeline_step_s": self.pipeline_step_s, "pipeline_hop_s": self.pipeline_hop_s,
            "compute_sharing": {str(k): v for k, v in self.compute_sharing.items()},
            "sync_s": {str(k): v for k, v in self.sync_s.items()}, "source": self.source,
            "notes": self.notes, "points": self.points,
        }

    @classmethod
    def from_dict(cls, d: dict) -> HardwareProfile:
        return cls(
            d["fingerprint"], d["description"], d["backend"], int(d["nodes"]), int(d["workers_per_node"]),
            int(d["cores_per_node"]), int(d["device_memory_bytes"]), bool(d["shared_memory"]), float(d["compute_speed"]),
            {tier: CostFit.from_dict(rows) for tier, rows in d["links"].items()},
            {
                tier: {int(p): {name: CostFit.from_dict(rows) for name, rows in fits.items()} for p, fits in sizes.items()}
                for tier, sizes in d["collectives"].items()
            },
            int(d.get("process_group_rss_bytes", 0)), float(d.get("pipeline_action_s", 0.0)),
            float(d.get("pipeline_step_s", 0.0)), d.get("pipeline_hop_s"),
            {int(k): float(v) for k, v in d.get("compute_sharing", {}).items()},
            {int(k): float(v) for k, v in d.get("sync_s", {}).items()},
            d.get("source", "measured"), list(d.get("notes", [])), d.get("points", {}),
        )


def write_json(path: Path, data: dict) -> Path:
    """Write atomically: a reader never sees half a profile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path


def hardware_path(directory: Path, workers: int) -> Path:
    return directory / f"hardware-w{workers}-{fingerprint()}.json"


# ---- cluster TOML -----------------------------------------------------------------------

_GB = 1e9


# the keys each table of a cluster file takes; anything else is a typo, refused by name
_CLUSTER_KEYS = {
    "cluster": {"name", "nodes", "workers_per_node", "device_memory_gb", "shared_memory", "compute_speed",
                "cores_per_node", "backend"},
    "intra": {"bandwidth_gb_per_s", "latency_us"},
    "inter": {"bandwidth_gb_per_s", "latency_us"},
}
_BACKENDS = ("gloo", "nccl")


def _number(table: dict, key: str, where: str, default=None, positive=True, integer=False) -> float:
    value = table.get(key, default)
    if value is None:
        raise PartrainError(f"{where}: missing {key} (see examples/cluster.toml)")
    kind = "a whole number" if integer else "a finite number"
    ok = isinstance(value, int) if integer else isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(value, bool) or not ok or (value <= 0 if positive else value < 0):
        raise PartrainError(f"{where}: {key} must be {kind} {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _link(table: dict | None, tier: str, path: str) -> CostFit:
    where = f"{path} [{tier}]"
    if not isinstance(table, dict):
        raise PartrainError(f"{where}: missing table (bandwidth_gb_per_s, latency_us); see examples/cluster.toml")
    bandwidth = _number(table, "bandwidth_gb_per_s", where) * _GB
    latency = _number(table, "latency_us", where, positive=False) * 1e-6
    return CostFit.line(latency, bandwidth)


def load_cluster(path: str | os.PathLike) -> HardwareProfile:
    """A ``HardwareProfile`` from a cluster TOML file (see ``examples/cluster.toml``)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PartrainError(f"cluster file {path} not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise PartrainError(f"cannot read cluster file {path} as UTF-8 text: {err}") from None
    except tomllib.TOMLDecodeError as err:
        raise PartrainError(f"cluster file {path} is not valid TOML: {err}") from None
    cluster = data.get("cluster")
    if not isinstance(cluster, dict):
        raise PartrainError(f"{path}: missing [cluster] table; see examples/cluster.toml")
    for table in sorted(set(data) - set(_CLUSTER_KEYS)):
        raise PartrainError(f"{path}: unknown table [{table}]; the tables are {', '.join(_CLUSTER_KEYS)}")
    for table, keys in _CLUSTER_KEYS.items():
        unknown = sorted(set(data.get(table, {})) - keys) if isinstance(data.get(table), dict) else []
        if unknown:
            raise PartrainError(f"{path} [{table}]: unknown key {unknown[0]!r}; the keys are {', '.join(sorted(keys))}")
    where = f"{path} [cluster]"
    nodes = int(_number(cluster, "nodes", where, integer=True))
    per_node = int(_number(cluster, "workers_per_node", where, integer=True))
    if cluster.get("backend", "nccl") not in _BACKENDS:
        raise PartrainError(f"{where}: backend must be one of {', '.join(_BACKENDS)}, got {cluster['backend']!r}")
    links = {"intra": _link(data.get("intra"), "intra", str(path))}
    if nodes > 1:
        links["inter"] = _link(data.get("inter"), "inter", str(path))
    backend = cluster.get("backend", "nccl")
    return HardwareProfile(
        fingerprint=f"cluster:{path.name}",
        description=str(cluster.get("name", path.stem)),
        backend=backend,
        nodes=nodes,
        workers_per_node=per_node,
        cores_per_node=int(_number(cluster, "cores_per_node", where, default=10**6, integer=True)),
        device_memory_bytes=int(_number(cluster, "device_memory_gb", where) * _GB),
        shared_memory=bool(cluster.get("shared_memory", backend == "gloo")),
        compute_speed=_number(cluster, "compute_speed", where, default=1.0),
        links=links,
        source=str(path),
    )


# ---- measuring this machine ---------------------------------------------------------------


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


def _tier_plans(world: int, local: int) -> list[tuple[str, int, list[list[int]], tuple[int, int]]]:
    """(tier, group size, groups, ping-pong pair) to measure; ranks are placed node by node."""
    nodes = world // local
    plans = [("intra", k, [list(range(n * local, n * local + k)) for n in range(nodes)], (0, 1)) for k in group_sizes(local)]
    if nodes > 1:
        plans.append(("inter", nodes, [[n * local for n in range(nodes)]], (0, local)))
    return plans


@record
def hardware_worker(sizes: list[int], backend: str | None, threads: int) -> dict | None:
    """One worker of ``profile --hardware``; rank 0 returns the measurements."""
    from partrain.distributed.launch import (
        detect_launcher, device_for, init_process_group, keep_freed_memory, leave_process_group,
    )

    keep_freed_memory()  # as a training worker does
    info = detect_launcher()
    torch.set_num_threads(threads)
    before = _rss_bytes()
    backend = init_process_group(info, backend, timeout_s=600)
    joined = _rss_bytes() - before
    device = device_for(backend, info)
    out: dict = {"tiers": {}, "notes": [], "process_group_rss_bytes": joined, "backend": backend,
                 "world_size": info.world_size, "local_world_size": info.local_world_size}
    try:
        alone, pair = dist.new_group([0]), dist.new_group([0, 1])  # every rank creates every group
        out["pipeline_action_s"] = measure_pipeline_action(alone, device) if info.rank == 0 else 0.0
        with background_load(info.rank not in (0, 1)):  # the job's other workers compute meanwhile
            out["pipeline_probe"] = measure_pipeline_hops(pair, device) if info.rank in (0, 1) else None
            dist.barrier()
        out["compute_sharing"] = {}
        for k in range(2, info.local_world_size + 1):  # the first k workers of node 0 busy, the rest idle
            group = dist.new_group(list(range(k)))  # every rank creates every group
            if info.rank < k:
                out["compute_sharing"][k] = measure_compute_sharing(group, device)
            dist.barrier()
        for tier, k, groups, pair in _tier_plans(info.world_size, info.local_world_size):
            made = [(ranks, dist.new_group(ranks)) for ranks in groups]  # every rank creates every group
            mine = next(((ranks, g) for ranks, g in made if dist.get_rank() in ranks), (groups[0], None))
            points, notes = measure_collectives(mine[1], mine[0], pair, sizes, device)
            out["tiers"].setdefault(tier, {})[k] = points
            out["notes"] += [n for n in notes if n not in out["notes"]]
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
            links.setdefault(tier, fits["sendrecv"])
    return links, collectives


def fit_pipeline_runtime(probe: dict, action_s: float, grid: int = 200) -> tuple[float, float]:
    """(per-step overhead, per-message latency) that make the pipeline simulation reproduce the
    measured two-stage probe, in least squares over both schedules and all micro-batch counts.

    The per-step overhead adds to every simulated step alike, so for each latency on a grid
    up to half the slowest probe step its best value is the mean residual; the latency with
    the smallest squared error wins. Absolute errors weigh the runs with more micro-batches,
    where messages cost the most, as in real schedules.
    """
    from partrain.predict.pipeline_sim import PipelineCosts, schedule_order, simulate

    (f0, b0), (f1, b1) = probe["stage_s"]
    fwd, bwd = (f0 + action_s, f1 + action_s), (b0 + action_s, b1 + action_s)
    measured = [p["step_s"] for p in probe["steps"]]

    def fit(hop: float) -> tuple[float, float, float]:
        costs = PipelineCosts(fwd, bwd, (hop, 0.0), (0.0, hop))
        residual = [m - simulate(schedule_order(p["schedule"], 2, p["microbatches"]), costs).step_s
                    for m, p in zip(measured, probe["steps"])]
        step = max(0.0, sum(residual) / len(residual))
        return sum((r - step) ** 2 for r in residual), step, hop

    _, step, hop = min(fit(max(measured) / 2 * i / grid) for i in range(grid + 1))
    return step, hop


def fit_compute_sharing(probes: dict, collectives: dict[int, dict[str, CostFit]]) -> tuple[dict[int, float], dict[int, float]]:
    """From ``measure_compute_sharing``'s timings per busy-worker count k: (k -> slowdown of
    computing side by side, never below 1; k -> cost of a synchronisation after computing
    beyond the hot allreduce of a few bytes that the collective fits already count, never below 0)."""
    sharing, sync = {}, {}
    for k, t in probes.items():
        k = int(k)
        sharing[k] = max(1.0, t["together_s"] / t["alone_s"])
        hot = collectives[k]["allreduce"].time(4) if "allreduce" in collectives.get(k, {}) else 0.0
        sync[k] = max(0.0, t["synced_s"] - t["together_s"] - hot)
    return sharing, sync


def profile_hardware(workers: int, sizes: list[int] | None = None, backend: str | None = None, threads: int = 1) -> HardwareProfile:
    """Measure the collectives with ``workers`` workers (or the launcher's) and fit them."""
    from partrain.distributed.launch import detect_launcher
    from partrain.distributed.spawn import spawn

    sizes = sizes or default_sizes()
    info = detect_launcher()
    if info.launched:
        raw = hardware_worker(sizes, backend, threads)
        if raw is None:
            return None  # not rank 0: rank 0 writes the profile
    else:
        if workers < 2:
            raise PartrainError("profile --hardware needs at least 2 workers to time collectives: use --workers 2 or more")
        raw = spawn(hardware_worker, (sizes, backend, threads), workers)[0]
    links, collectives = fit_measurements(raw)
    step_s, hop_s = fit_pipeline_runtime(raw["pipeline_probe"], raw["pipeline_action_s"])
    sharing, sync = fit_compute_sharing(raw["compute_sharing"], collectives.get("intra", {}))
    local = raw["local_world_size"]
    cuda = raw["backend"] == "nccl"
    here = machine()
    return HardwareProfile(
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
        compute_sharing=sharing,
        sync_s=sync,
        notes=raw["notes"],
        points=json.loads(json.dumps({**{tier: {str(k): v for k, v in by.items()} for tier, by in raw["tiers"].items()},
                                      "pipeline": raw["pipeline_probe"], "compute_sharing": raw["compute_sharing"]})),
    )


def local_hardware() -> HardwareProfile:
    """This machine without collective timings: enough for one worker, which communicates nothing."""
    here = machine()
    cuda = here.gpu_count > 0
    return HardwareProfile(here.hash, here.describe(), here.backend, 1, 1, here.cpu_cores,
                           here.memory_gib * 2**30, shared_memory=not cuda, source="local, no collectives measured")


def hardware_for(workers: int, directory=None, refresh: bool = False) -> tuple[HardwareProfile, Path | None, bool]:
    """This machine's hardware profile for ``workers`` local workers: (profile, path, reused).

    One worker needs none. Otherwise the cached profile measured with ``workers`` workers,
    or a new measurement, saved: with as many processes sharing the cores as the job will
    have, collectives cost what they will cost in it.
    """
    if workers <= 1:
        return local_hardware(), None, True
    path = hardware_path(profile_dir(directory), workers)
    if path.is_file() and not refresh:
        return HardwareProfile.load(path), path, True
    profile = profile_hardware(workers)
    return profile, profile.save(path), False


def hardware_table(hw: HardwareProfile):
    """A rich table of the fitted collectives: latency and bandwidth per size range."""
    from rich.table import Table

    table = Table(title=f"{hw.description}: {hw.nodes} node(s) x {hw.workers_per_node} workers, {hw.backend}")
    for name in ("tier", "ranks", "collective", "fit: latency + bytes / bandwidth, per size range"):
        table.add_column(name)
    for tier, by_size in hw.collectives.items():
        for p, fits in sorted(by_size.items()):
            for name, fit in fits.items():
                table.add_row(tier, str(p), name, ";  ".join(_segment_text(s) for s in fit.segments))
    for tier, link in hw.links.items():
        if tier not in hw.collectives:
            table.add_row(tier, "2", "link", _segment_text(link.segments[0]))
    action = f"pipeline runtime: {hw.pipeline_action_s * 1e6:.0f} us per micro-batch action"
    table.caption = "; ".join([action, *hw.notes])
    return table


def _segment_text(seg) -> str:
    upto = "" if seg.upto_bytes == float("inf") else f"<= {seg.upto_bytes / 1024:g} KiB: "
    bandwidth = "inf" if seg.seconds_per_byte == 0 else f"{seg.bandwidth / 1e9:.2f} GB/s"
    return f"{upto}{seg.latency_s * 1e6:.0f} us + n / {bandwidth}"
