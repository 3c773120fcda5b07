"""A cluster one does not have at hand, described in TOML (see ``examples/cluster.toml``).

Links are given as bandwidth and latency; every collective is derived from them with the
ring formulas in ``predict.comm``.
"""

from __future__ import annotations

import math
import os
import tomllib
from pathlib import Path

from partrain.errors import PartrainError
from partrain.predict.fits import CostFit
from partrain.predict.profiles import HardwareProfile

_GB = 1e9


# the keys each table of a cluster file takes; anything else is a typo, refused by name
_CLUSTER_KEYS = {
    "cluster": {"name", "nodes", "workers_per_node", "device_memory_gb", "shared_memory", "compute_speed",
                "cores_per_node", "backend"},
    "intra": {"bandwidth_gb_per_s", "latency_us"},
    "inter": {"bandwidth_gb_per_s", "latency_us"},
}
_BACKENDS = ("gloo", "nccl")


# what a real cluster's figures can be: the predictor's arithmetic stays finite inside these
# (a 1e300 GB memory overflowed to infinity, a 1e308 us latency stopped the pipeline simulation's
# clock), and a figure outside them is a typo in units
_RANGES = {
    "nodes": (1, 100_000), "workers_per_node": (1, 4096), "cores_per_node": (1, 10**6),
    "device_memory_gb": (1e-3, 1e6), "compute_speed": (1e-6, 1e6),
    "bandwidth_gb_per_s": (1e-6, 1e6), "latency_us": (0, 1e7),
}


def _number(table: dict, key: str, where: str, default=None, integer=False) -> float:
    value = table.get(key, default)
    if value is None:
        raise PartrainError(f"{where}: missing {key} (see examples/cluster.toml)")
    kind = "a whole number" if integer else "a finite number"
    lo, hi = _RANGES[key]
    ok = isinstance(value, int) if integer else isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(value, bool) or not ok or not lo <= value <= hi:
        raise PartrainError(f"{where}: {key} must be {kind} from {lo:g} to {hi:g}, got {value!r}")
    return float(value)


def _link(table: dict | None, tier: str, path: str) -> CostFit:
    where = f"{path} [{tier}]"
    if not isinstance(table, dict):
        raise PartrainError(f"{where}: missing table (bandwidth_gb_per_s, latency_us); see examples/cluster.toml")
    bandwidth = _number(table, "bandwidth_gb_per_s", where) * _GB
    latency = _number(table, "latency_us", where) * 1e-6
    return CostFit.line(latency, bandwidth)


def load_cluster(path: str | os.PathLike) -> HardwareProfile:
    """A ``HardwareProfile`` from a cluster TOML file (see ``examples/cluster.toml``), or a
    measured hardware profile (``.json``, as ``partrain profile --hardware`` writes it): the
    cluster measured for real, e.g. across nodes under torchrun."""
    path = Path(path)
    if path.suffix == ".json":
        if not path.is_file():
            _missing(path)
        try:
            return HardwareProfile.load(path)
        except PartrainError as err:  # the load's fix ("delete it") is for partrain's cache, not a file the user named
            raise PartrainError(f"--cluster {path} is not a hardware profile partrain can use "
                                f"({str(err).removesuffix(': delete it or profile again')}): give a cluster TOML "
                                "(examples/cluster.toml) or a profile that `partrain profile --hardware` wrote") from None
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        _missing(path)
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
    shared = cluster.get("shared_memory", backend == "gloo")
    if not isinstance(shared, bool):  # bool("no") is True
        raise PartrainError(f"{where}: shared_memory must be true or false, got {shared!r}")
    if not isinstance(cluster.get("name", ""), str):
        raise PartrainError(f"{where}: name must be a string, got {cluster['name']!r}")
    return HardwareProfile(
        fingerprint=f"cluster:{path.name}",
        description=str(cluster.get("name", path.stem)),
        backend=backend,
        nodes=nodes,
        workers_per_node=per_node,
        cores_per_node=int(_number(cluster, "cores_per_node", where, default=10**6, integer=True)),
        device_memory_bytes=int(_number(cluster, "device_memory_gb", where) * _GB),
        shared_memory=shared,
        compute_speed=_number(cluster, "compute_speed", where, default=1.0),
        links=links,
        source=str(path),
    )


def check_workers_fit(hardware: HardwareProfile, workers: int, source: str) -> None:
    """Refuse a plan of more workers than the cluster described by ``source`` has: its nodes
    times its workers per node (ranks beyond them have nowhere to run). One machine profiled
    with fewer workers is not full: more of them share its cores, as on the machine itself."""
    if hardware.nodes <= 1 and not hardware.fingerprint.startswith("cluster:"):  # a measured profile, not a TOML
        return
    room = hardware.nodes * hardware.workers_per_node
    if workers > room:
        raise PartrainError(f"--workers {workers} is more than {source} has: {hardware.nodes} node(s) x "
                            f"{hardware.workers_per_node} worker(s) = {room}")


def _missing(path: Path):
    raise PartrainError(f"cluster file {path} not found")
