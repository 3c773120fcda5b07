"""PNG plots of benchmark rows: the scaling studies' figures.

Every function takes rows as the results store returns them (dicts with the stored
columns plus ``speedup`` and ``efficiency``), uses only the ``ok`` ones, draws one line per
(strategy, workers) series with the median over repeats at each point, and writes a PNG.

Figures are built on ``matplotlib.figure.Figure`` directly, which renders with Agg: no
pyplot state, no display needed, safe to call from any process.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import LogFormatter, ScalarFormatter

from partrain.report.page import write_png

if TYPE_CHECKING:
    from partrain.validate import Report

REGIME_COLOURS = {"perfect scaling": "#d9f0d3", "diminishing returns": "#fee8c8", "maximal data parallelism": "#f4cccc"}


def series(rows: list[dict], x: str, y: Callable[[dict], float | None], by_workers: bool = True) -> dict[str, list[tuple]]:
    """``{label: [(x, median y), ...]}`` sorted by x, over the ok rows where ``y`` is known.

    Rows of the scratch engine are series of their own, every label naming its engine
    ("ddp (torch)", "ddp (scratch)") once the scratch engine is among the rows."""
    points: dict[str, dict] = {}
    tagged = any(engine(r) != "torch" for r in rows)
    for r in rows:
        value = y(r) if r["status"] == "ok" else None
        if value is None:
            continue
        label = f"{r['strategy']} x{r['workers']}" if by_workers else r["strategy"]
        if tagged:
            label += f" ({engine(r)})"
        points.setdefault(label, {}).setdefault(r[x], []).append(value)
    return {label: sorted((k, statistics.median(v)) for k, v in xs.items()) for label, xs in points.items()}


def engine(row: dict) -> str:
    return row.get("engine") or "torch"  # rows of a store written before engines existed: torch


def _draw(ax, lines: dict[str, list[tuple]], **style) -> None:
    for label, pts in lines.items():
        engine_style = {"marker": "s", "linestyle": "-."} if label.endswith("(scratch)") else {"marker": "o"}
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **{**engine_style, **style})


def _finish(fig: Figure, title: str, rows: list[dict], path: str | Path) -> Path:
    bad = sum(r["status"] != "ok" for r in rows)
    if bad:
        title += f"  ({bad} {'cell' if bad == 1 else 'cells'} skipped or failed, not shown)"
    fig.suptitle(title)
    for ax in fig.axes:
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend() is None and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    return write_png(fig, path, dpi=110, bbox_inches="tight")


def _subject(rows: list[dict]) -> str:
    return ", ".join(sorted({f"{r['model']} on {r['dataset']}" for r in rows})) or "no cells"


def plot_batch_size(rows: list[dict], path: str | Path, regimes: list[tuple[int, int, str]]) -> Path:
    """Time per epoch and test accuracy against the global batch; ``regimes`` shaded as
    (from batch, to batch, regime name) spans on the time panel."""
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    time_ax, acc_ax = fig.subplots(1, 2)
    for lo, hi, regime in regimes:
        time_ax.axvspan(lo, hi, color=REGIME_COLOURS[regime], zorder=0)
    _draw(time_ax, series(rows, "batch_size", lambda r: r["seconds_per_epoch"]))
    _draw(acc_ax, series(rows, "batch_size", lambda r: r["test_accuracy"]))
    for ax in (time_ax, acc_ax):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())  # 64, not 2^6
        ax.set_xlabel("global batch size")
    time_ax.set_yscale("log")
    # plain numbers (20, 30, 40), also on the minor ticks when the range is under a decade
    time_ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
    time_ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.4)))
    time_ax.set_ylabel("seconds per epoch")
    acc_ax.set_ylabel("test accuracy")
    if not acc_ax.lines:
        acc_ax.text(0.5, 0.5, "no accuracy: run whole epochs (--epochs)", ha="center", transform=acc_ax.transAxes)
    if regimes:  # two legends on the time panel: the series, and the regimes' colours
        used = dict.fromkeys(regime for _, _, regime in regimes)
        time_ax.add_artist(time_ax.legend(fontsize="small", loc="upper right"))
        time_ax.legend(handles=[Patch(color=REGIME_COLOURS[r], label=r) for r in used], fontsize="small", loc="lower left")
    return _finish(fig, f"Batch-size sweep: {_subject(rows)}", rows, path)


def plot_lr(rows: list[dict], path: str | Path) -> Path:
    """Test accuracy against the learning rate, per strategy (final training loss when the
    cells ran steps, not whole epochs, and have no accuracy)."""
    fig = Figure(figsize=(6.5, 4.5), layout="constrained")
    ax = fig.subplots()
    lines = series(rows, "lr", lambda r: r["test_accuracy"])
    ylabel = "test accuracy"
    if not lines:
        lines, ylabel = series(rows, "lr", lambda r: r["final_loss"]), "final training loss"
    _draw(ax, lines)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel(ylabel)
    return _finish(fig, f"Learning-rate sweep: {_subject(rows)}", rows, path)


def plot_strong(rows: list[dict], path: str | Path) -> Path:
    """Speedup over serial and parallel efficiency against workers, at a fixed global batch."""
    fig, (speed_ax, eff_ax) = _two_panels()
    speedup = series(rows, "workers", lambda r: r["speedup"], by_workers=False)
    _draw(speed_ax, speedup)
    _draw(eff_ax, series(rows, "workers", lambda r: r["efficiency"], by_workers=False))
    workers = sorted({p[0] for pts in speedup.values() for p in pts} | {1})
    speed_ax.plot(workers, workers, "k--", label="ideal")
    eff_ax.axhline(1.0, color="k", linestyle="--", label="ideal")
    _workers_axes((speed_ax, eff_ax), workers, "speedup over serial", "efficiency (speedup / workers)")
    return _finish(fig, f"Strong scaling: {_subject(rows)}, global batch {_batches(rows)}", rows, path)


def plot_weak(rows: list[dict], path: str | Path) -> Path:
    """Throughput and weak-scaling efficiency against workers, the per-worker batch fixed.

    Ideal: W workers process W times the serial samples per second, i.e. the step time of
    serial at the per-worker batch; efficiency = serial step time / the step time on W workers.
    """
    ok = [r for r in rows if r["status"] == "ok"]
    serial_step, serial_rate = {}, {}  # per engine: each engine's efficiency is against its own serial
    for name in {engine(r) for r in ok}:
        serial = [r for r in ok if r["strategy"] == "serial" and engine(r) == name]
        if serial:
            serial_step[name] = statistics.median(r["step_seconds_median"] for r in serial)
            serial_rate[name] = statistics.median(r["samples_per_s"] for r in serial)
    fig, (rate_ax, eff_ax) = _two_panels()
    rates = series(rows, "workers", lambda r: r["samples_per_s"], by_workers=False)
    _draw(rate_ax, rates)
    _draw(eff_ax, series(rows, "workers", lambda r: serial_step[engine(r)] / r["step_seconds_median"]
                         if engine(r) in serial_step else None, by_workers=False))
    workers = sorted({p[0] for pts in rates.values() for p in pts} | {1})
    for name, rate in serial_rate.items():
        tag = f" ({name})" if len(serial_rate) > 1 or name != "torch" else ""
        rate_ax.plot(workers, [w * rate for w in workers], "k--" if len(serial_rate) == 1 else "--", label=f"ideal{tag}")
    if serial_rate:
        eff_ax.axhline(1.0, color="k", linestyle="--", label="ideal")
    _workers_axes((rate_ax, eff_ax), workers, "samples per second", "weak-scaling efficiency (serial step time / step time)")
    per_worker = min((r["batch_size"] for r in ok if r["strategy"] == "serial"), default="?")
    return _finish(fig, f"Weak scaling: {_subject(rows)}, batch {per_worker} per worker", rows, path)


def _two_panels():
    """A figure with two side-by-side axes: a quantity and its efficiency, against workers."""
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    return fig, fig.subplots(1, 2)


def _workers_axes(axes, workers: list[int], *ylabels: str) -> None:
    for ax, ylabel in zip(axes, ylabels):
        ax.set_xlabel("workers")
        ax.set_xticks(workers)
        ax.set_ylabel(ylabel)


def _batches(rows: list[dict]) -> str:
    return ", ".join(str(b) for b in sorted({r["batch_size"] for r in rows}))


def plot_scatter(report: Report, path: str | Path) -> Path:
    """Predicted against measured seconds per step, log-log, one colour per strategy, +-10% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, ax = plt.subplots(figsize=(6.5, 6))
    for strategy in sorted({c.strategy for c in report.cases}):
        pts = [(c.measured_s * 1e3, c.predicted_s * 1e3) for c in report.cases if c.strategy == strategy]
        ax.scatter(*zip(*pts), label=f"{strategy} ({report.mape(strategy):.1%})", s=22)
    values = [v * 1e3 for c in report.cases for v in (c.measured_s, c.predicted_s)]
    lo, hi = min(values) / 1.3, max(values) * 1.3
    ax.plot([lo, hi], [lo, hi], "k-", lw=1)
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey", alpha=0.2, label="±10%")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_formatter(NullFormatter())
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured ms/step", ylabel="predicted ms/step",
           title=f"predicted vs measured, MAPE {report.mape():.1%} over {len(report.cases)} cells")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = write_png(fig, path, dpi=120)
    plt.close(fig)
    return path
