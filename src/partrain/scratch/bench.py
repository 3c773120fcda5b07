"""A benchmark cell on the scratch engine: the ``ScratchConfig`` it trains with, the command
line that runs it, and what the store keeps of it.

The suite runner (``partrain.bench.runner``) runs a scratch cell as it runs a PyTorch one,
``python -m partrain train ... --json --quiet`` in fresh processes under its timeout, with
``--engine scratch`` added; the figures come from the same JSON result and the speedup is
against the scratch serial cell of the same job (``Cell.baseline_key`` holds the engine).

How a cell's ``workers`` and ``threads`` map onto the engine's processes and threads:
``threads`` W is W threads in one process; ``ddp``, ``model-parallel`` and ``local-sgd`` W
are W processes of one thread; ``hybrid`` W is W processes of ``threads`` threads each, 2
when the suite's ``threads`` is 1 (one thread per process would be ddp).
"""

from __future__ import annotations

import dataclasses
import shlex

from partrain.config import to_argv
from partrain.errors import PartrainError
from partrain.scratch.train import ScratchConfig

HYBRID_THREADS = 2  # threads per process of a hybrid cell when the suite leaves threads at 1


def scratch_config(cell, data_dir: str | None, timeout: float) -> ScratchConfig:
    """The configuration a scratch ``Cell`` trains with; ``PartrainError`` if it cannot run.

    Steps mode, as the PyTorch engine's cells: warm-up plus measured steps, no evaluation.
    """
    if cell.model != "mlp":
        raise PartrainError(f"the scratch engine builds the mlp only, not {cell.model!r}")
    if (cell.precision, cell.channels_last, cell.compile) != ("fp32", False, False):
        raise PartrainError("the scratch engine runs NumPy in float32 (or float64), eagerly: precision, "
                            "channels_last and compile are the torch engine's")
    total = None if cell.steps is None else cell.warmup_steps + cell.steps
    workers, threads = cell.workers, 1
    if cell.strategy == "threads":
        workers, threads = 1, cell.workers
    elif cell.strategy == "hybrid":
        threads = cell.threads if cell.threads > 1 else HYBRID_THREADS
    return ScratchConfig(  # relu on every dataset: the zoo's mlp, which the job's torch cells train
        dataset=cell.dataset, activation="relu", epochs=cell.epochs or total, steps=total, limit=cell.limit, eval_limit=cell.eval_limit,
        evaluate=cell.steps is None, batch_size=cell.batch_size, lr=cell.lr, seed=cell.seed, strategy=cell.strategy,
        workers=workers, threads=threads, microbatches=cell.microbatches, timeout_s=min(timeout, 300.0),
        data_dir=data_dir, synthetic=cell.synthetic,
    )


def argv(cfg: ScratchConfig) -> list[str]:
    """The ``partrain train`` arguments that run ``cfg`` (``cli.config_from_args`` of them is
    ``cfg`` again: a test)."""
    values = {**dataclasses.asdict(cfg), "model": "mlp", "hidden": list(cfg.hidden)}
    values["average_every"] = "epoch" if cfg.average_every is None else cfg.average_every
    if cfg.strategy == "threads":  # the thread count is given as --threads (--workers would be 1 here)
        values["workers"] = None
    out = ["--engine", "scratch", *to_argv(values)]  # to_argv writes the train options; --dtype is the engine's
    if cfg.activation != ScratchConfig(dataset=cfg.dataset).activation:  # the dataset's default: sigmoid on the letters
        out += ["--activation", cfg.activation]
    return out + (["--dtype", cfg.dtype] if cfg.dtype != "float32" else [])


def command_line(config: dict) -> str:
    """``partrain train ...`` for a stored scratch cell's configuration (``stored_config``)."""
    fields = {f.name for f in dataclasses.fields(ScratchConfig)}
    cfg = ScratchConfig(**{k: v for k, v in config.items() if k in fields})
    return shlex.join(["partrain", "train", *argv(cfg)])


def stored_config(cfg: ScratchConfig) -> dict:
    """What the store keeps as the cell's ``run`` configuration."""
    return {**dataclasses.asdict(cfg), "model": "mlp", "engine": "scratch", "processes": cfg.processes,
            "resolved": {"microbatches": cfg.microbatches or (2 * cfg.workers if cfg.strategy == "model-parallel" else None)}}
