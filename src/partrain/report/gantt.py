"""A Gantt chart of a timeline as a PNG: measured ranks above, the predicted schedule below.

For people without a browser, and for the HTML report. It shows the last few steps (the
first ones pay warm-up); every row is one track of ``report.trace``, bars coloured by
activity, pipeline bars labelled with their micro-batch. Agg, no pyplot state.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from partrain.report.trace import PREDICTED, Timeline, step_spans, track_order

COLOURS = {"forward": "#4c78a8", "backward": "#f58518", "compute": "#4c78a8", "data": "#9d9d9d",
           "allreduce": "#e45756", "average": "#b279a2", "optimizer": "#54a24b", "runtime": "#c9c9c9",
           "step": "#eeeeee"}
OTHER = "#72b7b2"


def window(timeline: Timeline, steps: int) -> tuple[float, float]:
    """The span of rank 0's last ``steps`` steps (the whole run when it recorded no steps)."""
    marks = step_spans(timeline)
    if not marks:
        return min(s.start_s for s in timeline.spans), max(s.start_s + s.dur_s for s in timeline.spans)
    chosen = marks[-steps:]
    lo, hi = chosen[0].start_s, chosen[-1].start_s + chosen[-1].dur_s
    predicted_end = max((s.start_s + s.dur_s for s in timeline.spans if s.process == PREDICTED and s.start_s >= lo),
                        default=hi)
    return lo, max(hi, min(predicted_end, hi + (hi - lo)))  # a predicted step longer than measured shows too


def rows(timeline: Timeline) -> list[tuple[str, str]]:
    """(process, track) top to bottom; the loop's step marks are left out (the x axis has them)."""
    out = []
    for process in timeline.processes:
        tracks = sorted({s.track for s in timeline.spans if s.process == process and s.track != "step"}, key=track_order)
        out += [(process, t) for t in tracks]
    return out


def draw(timeline: Timeline, steps: int = 2) -> Figure:
    lo, hi = window(timeline, steps)
    order = rows(timeline)
    index = {row: i for i, row in enumerate(order)}
    fig = Figure(figsize=(12, 1.2 + 0.32 * len(order)), layout="constrained")
    ax = fig.subplots()
    used = {}
    for s in timeline.spans:
        row = index.get((s.process, s.track))
        if row is None or s.start_s + s.dur_s < lo or s.start_s > hi:
            continue
        colour = COLOURS.get(s.cat, OTHER)
        used[s.cat] = colour
        x, w = (s.start_s - lo) * 1e3, s.dur_s * 1e3
        ax.barh(row, w, left=x, height=0.7, color=colour, edgecolor="white", linewidth=0.3)
        if s.name[:1] in "FB" and s.name[1:].isdigit() and w > (hi - lo) * 1e3 / 60:
            ax.text(x + w / 2, row, s.name, ha="center", va="center", fontsize=6, color="white")
    for mark in step_spans(timeline):  # step boundaries of rank 0, as dotted lines
        if lo <= mark.start_s <= hi:
            ax.axvline((mark.start_s - lo) * 1e3, color="k", lw=0.6, ls=":")
    boundary = next((i for i, (p, _) in enumerate(order) if p == PREDICTED), None)
    if boundary:
        ax.axhline(boundary - 0.5, color="k", lw=1.2)
    ax.set_yticks(range(len(order)), [f"{'pred.' if p == PREDICTED else p}: {t}" for p, t in order], fontsize=7)
    ax.set_ylim(len(order) - 0.5, -0.5)
    ax.set_xlim(0, (hi - lo) * 1e3)
    ax.set_xlabel(f"ms from the start of step {len(step_spans(timeline)) - min(steps, len(step_spans(timeline)))}"
                  if step_spans(timeline) else "ms")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(handles=[Patch(color=c, label=n) for n, c in used.items()], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    ax.set_title(_title(timeline), fontsize=9)
    return fig


def _title(t: Timeline) -> str:
    cfg = t.meta.get("config") or {}
    if "scratch_config" in t.meta:  # a run of the scratch engine
        cfg = {**t.meta["scratch_config"], "model": "scratch mlp"}
    what = f"{cfg.get('model', '?')}/{cfg.get('dataset', '?')} {cfg.get('strategy', '')} x{t.meta.get('world_size', '?')}"
    parts = [what]
    if t.measured_step_s:
        parts.append(f"measured {t.measured_step_s * 1e3:.2f} ms/step")
    if t.predicted_step_s:
        parts.append(f"predicted {t.predicted_step_s * 1e3:.2f} ms/step ({t.plan})")
    return ", ".join(parts)


def png_bytes(timeline: Timeline, steps: int = 2) -> bytes:
    buf = io.BytesIO()
    draw(timeline, steps).savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def write_gantt(timeline: Timeline, path: str | os.PathLike, steps: int = 2) -> Path:
    from partrain.atomic import write_atomic

    return write_atomic(path, png_bytes(timeline, steps))
