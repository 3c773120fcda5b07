"""Processes and messages, written out: spawn the workers, then allreduce, send and receive
NumPy arrays over ``torch.distributed``'s gloo collectives.

``torch.from_numpy`` wraps an array's memory without a copy, so a collective on the tensor
reduces the NumPy buffer in place; the NumPy code never sees torch.

Workers start with partrain's own ``distributed.spawn``, as ``train``'s do, and meet through a
``file://`` store in a private temporary directory (no listening rendezvous socket), gloo's
connections on the loopback interface. A worker that raises makes ``spawn`` stop the others
(bad input: its one line); Ctrl-C stops them all; one that waits on a dead peer gives up after
``timeout_s``.

Under ``mpirun`` with mpi4py installed nothing is spawned: the processes are mpirun's, and
the messages go over MPI instead (``partrain.scratch.mpi``).
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


class Comm:
    """The messages a worker sends, each on NumPy arrays; one instance per process."""

    backend = "gloo"

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

    def allreduce_sum(self, a: np.ndarray) -> None:
        """``a`` becomes the elementwise sum of every worker's ``a`` (in place)."""
        if self.world > 1:
            dist.all_reduce(torch.from_numpy(a), op=dist.ReduceOp.SUM)

    def isend(self, a: np.ndarray, dst: int):
        """Start sending ``a`` (keep it unchanged until ``.wait()`` on the returned handle)."""
        return dist.isend(torch.from_numpy(a), dst)

    def recv(self, shape: tuple[int, ...], dtype, src: int) -> np.ndarray:
        a = np.empty(shape, dtype)
        dist.recv(torch.from_numpy(a), src)
        return a


def run_workers(fn, args: tuple, nprocs: int, timeout_s: float = 300.0) -> list:
    """``fn(comm, *args)`` in ``nprocs`` processes; returns every rank's return value, by rank
    (under mpirun: on rank 0; the other ranks get None)."""
    from partrain.distributed.spawn import spawn
    from partrain.scratch.mpi import run_under_mpi, under_mpirun

    if under_mpirun():
        return run_under_mpi(fn, args, nprocs)
    if nprocs == 1:
        return [fn(Comm(), *args)]
    results = spawn(_worker, (fn, args, timeout_s), nprocs)  # Ctrl-C, a dead or failed worker: as train's
    return [results[rank] for rank in range(nprocs)]


def _worker(fn, args: tuple, timeout_s: float):
    """One spawned worker: its rank and FileStore from ``spawn``'s environment, gloo on loopback."""
    from partrain.distributed.launch import detect_launcher

    info = detect_launcher()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{info.rendezvous_file}", rank=info.rank,
                            world_size=info.world_size, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(Comm(info.rank, info.world_size), *args)
        dist.barrier()  # nobody leaves while a peer may still be receiving from it
        return result
    finally:
        dist.destroy_process_group()
