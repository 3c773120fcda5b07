"""Starting local workers when no launcher did: PyTorch's elastic launcher, in-process.

``torchrun`` is a thin shell around ``elastic_launch``; calling it directly gives the
same worker environment (RANK, LOCAL_RANK, ...), a c10d rendezvous on a free port of
127.0.0.1, and the same failure handling: when one worker dies, the agent stops the
others and reports which rank failed, so a dead peer never leaves the rest hanging.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from partrain.distributed.launch import free_port
from partrain.errors import PartrainError

class WorkerFailed(PartrainError):
    """A worker process died or raised; names the rank."""

    exit_status = 1


def spawn(entrypoint: Callable, args: tuple, nprocs: int, monitor_interval: float = 0.1) -> dict[int, object]:
    """Run ``entrypoint(*args)`` in ``nprocs`` local workers; returns {rank: return value}.

    ``entrypoint`` must be a module-level function (workers are spawned, so it is pickled),
    decorated with ``torch.distributed.elastic.multiprocessing.errors.record`` so that a
    worker's exception reaches the error report.
    """
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"partrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=monitor_interval,
        start_method="spawn",
    )
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        # the agent logs every failure at length; workers print their own traceback instead
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # workers set their own count at start
    try:
        return elastic_launch(config, entrypoint=entrypoint)(*args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        message = message.strip()
        if message.startswith(f"{PartrainError.__name__}: "):  # bad input, found by a worker
            raise PartrainError(message.removeprefix(f"{PartrainError.__name__}: ")) from None
        reason = (message or f"exit code {failure.exitcode}").splitlines()[-1][:300]
        raise WorkerFailed(f"worker rank {rank} failed ({reason}); the other workers were stopped") from None
