"""Who am I, and who started me? Launcher detection and process-group set-up.

partrain runs under three kinds of launcher and reads each one's environment:

- ``torchrun`` (single or multi-node, elastic): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``;
- ``mpirun``: Open MPI's ``OMPI_COMM_WORLD_*`` or MPICH/Intel MPI's ``PMI_RANK``/``PMI_SIZE``
  (with ``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``);
- Slurm ``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODELIST``.

Under MPI and Slurm the rendezvous address comes from ``MASTER_ADDR``/``MASTER_PORT`` when
set, else the first host of the Slurm node list, else 127.0.0.1 (single node). Run directly
(no launcher), partrain starts its own local workers (``distributed.spawn``): they meet in a
``FileStore`` in a private directory, named by ``PARTRAIN_RENDEZVOUS_FILE``.

Trust boundary: a local run opens no socket beyond loopback and unpickles nothing another
user can write. A multi-node job rendezvouses through its launcher's store (torchrun's c10d
store, ``MASTER_ADDR:MASTER_PORT``), which has no authentication: run it only on a network
where every host that can reach that port is trusted, as PyTorch's own documentation says.
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from partrain.errors import PartrainError, causes
from partrain.spec import threads_per_worker

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchInfo:
    """This process's place in the job, as the launcher described it."""

    launcher: str  # "torchrun" | "mpirun" | "slurm" | "local" (partrain's own workers) | "none"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    rendezvous_file: str | None = None  # "local": the FileStore the workers meet in

    @property
    def launched(self) -> bool:
        return self.launcher != "none"


def _int(env: Mapping[str, str], *names: str, default: int | None = None) -> int | None:
    for name in names:
        if env.get(name, "") != "":
            try:
                return int(env[name])
            except ValueError:
                raise PartrainError(f"environment variable {name}={env[name]!r} is not an integer") from None
    return default


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: ``node[03-05,09],gpu1`` -> ``node03``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        return "127.0.0.1"
    prefix, ranges = m.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def detect_launcher(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read the launcher's environment; ``launcher == "none"`` when run directly."""
    env = os.environ if env is None else env
    port = _int(env, "MASTER_PORT", default=DEFAULT_PORT)
    if env.get("PARTRAIN_RENDEZVOUS_FILE") and "RANK" in env:  # a worker partrain started itself
        world = _int(env, "WORLD_SIZE")
        return LaunchInfo("local", _int(env, "RANK"), world, _int(env, "LOCAL_RANK", default=0),
                          _int(env, "LOCAL_WORLD_SIZE", default=world), rendezvous_file=env["PARTRAIN_RENDEZVOUS_FILE"])
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, or any env:// launcher
        world = _int(env, "WORLD_SIZE")
        return LaunchInfo(
            "torchrun", _int(env, "RANK"), world, _int(env, "LOCAL_RANK", default=0),
            _int(env, "LOCAL_WORLD_SIZE", default=world), env.get("MASTER_ADDR", "127.0.0.1"), port,
        )
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
        return LaunchInfo(
            "mpirun", _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK"), world,
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", default=0),
            _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", default=world),
            env.get("MASTER_ADDR", "127.0.0.1"), port,
        )
    if "SLURM_PROCID" in env and _int(env, "SLURM_NTASKS", default=1) > 1:
        world = _int(env, "SLURM_NTASKS")
        nodes = _int(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES", default=1)
        host = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_NODELIST", env.get("SLURM_JOB_NODELIST", "")))
        return LaunchInfo(
            "slurm", _int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID", default=0),
            _int(env, "SLURM_NTASKS_PER_NODE", default=max(1, world // nodes)), host or "127.0.0.1", port,
        )
    return LaunchInfo("none")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(local_world_size: int) -> str:
    """NCCL when every local worker can have a GPU of its own, else gloo."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def set_threads(requested: int | None, local_world_size: int, announce: bool = False) -> int:
    """Intra-op threads per worker: cores / local workers unless the user says otherwise.

    Oversubscribing (more busy threads than cores) slows every worker more than it helps,
    so the default never does it; a user who asks for more, or more workers than cores,
    gets what they asked for, with a note on stderr (``announce``, rank 0) saying so.
    """
    cores = os.cpu_count() or 1
    threads = threads_per_worker(cores, local_world_size, requested)
    torch.set_num_threads(threads)
    if announce and threads * local_world_size > cores:
        print(
            f"partrain: note: {local_world_size} workers x {threads} threads on {cores} cores is oversubscribed; "
            "steps will be slower than with fewer busy threads",
            file=sys.stderr,
        )
    return threads


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's largest accepted value on 64-bit


def keep_freed_memory() -> bool:
    """Tell glibc's allocator to keep freed memory in the process for reuse; True if it took.

    By default glibc serves blocks past a dynamic threshold (at most 32 MB) with fresh
    ``mmap`` pages and hands the top of the heap back to the OS whenever a free leaves more
    than twice that at the top. A training step frees all its activations at the end of
    backward, so the next step faults every page of them in again: on this 2-core VM a
    world-of-one GPipe step of partrain's cnn on CIFAR-10 (batch 128, 4 micro-batches, about
    40 MB of activations in flight) took 139 ms, and 93-97 ms with memory kept; a serial step
    of the same batch is about 95 ms. Keeping it costs nothing the peak resident set size
    (what partrain reports) does not already count. The usual cure on CPU is jemalloc or
    tcmalloc via ``LD_PRELOAD``; this does it from inside, for every worker and the
    profiler alike, so profiles and runs see the same allocator. No-op off glibc.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: libc's, without searching for it
    except (OSError, AttributeError):
        return False  # not glibc (macOS, musl without mallopt): its allocator as it is
    # fixed thresholds: the trim threshold out of reach, the mmap threshold at its maximum
    return bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)) and bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX))


