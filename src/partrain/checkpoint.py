"""Per-worker checkpoints that resume exactly.

Each worker writes its own file, ``<dir>/rank<R>.pt``: the state of the modules it holds
(a pipeline stage, a shard, or the whole model), its optimizer state, the position in
training (epoch, step within it) and the RNG state. Sharded (DTensor) state is saved as
this worker's local shard and put back into the same sharding on load. Files are written
to a temporary name and renamed, so an interrupted save never leaves a torn checkpoint.
Loading uses ``torch.load(weights_only=True)``: a checkpoint cannot run code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from partrain.errors import PartrainError
from partrain.strategies.base import Stepper


def _local(value):
    """Tensors as plain local tensors (a DTensor's shard on this worker)."""
    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_local(v) for v in value)
    return value


def save(directory: str | Path, stepper: Stepper, rank: int, position: dict, meta: dict) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        "model": _local(stepper.state_modules().state_dict()),
        "optimizer": _local(stepper.optimizer.state_dict()),
        "position": position,
        "rng": torch.get_rng_state(),
    }
    path = directory / f"rank{rank}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    if rank == 0:
        (directory / "meta.json").write_text(json.dumps(meta, indent=2, default=str))


def load(directory: str | Path, stepper: Stepper, rank: int, meta: dict) -> dict:
    """Restore this worker's state; returns the saved position (epoch, step, ...)."""
    directory = Path(directory)
    path = directory / f"rank{rank}.pt"
    if not path.exists():
        raise PartrainError(f"no checkpoint for rank {rank} in {directory}: resume with the directory given to --checkpoint")
    saved_meta = json.loads((directory / "meta.json").read_text()) if (directory / "meta.json").exists() else {}
    for key in ("model", "dataset", "strategy", "workers", "pp", "dp", "stages_per_worker", "batch_size"):
        if key in saved_meta and saved_meta[key] != meta.get(key):
            raise PartrainError(
                f"checkpoint in {directory} was written with {key}={saved_meta[key]!r}, this run has "
                f"{key}={meta.get(key)!r}: resume with the same configuration"
            )
    try:
        state = torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same problem to the user
        raise PartrainError(f"cannot read checkpoint {path}: {err}") from None
    with torch.no_grad():
        for key, target in stepper.state_modules().state_dict().items():
            (target.to_local() if isinstance(target, DTensor) else target).copy_(state["model"][key])
    stepper.optimizer.load_state_dict(state["optimizer"])
    _reshard_optimizer_state(stepper.optimizer)
    torch.set_rng_state(state["rng"])
    return state["position"]


def _reshard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Put loaded local shards of optimizer state back into their parameter's sharding."""
    for param, slots in optimizer.state.items():
        if not isinstance(param, DTensor):
            continue
        for name, value in slots.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.to_local().shape:
                slots[name] = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False)
