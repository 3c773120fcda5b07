"""Checkpoints that resume exactly, written as an atomic set.

A checkpoint directory holds one complete set per save and a pointer to the newest::

    <dir>/step-000120/rank0.pt, rank1.pt, ...   each worker's own state
    <dir>/step-000120/meta.json                 the run's configuration and position (rank 0)
    <dir>/LATEST                                "step-000120"

Each worker writes its file into the new step directory (temporary name, fsync, rename);
after a barrier, when every rank's file is whole, rank 0 writes ``meta.json`` and only
then switches ``LATEST`` (rename, atomic on POSIX) and removes the older sets. A kill at
any moment therefore leaves ``LATEST`` naming a complete set: the previous one until the
new one is whole. A worker's file holds the state of the modules it holds (a pipeline
stage, a shard, or the whole model), its optimizer state and RNG state (the CPU's, and a
GPU run's GPU's); sharded (DTensor) state is saved as the local shard and put back into
the same sharding (uneven shards included) on load. Loading
uses ``torch.load(weights_only=True)``: a checkpoint cannot run code.

``resume_config`` runs in the launcher, before any worker starts: it refuses a set that is
incomplete or was written by a different configuration, and carries over what must not
change (the pipeline cut) while options a resume may change (learning rate, momentum,
weight decay, length of the run) are applied and said.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from partrain.atomic import write_atomic
from partrain.config import RunConfig
from partrain.errors import PartrainError
from partrain.strategies.base import Stepper

POINTER = "LATEST"
# a resume must agree with the checkpoint on these: they decide which state each rank holds
# and which samples each step sees
MUST_MATCH = ("model", "dataset", "model_options", "synthetic", "limit", "strategy", "workers", "pp", "dp",
              "schedule", "stages_per_worker", "microbatches", "balance", "batch_size", "seed", "optimizer",
              "average_every")
# a resume may change these, and is told so; the optimizer's are applied to its state. Precision,
# channels-last and compile change how a step is computed, not what state there is: weights and
# optimizer state are float32 in every precision (an fp16 run's gradient scaler state is kept in
# the set and used when fp16 resumes), so a run that diverged in bf16 may go on in fp32. So does
# recompute: its wrapper adds nothing to the state (pipeline.Recompute keeps the blocks' keys).
MAY_CHANGE = ("lr", "momentum", "weight_decay", "precision", "channels_last", "compile", "recompute")


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


def _write_atomic(path: Path, content) -> None:
    """``atomic.write_atomic``, synced to the disk; a full disk is one clear line."""
    try:
        write_atomic(path, content, sync=True)
    except (OSError, RuntimeError) as err:  # torch.save reports a failed write as a RuntimeError
        full = getattr(err, "errno", None) == errno.ENOSPC or "No space" in str(err) or "inline_container" in str(err)
        free = shutil.disk_usage(path.parent).free / 2**20 if path.parent.exists() else 0.0
        reason = f"the disk is full ({free:.1f} MB free)" if full or free < 1 else str(err).splitlines()[0]
        if path.parent.name.startswith("step-") and not any(path.parent.iterdir()):
            path.parent.rmdir()  # the set this save began: nothing of it is left
        raise PartrainError(f"cannot write checkpoint {path}: {reason}; free space or point --checkpoint elsewhere") from None


def save(directory: str | Path, stepper: Stepper, rank: int, position: dict, meta: dict) -> None:
    """Write this rank's part of the set for ``position``; rank 0 publishes the set once all are whole."""
    directory = Path(directory)
    step_dir = directory / f"step-{position['global_step']:06d}"
    step_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "model": _local(stepper.state_modules().state_dict()),
        "optimizer": _local(stepper.optimizer.state_dict()),
        "scaler": stepper.amp.state_dict(),  # fp16's loss scale and its growth count; {} otherwise
        "position": position,
        "rng": torch.get_rng_state(),
    }
    gpu = _run_gpu()
    if gpu is not None:  # on a GPU, dropout's masks come from its generator, not the CPU's
        state["cuda_rng"] = torch.cuda.get_rng_state(gpu)
    _write_atomic(step_dir / f"rank{rank}.pt", lambda f: torch.save(state, f))
    if dist.is_initialized():
        dist.barrier()  # every rank's file is whole before the pointer moves
    if rank == 0:
        record = {**meta, "position": {k: position[k] for k in ("epoch", "step", "global_step")}}
        _write_atomic(step_dir / "meta.json", json.dumps(record, indent=2, default=str))
        _write_atomic(directory / POINTER, step_dir.name)
        for old in directory.glob("step-*"):  # the older sets, and any partial one a kill left
            if old.name != step_dir.name and _is_set(old):
                shutil.rmtree(old, ignore_errors=True)


