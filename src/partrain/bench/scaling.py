"""Scaling studies: the student reports' experiments, each one command, stored and plotted.

- ``batch-size``: time per epoch and test accuracy against the global batch;
- ``lr``: test accuracy against the learning rate, per strategy;
- ``strong``: speedup and efficiency against workers at a fixed global batch (plus the
  serial baseline the speedup needs);
- ``weak``: the batch *per worker* fixed, so W workers train on a global batch W times as
  large; against serial at the per-worker batch.

A study is a list of cells run by the suite runner into the results store, so its cells
are resumable, reused by later studies and visible to ``partrain results``.
"""

from __future__ import annotations

import math
from pathlib import Path

from partrain.bench.runner import run_cells
from partrain.bench.store import Store
from partrain.bench.suite import Cell, Suite, suite_from_dict
from partrain.errors import PartrainError

KINDS = ("batch-size", "lr", "strong", "weak")

# What a study sweeps unless told otherwise. Sweeps train whole epochs (accuracy is the
# point); scaling studies measure steps and extrapolate the epoch (time is the point).
DEFAULTS = {
    "batch-size": {"strategies": ["serial"], "workers": [1], "batch_sizes": [16, 32, 64, 128, 256, 512], "epochs": 1},
    "lr": {"strategies": ["serial"], "workers": [1], "lrs": [0.001, 0.01, 0.1, 0.5], "epochs": 1},
    "strong": {"strategies": ["ddp"], "workers": [1, 2, 4], "warmup_steps": 5, "steps": 20},
    "weak": {"strategies": ["ddp"], "workers": [1, 2, 4], "warmup_steps": 5, "steps": 20},
}

# Regime thresholds on the log-log slope of time per epoch against batch size (see regimes).
PERFECT_SLOPE = -0.75
MAXIMAL_SLOPE = -0.25


def study_suite(kind: str, options: dict) -> Suite:
    """The validated settings of a study: ``options`` (suite keys; None: the default) over
    the kind's defaults."""
    if kind not in KINDS:
        raise PartrainError(f"unknown scaling study {kind!r}; choose one of {', '.join(KINDS)}")
    given = {k: v for k, v in options.items() if v is not None}
    raw = {**DEFAULTS[kind], **given, "name": f"scale-{kind}"}
    if "steps" in given and "epochs" not in given:
        raw.pop("epochs", None)
    if "epochs" in given and "steps" not in given:
        raw.pop("steps", None)
    suite = suite_from_dict(raw, f"partrain scale {kind}")
    swept = {"batch-size": "batch_sizes", "lr": "lrs"}.get(kind)
    for axis in ("batch_sizes", "lrs"):
        if axis != swept and len(getattr(suite, axis)) > 1:
            flag = "--batch-size" if axis == "batch_sizes" else "--lr"
            raise PartrainError(f"the {kind} study takes one {flag} value, got {len(getattr(suite, axis))}")
    return suite


def study_cells(kind: str, suite: Suite) -> list[Cell]:
    """The study's cells: one series per (strategy, workers), serial on one worker only.

    Strong and weak scaling always include the serial baseline on one worker; weak scaling
    multiplies the batch by the workers.
    """
    series = [("serial", 1)] if kind in ("strong", "weak") else []
    series += [(s, w) for s in suite.strategies for w in suite.workers if s != "serial" or w == 1]
    cells: list[Cell] = []
    for strategy, workers in series:
        batches = tuple(b * workers for b in suite.batch_sizes) if kind == "weak" else suite.batch_sizes
        for cell in suite.replace(strategies=(strategy,), workers=(workers,), batch_sizes=batches).cells():
            if cell not in cells:
                cells.append(cell)
    return cells


def regimes(points: list[tuple[int, float]]) -> list[tuple[int, int, str]]:
    """The batch-size regimes of Shallue et al., "Measuring the Effects of Data Parallelism
    on Neural Network Training" (JMLR 2019), read off a time-per-epoch curve.

    ``points`` are (batch size, seconds per epoch). Between consecutive batch sizes, with
    slope s = d log(time per epoch) / d log(batch):

    - s <= -0.75: **perfect scaling** -- doubling the batch (nearly) halves the epoch, as
      the step time hardly grows: the hardware had parallelism to spare;
    - -0.75 < s < -0.25: **diminishing returns** -- the epoch shrinks, less than the batch grows;
    - s >= -0.25: **maximal data parallelism** -- the epoch no longer shrinks: step time
      grows in proportion to the batch, a larger batch buys nothing.

    Shallue et al. define the regimes on steps to a target result; with a fixed number of
    epochs, steps per epoch fall as 1/batch by construction, so the time per epoch is where
    this hardware shows them. The thresholds give the outer regimes a quarter of the range
    [-1, 0] each, so measurement noise of a few percent does not flip a regime. Returns
    (from batch, to batch, regime) spans.
    """
    spans = []
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if b1 <= b0 or t0 <= 0 or t1 <= 0:
            continue
        slope = math.log(t1 / t0) / math.log(b1 / b0)
        regime = ("perfect scaling" if slope <= PERFECT_SLOPE
                  else "maximal data parallelism" if slope >= MAXIMAL_SLOPE else "diminishing returns")
        spans.append((b0, b1, regime))
    return spans


def run_study(kind: str, suite: Suite, store: Store, plot_path: str | Path, *, force: bool = False,
              data_dir: str | None = None, show_progress: bool = True) -> tuple[list[dict], Path]:
    """Run (or reuse) the study's cells, then draw its plot; returns its rows and the PNG.

    The batch-size regimes are read off the first series (the first strategy and worker count).
    """
    from partrain.report import plots

    keys = run_cells(study_cells(kind, suite), store, suite_name=suite.name, data_dir=data_dir or suite.data_dir,
                     timeout=suite.timeout, force=force, show_progress=show_progress)
    rows = store.rows(keys)
    if kind == "batch-size":
        first = plots.series(rows, "batch_size", lambda r: r["seconds_per_epoch"])
        spans = regimes(next(iter(first.values()), []))
        return rows, plots.plot_batch_size(rows, plot_path, spans)
    draw = {"lr": plots.plot_lr, "strong": plots.plot_strong, "weak": plots.plot_weak}[kind]
    return rows, draw(rows, plot_path)
