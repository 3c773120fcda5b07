"""Run a training configuration: check it, then run it here, under a launcher, or spawned.

- Under ``torchrun``, ``mpirun`` or ``srun`` this process is one worker: it runs the loop.
- Run directly with one worker, the loop runs in this process.
- Run directly with N > 1 workers, N local workers are started (``distributed.spawn``).

Before any worker starts, ``preflight`` refuses what cannot run (bad pipeline cut, missing
data, unknown model) with one clear line, so a bad configuration never spawns anything.
"""

from __future__ import annotations

import os
import re

import torch

from partrain import checkpoint
from partrain.config import RunConfig
from partrain.data import dataset_spec, load_dataset
from partrain.distributed.launch import LaunchInfo, detect_launcher, peer_left
from partrain.distributed.spawn import MAX_PER_CORE, check_local_workers, spawn
from partrain.errors import PartrainError, PeerLeft, WaitedTooLong, causes
from partrain.models import build_model
from partrain.models.check import checked_model
from partrain.models.registry import raised_by_model
from partrain.outputs import check_dir, check_file
from partrain.spec import fully_sharded
from partrain.strategies.fsdp import check_shardable
from partrain.strategies.pipeline import check_pipeline
from partrain.strategies.precision import check_precision
from partrain.train import EpochHook, RunResult, train_worker


def preflight(cfg: RunConfig) -> RunConfig:
    """Everything that can be checked without a process group, checked in the launcher;
    returns ``cfg`` as the workers should run it (a resume keeps its checkpoint's pipeline cut)."""
    spec = dataset_spec(cfg.dataset)
    model, sample = check_job(cfg.model, cfg.dataset, cfg.data_dir, cfg.synthetic, cfg.model_options)
    if cfg.dims.pp * cfg.stages_per_worker > 1:  # what the stages would send each other, or the tracer's verdict
        build = lambda: build_model(cfg.model, spec.input_shape, spec.num_classes, **cfg.model_options)  # noqa: E731
        check_pipeline(model, build, cfg, sample)
    if fully_sharded(cfg.strategy, cfg.dims.dp):
        check_shardable(model, cfg.model, cfg.strategy)
    if cfg.strategy == "hogwild" and cfg.backend == "nccl":
        raise PartrainError("hogwild shares weights in host memory: run it with --backend gloo")
    # the workers train on a GPU only with NCCL (the default where every worker has one)
    on_gpu = torch.cuda.is_available() and cfg.backend != "gloo" and cfg.strategy != "hogwild"
    check_precision(cfg.precision, "cuda" if on_gpu else "cpu")
    check_machine(cfg)
    check_outputs(cfg)
    if cfg.resume:
        cfg = checkpoint.resume_config(cfg, checkpoint.run_meta(cfg))
    return cfg


def check_job(model: str, dataset: str, data_dir: str | None = None, synthetic: bool = False,
              options: dict | None = None) -> tuple[torch.nn.Module, torch.Tensor]:
    """The dataset read and the model checked on it, in a moment: what ``train`` checks before
    any worker starts, and ``predict``/``recommend`` before a minute of measuring (they timed
    the collectives, then found the dataset missing). Returns the model (on the meta device
    where it builds there) and a sample batch."""
    spec = dataset_spec(dataset)
    # reading the test split proves the files exist and parse (the train split is read by the workers)
    test = load_dataset(dataset, "test", data_dir=data_dir, synthetic=synthetic, limit=2)
    sample = test.get(torch.arange(len(test)))[0]  # token ids are int64, images float32
    return checked_model(model, spec.input_shape, spec.num_classes, options or {}, input_dtype=sample.dtype), sample


def check_machine(cfg: RunConfig) -> None:
    """Refuse workers and threads this machine cannot run (a launcher's job is its own affair)."""
    cores = os.cpu_count() or 1
    if not detect_launcher().launched:
        check_local_workers(cfg.workers, "use a launcher (torchrun, srun) for more machines")
    if cfg.threads is not None and cfg.threads > MAX_PER_CORE * cores:
        raise PartrainError(f"--threads {cfg.threads} on a machine with {cores} cores: at most {MAX_PER_CORE * cores} "
                            f"(leave --threads out for cores / local workers)")


def check_outputs(cfg: RunConfig) -> None:
    """Output paths are refused before training, not when the run has finished."""
    for flag, path in (("--checkpoint", cfg.checkpoint), ("--events", cfg.events)):
        if path is not None:
            check_dir(flag, path)
    checkpoint.check_target(cfg)
    if cfg.save_model is not None:
        check_file("--save-model", cfg.save_model)