# what a set holds: every rank's file, rank 0's meta.json, and their temporary names mid-write
_SET_FILE = re.compile(r"\.?(rank\d+\.pt|meta\.json)(\.\d+-[0-9a-f]+)?(\.tmp)?")  # atomic.write_atomic's names


def _is_set(path: Path) -> bool:
    """A folder this module wrote: ``step-N`` holding nothing but a set's files. A folder the
    user named ``step-notes``, or one holding their own files, is never removed."""
    return (path.is_dir() and re.fullmatch(r"step-\d+", path.name) is not None
            and all(_SET_FILE.fullmatch(f.name) for f in path.iterdir()))


def check_target(cfg: RunConfig) -> None:
    """``--checkpoint DIR`` that already holds a checkpoint is written only by the run resuming
    it: saving there would replace another run's set (the last copy of hours of training)."""
    if cfg.checkpoint is None or not (Path(cfg.checkpoint) / POINTER).is_file():
        return
    if cfg.resume and Path(cfg.resume).resolve() == Path(cfg.checkpoint).resolve():
        return
    held = (Path(cfg.checkpoint) / POINTER).read_text().strip()
    raise PartrainError(f"--checkpoint {cfg.checkpoint} already holds a checkpoint ({held}), which this run would "
                        f"replace: resume it with --resume {cfg.checkpoint}, or give an empty or new directory")


def latest_set(directory: str | Path) -> Path:
    """The newest complete set in ``directory``, or a clear error."""
    directory = Path(directory)
    if not directory.is_dir():
        raise PartrainError(f"--resume {directory}: no such directory; give the directory that --checkpoint wrote")
    pointer = directory / POINTER
    if not pointer.is_file():
        raise PartrainError(f"--resume {directory}: no complete checkpoint there (no {POINTER} file); "
                            "give the directory that --checkpoint wrote")
    step_dir = directory / pointer.read_text().strip()
    if not (step_dir / "meta.json").is_file():
        raise PartrainError(f"--resume {directory}: {POINTER} names {step_dir.name}, which is not a complete set")
    return step_dir


def _read_meta(step_dir: Path) -> dict:
    try:
        meta = json.loads((step_dir / "meta.json").read_text())
        meta["position"]["global_step"]
        return meta
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise PartrainError(f"checkpoint {step_dir}/meta.json is unreadable ({type(err).__name__}): "
                            "resume from another checkpoint or start afresh") from None


