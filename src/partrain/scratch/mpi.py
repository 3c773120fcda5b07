"""The same messages over MPI, when the job was started by ``mpirun`` and mpi4py is installed.

    mpirun -n 2 partrain train --engine scratch --strategy ddp --workers 2

``mpirun`` has started the processes already, so nothing is spawned: each process is one
rank of ``MPI.COMM_WORLD`` and runs the worker function itself; rank 0 gathers every rank's
result and the others return None (the CLI prints rank 0's only). mpi4py's upper-case
methods (``Allreduce``, ``Isend``, ``Recv``) send NumPy buffers as they are, no pickling,
which is the MPI pattern of the C system this engine follows. mpi4py is optional: without
``mpirun`` the engine spawns its workers and talks over torch.distributed's gloo.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from partrain.errors import PartrainError
from partrain.scratch.comm import Comm

# set by mpirun in every process it starts: Open MPI, PMIx (Open MPI 5, Slurm), MPICH/Hydra
_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE")


def under_mpirun() -> bool:
    return any(name in os.environ for name in _MPI_ENV)


def mpi_available() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


class MpiComm(Comm):
    """``Comm`` over ``MPI.COMM_WORLD``."""

    backend = "mpi"

    def __init__(self):
        from mpi4py import MPI

        self.MPI, self.world_comm = MPI, MPI.COMM_WORLD
        super().__init__(self.world_comm.Get_rank(), self.world_comm.Get_size())

    def allreduce_sum(self, a: np.ndarray) -> None:
        if self.world > 1:  # in place: MPI_IN_PLACE, the buffer is both the input and the sum
            self.world_comm.Allreduce(self.MPI.IN_PLACE, a, op=self.MPI.SUM)

    def isend(self, a: np.ndarray, dst: int):
        return _Request(self.world_comm.Isend(a, dest=dst))

    def recv(self, shape: tuple[int, ...], dtype, src: int) -> np.ndarray:
        a = np.empty(shape, dtype)
        self.world_comm.Recv(a, source=src)
        return a


class _Request:
    """An MPI request that answers ``.wait()``, as a torch.distributed work handle does."""

    def __init__(self, request):
        self.request = request

    def wait(self) -> None:
        self.request.Wait()


def run_under_mpi(fn, args: tuple, nprocs: int) -> list | None:
    """``fn(comm, *args)`` on this rank; every rank's return value on rank 0, None elsewhere."""
    if not mpi_available():
        raise PartrainError("this job runs under mpirun but mpi4py is not installed: pip install mpi4py, "
                            "or run without mpirun (the engine then starts its own workers)")
    comm = MpiComm()
    if comm.world != nprocs:
        raise PartrainError(f"mpirun started {comm.world} processes and this run needs {nprocs}: "
                            f"use mpirun -n {nprocs}, or change --workers")
    results = comm.world_comm.gather(fn(comm, *args), root=0)  # pickled: once, after the run
    comm.world_comm.Barrier()
    return results
