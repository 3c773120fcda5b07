"""Processes and messages, written out: spawn the workers, then allreduce, send and receive
NumPy arrays over ``torch.distributed``'s gloo collectives.

``torch.from_numpy`` wraps an array's memory without a copy, so a collective on the tensor
reduces the NumPy buffer in place; the NumPy code never sees torch.

Workers start with ``torch.multiprocessing.spawn`` and meet through a ``file://`` store in a
private temporary directory (no listening rendezvous socket); ``GLOO_SOCKET_IFNAME=lo``
keeps gloo's own connections on the loopback interface. A worker that raises makes
``spawn`` stop the others; one that waits on a dead peer gives up after ``timeout_s``.

Under ``mpirun`` with mpi4py installed nothing is spawned: the processes are mpirun's, and
the messages go over MPI instead (``partrain.scratch.mpi``).
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from partrain.errors import PartrainError


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
    from partrain.scratch.mpi import run_under_mpi, under_mpirun

    if under_mpirun():
        return run_under_mpi(fn, args, nprocs)
    if nprocs == 1:
        return [fn(Comm(), *args)]
    folder = Path(tempfile.mkdtemp(prefix="partrain-scratch-"))  # private: mode 0700
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # children: no torch thread pool competing with ours
        mp.spawn(_worker, (fn, args, nprocs, str(folder), timeout_s), nprocs=nprocs, join=True)
        return [pickle.loads((folder / f"result-{rank}.pkl").read_bytes()) for rank in range(nprocs)]
    except mp.ProcessRaisedException as err:
        last = str(err).strip().splitlines()[-1]
        prefix = f"{PartrainError.__module__}.{PartrainError.__name__}: "
        if last.startswith(prefix):  # bad input found by a worker: its one line, not a traceback
            raise PartrainError(last.removeprefix(prefix)) from None
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _worker(rank: int, fn, args: tuple, world: int, folder: str, timeout_s: float) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo binds to loopback only
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(Comm(rank, world), *args)
        Path(folder, f"result-{rank}.pkl").write_bytes(pickle.dumps(result))
        dist.barrier()  # nobody leaves while a peer may still be receiving from it
    finally:
        dist.destroy_process_group()