def resume_config(cfg: RunConfig, meta: dict) -> RunConfig:
    """Check ``cfg.resume`` against this run before any worker starts; returns ``cfg`` with
    the checkpoint's pipeline cut. ``meta`` is what this run would record (see ``run_meta``)."""
    step_dir = latest_set(cfg.resume)
    saved = _read_meta(step_dir)
    for key in MUST_MATCH:
        if key in saved and saved[key] != meta.get(key):
            raise PartrainError(
                f"checkpoint in {cfg.resume} was written with {key}={saved[key]!r}, this run has "
                f"{key}={meta.get(key)!r}: resume with the same configuration"
            )
    missing = [r for r in range(cfg.workers) if not (step_dir / f"rank{r}.pt").is_file()]
    if missing:
        raise PartrainError(f"checkpoint {step_dir} lacks rank {missing[0]}'s file: the set is incomplete; "
                            "resume from another checkpoint or start afresh")
    changed = [f"{k} {saved[k]} -> {getattr(cfg, k)}" for k in MAY_CHANGE if k in saved and saved[k] != getattr(cfg, k)]
    if changed:
        print(f"partrain: resuming with {', '.join(changed)} (lr, momentum and weight decay applied to the restored "
              "optimizer)", file=sys.stderr)
    cut = list(saved.get("split_points") or [])
    if cut and cfg.split_points is not None and list(cfg.split_points) != cut:
        raise PartrainError(f"checkpoint in {cfg.resume} was written with --split-points {','.join(map(str, cut))}, "
                            f"this run asks for {','.join(map(str, cfg.split_points))}: each rank's file holds its "
                            "stage of that cut; resume without --split-points (the checkpoint's cut is kept)")
    if cut and cfg.split_points is None:
        cfg = cfg.replace(split_points=cut)  # the same cut, so each rank's state fits
    return cfg


def run_meta(cfg: RunConfig, split_points: list[int] | None = None) -> dict:
    """What a checkpoint records of the run that wrote it."""
    return {**cfg.to_dict(), "pp": cfg.dims.pp, "dp": cfg.dims.dp, "split_points": split_points}


def load(directory: str | Path, stepper: Stepper, rank: int, cfg: RunConfig) -> dict:
    """Restore this worker's state from the newest set; returns the saved position (epoch, step, ...)."""
    step_dir = latest_set(directory)
    path = step_dir / f"rank{rank}.pt"
    try:
        state = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise PartrainError(f"no checkpoint for rank {rank} in {step_dir}: the set is incomplete") from None
    except Exception as err:  # noqa: BLE001 - torch.load's errors for a truncated or overwritten file vary
        raise PartrainError(f"checkpoint {path} is unreadable ({type(err).__name__}): the file is damaged; "
                            "resume from another checkpoint or start afresh") from None
    try:
        with torch.no_grad():
            for key, target in stepper.state_modules().state_dict().items():
                (target.to_local() if isinstance(target, DTensor) else target).copy_(state["model"][key])
        stepper.optimizer.load_state_dict(state["optimizer"])
        stepper.amp.load_state_dict(state.get("scaler", {}))
        torch.set_rng_state(state["rng"])
        _restore_gpu_rng(state.get("cuda_rng"))
        position = state["position"]
    except Exception as err:  # noqa: BLE001 - unreadable, a missing key, a wrong shape: the same problem to the user
        reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise PartrainError(f"checkpoint {path} does not fit this run ({type(err).__name__}: {reason}); "
                            "resume with the configuration that wrote it") from None
    _reshard_optimizer_state(stepper.optimizer)
    for group in stepper.optimizer.param_groups:  # what a resume may change, applied
        group["lr"] = cfg.lr
        if "momentum" in group:
            group["momentum"] = cfg.momentum
        group["weight_decay"] = cfg.weight_decay
    return position


def _run_gpu() -> int | None:
    """The GPU this worker runs on (launch sets it current), or None for a CPU run: CUDA is
    initialised only once a run puts something on a GPU."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def _restore_gpu_rng(saved: torch.Tensor | None) -> None:
    """Put back the GPU generator a GPU run saved. A checkpoint from before it was saved, or
    from a CPU run, has none; a CPU run resuming a GPU run's set has no GPU generator to set."""
    gpu = _run_gpu()
    if saved is not None and gpu is not None:
        torch.cuda.set_rng_state(saved, gpu)


def _reshard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Put loaded local shards of optimizer state back into their parameter's sharding."""
    for param, slots in optimizer.state.items():
        if not isinstance(param, DTensor):
            continue
        for name, value in slots.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.to_local().shape:
                # the parameter's global shape and stride, not from_local's guess: FSDP2 cuts dim 0 as
                # torch.chunk does, so 255 rows on 2 workers are shards of 128 and 127, which from_local
                # would take for a [254, ...] tensor (the optimizer's next step then fails on the shapes)
                slots[name] = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                                 shape=param.shape, stride=param.stride())
