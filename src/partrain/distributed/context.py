"""The worker's view of the job: rank, device, and the (pp, dp) device mesh."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from partrain.config import ParallelDims
from partrain.distributed.launch import LaunchInfo
from partrain.events import EventLog


@dataclass
class DistContext:
    """Everything a strategy needs to know about where it runs."""

    info: LaunchInfo
    backend: str
    device: torch.device
    dims: ParallelDims
    mesh: DeviceMesh | None  # ("pp", "dp", "shard"), shard of size 1; None without a process group (serial)
    events: EventLog

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def pp_rank(self) -> int:
        return self.mesh.get_local_rank("pp") if self.mesh is not None else 0

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp") if self.mesh is not None else 0

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The process group along one mesh dimension ("pp" or "dp")."""
        return self.mesh.get_group(dim) if self.mesh is not None else None


def build_mesh(dims: ParallelDims, device: torch.device) -> DeviceMesh | None:
    """The (pp, dp) grid, rank = pp_index * dp + dp_index: replicas of a stage are neighbours.

    A third dimension "shard" of size 1 makes ``mesh["dp", "shard"]`` the 2-D
    (replicate, shard) mesh on which ``fully_shard`` replicates instead of sharding.

    Keeping a stage's replicas on consecutive ranks puts the gradient allreduce (the
    bigger, per-step traffic) inside a node when dp divides the workers per node, and
    the activation send/recv (smaller, per micro-batch) across nodes.
    """
    if not dist.is_initialized():
        return None
    return init_device_mesh(device.type, (dims.pp, dims.dp, 1), mesh_dim_names=("pp", "dp", "shard"))