def init_process_group(info: LaunchInfo, backend: str | None, timeout_s: float, needed: bool = True) -> str:
    """Join the job's process group; returns the backend.

    A world of one still gets a group when ``needed``:
    DDP, FSDP and pipelining work on one worker too, which is the 1-worker point of a
    scaling study. Only ``serial`` runs without one. Local workers (and a world of one run
    directly) meet in a ``FileStore`` in a private directory; a launcher's job at its
    ``MASTER_ADDR:MASTER_PORT``.
    """
    backend = backend or default_backend(info.local_world_size)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise PartrainError("backend nccl needs a GPU on every worker; none is visible: use --backend gloo")
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    if dist.is_initialized() or not (needed or info.world_size > 1):
        return backend
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker of torchrun's, started in a session of its own
        from partrain.distributed.spawn import die_with_parent

        # so killing torchrun's process group misses it: a launcher killed outright (a timed-out
        # cell) left its workers blocked in a collective with peers that were gone, for up to
        # the group's timeout (issue 18: link profiles timed out at 06:47 still ran at 07:10,
        # taking a core from every cell after them). Dying with the launcher ends that.
        die_with_parent()
    if info.launcher in ("local", "none"):
        from partrain.distributed.spawn import local_network_env

        for name, value in local_network_env().items():  # this process's own sockets on loopback
            os.environ.setdefault(name, value)
    if info.rendezvous_file:
        init_method = f"file://{info.rendezvous_file}"
    elif info.launched:
        init_method = f"tcp://{info.master_addr}:{info.master_port}"
    else:  # a world of one run directly meets itself in a private FileStore (leave_process_group removes it)
        global _private_store
        _private_store = tempfile.mkdtemp(prefix="partrain-")
        init_method = f"file://{_private_store}/store"
    dist.init_process_group(
        backend, init_method=init_method, rank=info.rank, world_size=info.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return backend


# what gloo and NCCL say when the worker at the other end of a connection has gone
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited")


def peer_left(err: BaseException) -> str | None:
    """What the backend said if ``err``, or an error it was raised from (the pipelining stage's
    "failed to run forward"), is a connection another worker closed by leaving; else None."""
    for e in causes(err):
        # the backends raise RuntimeError (a BrokenPipeError is stdout's reader gone: `| head`)
        if isinstance(e, RuntimeError) and (said := next((w for w in _PEER_GONE if w in str(e)), None)):
            return said
    return None


_private_store: str | None = None  # the directory of a world of one's FileStore, while it lives


def leave_process_group() -> None:
    """Leave the process group (if any) and remove a world of one's private store.

    FSDP's modules and meshes keep the group alive past ``destroy_process_group``; if they
    are only freed at interpreter exit, a gloo thread still holding a finished all-gather
    takes the GIL during finalization and aborts the process. Collecting them first lets
    the group shut its threads down now.
    """
    global _private_store
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
    if _private_store is not None:
        shutil.rmtree(_private_store, ignore_errors=True)
        _private_store = None


def device_for(backend: str, info: LaunchInfo) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", info.local_rank % torch.cuda.device_count())
    return torch.device("cpu")
