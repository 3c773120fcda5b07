"""A cluster one does not have at hand, described in TOML (see ``examples/cluster.toml``).

Links are given as bandwidth and latency; every collective is derived from them with the
ring formulas in ``predict.comm``.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from partrain.errors import PartrainError
from partrain.predict.fits import CostFit
from partrain.predict.profiles import HardwareProfile

_GB = 1e9


def _number(table: dict, key: str, where: str, default=None, positive=True) -> float:
    value = table.get(key, default)
    if value is None:
        raise PartrainError(f"{where}: missing {key} (see examples/cluster.toml)")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or (positive and value <= 0):
        raise PartrainError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def _link(table: dict | None, tier: str, path: str) -> CostFit:
    where = f"{path} [{tier}]"
    if table is None:
        raise PartrainError(f"{where}: missing table (bandwidth_gb_per_s, latency_us); see examples/cluster.toml")
    bandwidth = _number(table, "bandwidth_gb_per_s", where) * _GB
    latency = _number(table, "latency_us", where, positive=False) * 1e-6
    return CostFit.line(latency, bandwidth)


def load_cluster(path: str | os.PathLike) -> HardwareProfile:
    """A ``HardwareProfile`` from a cluster TOML file (see ``examples/cluster.toml``)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise PartrainError(f"cluster file {path} not found") from None
    except tomllib.TOMLDecodeError as err:
        raise PartrainError(f"cluster file {path} is not valid TOML: {err}") from None
    cluster = data.get("cluster")
    if not isinstance(cluster, dict):
        raise PartrainError(f"{path}: missing [cluster] table; see examples/cluster.toml")
    where = f"{path} [cluster]"
    nodes = int(_number(cluster, "nodes", where))
    per_node = int(_number(cluster, "workers_per_node", where))
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
        cores_per_node=int(_number(cluster, "cores_per_node", where, default=10**6)),
        device_memory_bytes=int(_number(cluster, "device_memory_gb", where) * _GB),
        shared_memory=bool(cluster.get("shared_memory", backend == "gloo")),
        compute_speed=_number(cluster, "compute_speed", where, default=1.0),
        links=links,
        source=str(path),
    )
