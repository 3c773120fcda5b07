"""What a sweep prints and draws: the trials, the best one with its command, accuracy plots."""

from __future__ import annotations

import math
from pathlib import Path

from partrain.config import RunConfig
from partrain.report.page import write_png
from partrain.sweep.space import Dimension, train_command, trial_config


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def trial_rows(study) -> list[dict]:
    """One dict per trial, in order: number, state, value, params, epochs reported, seconds, note.

    A surplus trial (two slots asked at once for the last one; the second stopped before it
    trained, and Optuna can only mark it FAIL) is bookkeeping, not a verdict: it is left out."""
    rows = []
    retried = {t.system_attrs.get("failed_trial"): t.number for t in study.get_trials(deepcopy=False)
               if "failed_trial" in t.system_attrs}
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get("surplus"):
            continue
        note = t.user_attrs.get("error", "")
        if t.state.name == "FAIL" and not note:
            first = t.system_attrs.get("failed_trial", t.number)
            note = f"interrupted; run again as #{retried[first]}" if first in retried else "interrupted"
        elif "failed_trial" in t.system_attrs:
            note = f"rerun of interrupted #{t.system_attrs['failed_trial']}"
        rows.append({"number": t.number, "state": t.state.name, "value": t.value, "params": dict(t.params),
                     "epochs": len(t.intermediate_values), "seconds": t.user_attrs.get("seconds"), "note": note})
    return rows


def trials_table(rows: list[dict], dims: list[Dimension], title: str):
    from rich.table import Table

    table = Table(title=title)
    for name in ("#", "state", "accuracy", *[d.name for d in dims], "epochs run", "seconds", "note"):
        table.add_column(name, justify="right" if name not in ("state", "note") else "left")
    for r in rows:
        table.add_row(str(r["number"]), r["state"], f"{r['value']:.2%}" if r["value"] is not None else "-",
                      *[_fmt(r["params"].get(d.name, "-")) for d in dims], str(r["epochs"]),
                      f"{r['seconds']:.1f}" if r["seconds"] else "-", r["note"])
    return table


def best(study, base: RunConfig) -> tuple[object, str] | None:
    """The best complete trial and the ``partrain train`` command that reproduces it: the one
    the trial stored as it ran, not one rebuilt from this run's options."""
    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if not complete:
        return None
    top = max(complete, key=lambda t: (t.value, -t.number))
    if "command" in top.user_attrs:
        return top, top.user_attrs["command"]
    # a trial of a study made before trials stored their command: rebuilt from this run's
    # options, the best guess there is (threads kept: another count sums in another order)
    return top, train_command(trial_config(base, top.params))


def plot(rows: list[dict], dims: list[Dimension], path: str | Path, title: str) -> Path:
    """Accuracy against each searched value, one panel per dimension: complete trials as dots,
    pruned ones (their last reported accuracy) as crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(dims))
    nrows = math.ceil(len(dims) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, dim in zip(axes.flat, dims):
        for state, marker, color in (("COMPLETE", "o", "tab:blue"), ("PRUNED", "x", "tab:red")):
            pts = [(r["params"][dim.name], r["value"]) for r in rows
                   if r["state"] == state and r["value"] is not None and dim.name in r["params"]]
            if not pts:
                continue
            xs, ys = zip(*pts)
            if dim.choices is not None:  # categories at evenly spaced positions, labelled
                order = [str(c) for c in dim.choices]
                xs = [order.index(str(x)) for x in xs]
            ax.scatter(xs, [100 * y for y in ys], marker=marker, color=color, label=state.lower())
        if dim.choices is not None:
            ax.set_xticks(range(len(dim.choices)), [str(c) for c in dim.choices])
            ax.set_xlim(-0.5, len(dim.choices) - 0.5)
        elif dim.log:
            ax.set_xscale("log")
        elif dim.integer:
            from matplotlib.ticker import MaxNLocator

            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(dim.name)
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(dims):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = write_png(fig, path, dpi=100)
    plt.close(fig)
    return path
