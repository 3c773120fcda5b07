"""The results table for the terminal, and the CSV/JSON exports by name."""

from __future__ import annotations

import dataclasses
import json
import sys

from rich.console import Group
from rich.table import Table
from rich.text import Text

from partrain.atomic import write_atomic
from partrain.bench.store import export_csv, export_json
from partrain.bench.suite import Cell


def _num(value, fmt: str, scale: float = 1.0) -> str:
    return "" if value is None else format(value * scale, fmt)


def _ms(row: dict, key: str) -> str:
    return _num(row[key], ".2f", 1e3)


def _seconds(value: float | None) -> str:
    """Three significant digits, without exponents for the times a benchmark sees."""
    if value is None:
        return ""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}" if value < 1 else f"{value:.2f}"


def results_view(rows: list[dict], title: str | None = None) -> Group:
    """A table, one line per cell (``*``: extrapolated epoch), then why cells did not run.

    Reasons go under the table, numbered, rather than in a column: they are long, and a
    column of them would squeeze the figures out of an 80-column terminal.
    """
    table = Table(title=title, title_justify="left", header_style="bold")
    table.add_column("cell")
    table.add_column("status")
    for name in ("ms/step", "p10-p90", "s/epoch", "samples/s", "speedup", "eff.", "peak MiB", "accuracy", "loss"):
        table.add_column(name, justify="right")
    notes = []
    for r in rows:
        cell = Cell(**json.loads(r["config"])["cell"])
        label = dataclasses.replace(cell, microbatches=r["microbatches"]).label
        status = r["status"]
        if r["reason"]:
            notes.append(f"({len(notes) + 1}) {label}: {r['reason']}")
            status += f" ({len(notes)})"
        table.add_row(
            label, status, _ms(r, "step_seconds_median"),
            f"{_ms(r, 'step_seconds_p10')}-{_ms(r, 'step_seconds_p90')}" if r["step_seconds_p10"] is not None else "",
            _seconds(r["seconds_per_epoch"]) + ("*" if r["epoch_extrapolated"] else ""),
            _num(r["samples_per_s"], ",.0f"), _num(r["speedup"], ".2f"), _num(r["efficiency"], ".2f"),
            _num(r["peak_memory_bytes"], ",.0f", 2**-20), _num(r["test_accuracy"], ".2%"), _num(r["final_loss"], ".4f"),
        )
    return Group(table, Text("\n".join(notes))) if notes else Group(table)


def write_export(rows: list[dict], fmt: str, output: str | None) -> None:
    """Write ``rows`` as CSV or JSON (``fmt``) to ``output`` (a file, written whole) or stdout."""
    write = export_csv if fmt == "csv" else export_json
    if output is None:
        write(rows, sys.stdout)
        return
    write_atomic(output, lambda out: write(rows, out), text=True)  # never a half-written export under the real name