def _worker(cfg: RunConfig, info: LaunchInfo, show_progress: bool, on_epoch: EpochHook | None) -> RunResult | None:
    """``train_worker``, with a step that does not fit in memory, or a user's model that raises,
    said in one line (the traceback with ``--debug``); partrain's own errors keep theirs."""
    try:
        return train_worker(cfg, info, show_progress, on_epoch)
    except Exception as err:  # noqa: BLE001 - translated below, or raised again as it is
        line = (out_of_memory(err, cfg) or raised_by_model(err, cfg.model, "training") or left_behind(err, info)
                or waited_too_long(err, cfg, info))
        if line is None:
            raise
        raise line from err


def left_behind(err: BaseException, info: LaunchInfo) -> PeerLeft | None:
    """The one line of a worker of a launched job (torchrun, mpirun, Slurm) whose peer left it:
    every collective it was waiting in fails, and its traceback would bury the line of the worker
    that left, which says why. partrain's own workers need none: ``spawn`` reports the cause."""
    if info.launcher in ("local", "none") or (said := peer_left(err)) is None:
        return None
    return PeerLeft(f"worker rank {info.rank} stopped: another worker left the job ({said}); "
                    "the first worker to fail says why (--debug shows this one's traceback)")


def waited_too_long(err: BaseException, cfg: RunConfig, info: LaunchInfo) -> WaitedTooLong | None:
    """The one line of a worker whose collective or message timed out (``--timeout``): the
    worker that timed out is the one that waited, not the slow one (an audit: a model that
    slept on rank 1 got rank 0 named, with rank 0's traceback)."""
    said = next((str(e).splitlines()[0] for e in causes(err) if isinstance(e, RuntimeError)
                 and any(w in str(e) for w in ("Timed out waiting", "timed out", "Timeout"))), None)
    if said is None:
        return None
    return WaitedTooLong(f"worker rank {info.rank} waited longer than --timeout {cfg.timeout_s:g} s for another "
                         f"worker ({said[-120:]}): one that is slow (a long step, code that blocks) or stuck holds "
                         "the others; raise --timeout, or find where it waits (--debug shows this one's traceback)")


def out_of_memory(err: BaseException, cfg: RunConfig) -> PartrainError | None:
    """The one line for an allocation that failed (the CPU allocator's RuntimeError, CUDA's
    ``OutOfMemoryError``), with what to do; None for any other error."""
    text = str(err)
    if not isinstance(err, torch.OutOfMemoryError) and "can't allocate memory" not in text:
        return None
    asked = re.search(r"[Tt]ried to allocate ([\d.]+ ?[KMGT]i?B|\d+ bytes)", text)
    size = asked.group(1) if asked else "more"
    if size.endswith(" bytes"):
        size = f"{int(size.split()[0]) / 2**30:.1f} GiB"
    where = "GPU" if isinstance(err, torch.OutOfMemoryError) else "machine"
    return PartrainError(f"out of memory: {cfg.model} on {cfg.dataset} at batch {cfg.batch_size} ({cfg.strategy}, "
                         f"{cfg.workers} worker{'s' * (cfg.workers > 1)}) asked for {size} more than this {where} had; "
                         "lower --batch-size, or split the model over more workers (fsdp, gpipe, 1f1b): "
                         "`partrain recommend` predicts what fits")


def worker_main(cfg: RunConfig, show_progress: bool, on_epoch: EpochHook | None = None) -> RunResult | None:
    """Entry point of a spawned worker: its environment says which rank it is (``spawn`` reports
    its error, or prints its crash)."""
    return _worker(cfg, detect_launcher(), show_progress, on_epoch)


def run_training(cfg: RunConfig, show_progress: bool = True, on_epoch: EpochHook | None = None) -> RunResult | None:
    """Run ``cfg``; returns rank 0's result (None on the other ranks of a launched job).

    ``on_epoch(epoch_result)`` is called on rank 0 after every epoch; True stops the run."""
    info = detect_launcher()
    if info.launched:
        if info.world_size != cfg.workers:
            raise PartrainError(
                f"the {info.launcher} launch has {info.world_size} workers but --workers is {cfg.workers}: "
                "leave --workers out under a launcher, or make them agree"
            )
        cfg = preflight(cfg)  # on every rank: each refuses alike, none waits for a peer that quit
        return _worker(cfg, info, show_progress, on_epoch)
    cfg = preflight(cfg)
    if cfg.workers == 1:
        return _worker(cfg, LaunchInfo("none"), show_progress, on_epoch)
    results = spawn(worker_main, (cfg, show_progress, on_epoch), cfg.workers)
    return results[0]
