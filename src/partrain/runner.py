"""Run a training configuration: check it, then run it here, under a launcher, or spawned.

- Under ``torchrun``, ``mpirun`` or ``srun`` this process is one worker: it runs the loop.
- Run directly with one worker, the loop runs in this process.
- Run directly with N > 1 workers, N local workers are started (``distributed.spawn``).

Before any worker starts, ``preflight`` refuses what cannot run (bad pipeline cut, missing
data, unknown model) with one clear line, so a bad configuration never spawns anything.
"""

from __future__ import annotations

import os
import sys
import traceback

from torch.distributed.elastic.multiprocessing.errors import record

from partrain.config import RunConfig
from partrain.data import dataset_spec, load_dataset
from partrain.distributed.launch import LaunchInfo, detect_launcher
from partrain.distributed.spawn import spawn
from partrain.errors import PartrainError
from partrain.models import build_model, model_blocks
from partrain.strategies.partition import pipeline_refusal
from partrain.train import EpochHook, RunResult, train_worker


def preflight(cfg: RunConfig) -> None:
    """Everything that can be checked without a process group, checked in the launcher."""
    spec = dataset_spec(cfg.dataset)
    # reading the test split proves the files exist and parse (the train split is read by the workers)
    load_dataset(cfg.dataset, "test", data_dir=cfg.data_dir, synthetic=cfg.synthetic, limit=1)
    model = build_model(cfg.model, spec.input_shape, spec.num_classes, **cfg.model_options)
    if reason := pipeline_refusal(cfg, len(model_blocks(model))):
        raise PartrainError(reason)
    if cfg.strategy == "hogwild" and cfg.backend == "nccl":
        raise PartrainError("hogwild shares weights in host memory: run it with --backend gloo")


@record
def worker_main(cfg: RunConfig, show_progress: bool, on_epoch: EpochHook | None = None) -> RunResult | None:
    """Entry point of a spawned worker: its environment says which rank it is."""
    try:
        return train_worker(cfg, detect_launcher(), show_progress, on_epoch)
    except PartrainError:
        raise  # @record hands its message to the launcher, which raises it as one line
    except Exception:
        print(f"partrain: worker rank {os.environ.get('RANK', '?')} crashed:\n{traceback.format_exc()}", file=sys.stderr)
        raise


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
        preflight(cfg)  # on every rank: each refuses alike, none waits for a peer that quit
        return train_worker(cfg, info, show_progress, on_epoch)
    preflight(cfg)
    if cfg.workers == 1:
        return train_worker(cfg, LaunchInfo("none"), show_progress, on_epoch)
    results = spawn(worker_main, (cfg, show_progress, on_epoch), cfg.workers)
    return results[0]
