"""The results store: figures from a run, speedup against the matching serial cell, rows
replaced not duplicated, exports that hold every stored field, and refusals of bad stores.

No process is started here: rows are written from made-up run results.
"""

from __future__ import annotations

import csv
import io
import json
import sqlite3
from dataclasses import replace

import pytest

from partrain.bench.runner import figures
from partrain.bench.store import (
    COLUMN_NAMES,
    COMPUTED,
    Outcome,
    Store,
    export_csv,
    export_json,
)
from partrain.bench.suite import Cell
from partrain.bench.table import results_view
from partrain.cli import main
from partrain.errors import PartrainError
from partrain.predict.machine import Hardware

HW = Hardware("Test CPU", 2, 8, None, 0, "gloo", "2.13.0")
OTHER_HW = replace(HW, cpu_model="Faster CPU")


def cell(**changes) -> Cell:
    base = dict(model="mlp", dataset="mnist", strategy="serial", workers=1, batch_size=64, microbatches=None,
                lr=0.01, warmup_steps=2, steps=4)
    return Cell(**{**base, **changes})


def run_result(step_seconds: float, workers: int = 1, steps: int = 6) -> dict:
    """What ``partrain train --json`` reports, cut down to the fields the figures use."""
    return {
        "step_seconds": [10.0, 5.0] + [step_seconds] * (steps - 2),  # two slow warm-up steps
        "step_losses": [2.3 - 0.1 * i for i in range(steps)],
        "epochs": [],
        "peak_memory_bytes": 300 << 20,
        "peak_memory_per_worker": [(200 + 100 * r) << 20 for r in range(workers)],
    }


def ok(c: Cell, step_seconds: float) -> Outcome:
    return Outcome("ok", figures=figures(c, run_result(step_seconds, c.workers)), config={"batch_size": c.batch_size},
                   started_at="2024-01-01T00:00:00+00:00", finished_at="2024-01-01T00:00:05+00:00", wall_seconds=5.0)


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "results.sqlite") as s:
        yield s


def test_figures_drop_warmup_and_extrapolate_the_epoch():
    c = cell()
    f = figures(c, run_result(0.5))
    assert f["measured_steps"] == 4 and f["steps_run"] == 6
    assert f["step_seconds_median"] == f["step_seconds_p10"] == f["step_seconds_p90"] == 0.5
    assert f["epoch_extrapolated"] == 1
    assert f["seconds_per_epoch"] == pytest.approx(0.5 * (60_000 // 64))  # MNIST's full train split
    assert f["epoch_samples"] == 60_000 // 64 * 64
    assert f["samples_per_s"] == pytest.approx(64 / 0.5)
    assert f["test_accuracy"] is None
    assert f["final_loss"] == pytest.approx(1.8)

    limited = figures(cell(limit=640), run_result(0.5))
    assert limited["seconds_per_epoch"] == pytest.approx(0.5 * 10) and limited["epoch_samples"] == 640


def test_figures_of_whole_epochs_are_measured_with_accuracy():
    c = cell(steps=None, epochs=2, warmup_steps=1)
    result = run_result(0.5) | {"epochs": [
        {"epoch": 1, "steps": 3, "seconds": 4.0, "test_accuracy": 0.8},
        {"epoch": 2, "steps": 3, "seconds": 2.0, "test_accuracy": 0.9},
    ]}
    f = figures(c, result)
    assert f["epoch_extrapolated"] == 0
    assert f["seconds_per_epoch"] == pytest.approx(3.0)
    assert f["epoch_samples"] == 3 * 64
    assert f["test_accuracy"] == 0.9
    p10, median, p90 = f["step_seconds_p10"], f["step_seconds_median"], f["step_seconds_p90"]
    assert p10 <= median <= p90 and median == 0.5 and p90 > median  # the 5 s second step is in the tail


def test_speedup_is_against_the_matching_serial_cell(store):
    ddp = cell(strategy="ddp", workers=2)
    # the parallel cell first: speedup must not depend on the order cells ran in
    store.record(ddp, HW, ok(ddp, 0.25), "t", None)
    store.record(cell(repeat=0), HW, ok(cell(), 0.4), "t", None)
    store.record(cell(repeat=1), HW, ok(cell(), 0.6), "t", None)  # serial baseline = median of repeats = 0.5
    store.record(cell(), OTHER_HW, ok(cell(), 0.05), "t", None)  # other hardware: not a baseline here
    store.record(cell(batch_size=32), HW, ok(cell(batch_size=32), 0.01), "t", None)  # other global batch
    store.record(cell(lr=0.1), HW, ok(cell(lr=0.1), 0.01), "t", None)  # other learning rate
    unmatched = cell(strategy="ddp", workers=2, batch_size=128)
    store.record(unmatched, HW, ok(unmatched, 0.3), "t", None)
    failed = cell(strategy="gpipe", workers=2)
    store.record(failed, HW, Outcome("failed", "boom"), "t", None)

    by_key = {r["cell_key"]: r for r in store.rows()}
    row = by_key[ddp.key(HW.hash)]
    assert row["speedup"] == pytest.approx(2.0)
    assert row["efficiency"] == pytest.approx(1.0)
    assert by_key[cell(repeat=0).key(HW.hash)]["speedup"] == pytest.approx(0.5 / 0.4)
    assert by_key[cell().key(OTHER_HW.hash)]["speedup"] == pytest.approx(1.0)
    assert by_key[unmatched.key(HW.hash)]["speedup"] is None
    assert by_key[failed.key(HW.hash)]["speedup"] is None and by_key[failed.key(HW.hash)]["efficiency"] is None


def test_a_cell_run_again_replaces_its_row(store):
    c = cell()
    store.record(c, HW, Outcome("failed", "killed by SIGKILL (out of memory?)"), "t", None)
    first_id = store.rows()[0]["id"]
    assert not store.measured(c.key(HW.hash))
    store.record(c, HW, ok(c, 0.5), "t", "abc123")
    rows = store.rows()
    assert len(rows) == 1
    assert rows[0]["id"] == first_id and rows[0]["status"] == "ok" and rows[0]["reason"] is None
    assert rows[0]["git_commit"] == "abc123"
    assert store.measured(c.key(HW.hash))
    assert not store.measured(c.key(OTHER_HW.hash))  # measured on this hardware only


def test_rows_carry_the_configuration_hardware_and_version(store):
    c = cell(strategy="gpipe", workers=2)
    outcome = ok(c, 0.5)
    outcome.config = {"strategy": "gpipe", "resolved": {"pp": 2, "dp": 1, "microbatches": 4}}
    store.record(c, HW, outcome, "quick", None)
    (row,) = store.rows()
    assert row["microbatches"] == 4  # the default the run resolved, not None
    assert json.loads(row["config"])["cell"]["strategy"] == "gpipe"
    assert json.loads(row["peak_memory_per_worker"]) == [200 << 20, 300 << 20]
    assert row["peak_memory_bytes"] == 300 << 20
    assert (row["cpu_model"], row["cpu_cores"], row["memory_gib"], row["gpu"], row["backend"], row["torch_version"]) == \
        ("Test CPU", 2, 8, None, "gloo", "2.13.0")
    assert row["hardware_hash"] == HW.hash and row["partrain_version"]
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_exports_hold_every_stored_field(store, tmp_path):
    store.record(cell(), HW, ok(cell(), 0.5), "t", None)
    store.record(cell(workers=2), HW, Outcome("skipped", "strategy serial runs on one worker"), "t", None)
    stored = [r[1] for r in store.db.execute("PRAGMA table_info(cells)")]
    assert stored == COLUMN_NAMES
    rows = store.rows()

    out = io.StringIO()
    export_csv(rows, out)
    parsed = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert list(parsed[0]) == stored + COMPUTED
    for got, row in zip(parsed, rows):
        for name in stored + COMPUTED:
            assert got[name] == ("" if row[name] is None else str(row[name])), name

    out = io.StringIO()
    export_json(rows, out)
    parsed = json.loads(out.getvalue())
    assert [list(r) for r in parsed] == [stored + COMPUTED] * 2
    assert parsed[0]["config"]["cell"]["model"] == "mlp"  # JSON columns decoded
    assert parsed[0]["peak_memory_per_worker"] == [200 << 20]
    assert parsed[1]["reason"] == "strategy serial runs on one worker"

    # and the same through the command line, into files
    for fmt in ("csv", "json"):
        path = tmp_path / f"out.{fmt}"
        assert main(["results", "--store", str(store.path), "--format", fmt, "--output", str(path)]) == 0
        text = path.read_text()
        assert all(name in text for name in stored + COMPUTED)


def test_results_table_shows_rows_and_reasons(store, capsys):
    store.record(cell(), HW, ok(cell(), 0.5), "t", None)
    store.record(cell(workers=2), HW, Outcome("skipped", "strategy serial runs on one worker"), "t", None)
    assert main(["results", "--store", str(store.path)]) == 0
    out = capsys.readouterr().out
    assert "mlp/mnist serial x1 b64 lr0.01" in out and "500.00" in out  # 0.5 s = 500 ms per step
    assert "skipped (1)" in out and "(1) mlp/mnist serial x2 b64 lr0.01: strategy serial runs on one worker" in out
    assert results_view([]) is not None


def test_reading_a_store_leaves_no_wal_or_shm_files_beside_it(tmp_path, capsys):
    path = tmp_path / "results.sqlite"
    with Store(path) as s:
        s.record(cell(), HW, ok(cell(), 0.5), "t", None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.sqlite"]
    assert main(["results", "--store", str(path)]) == 0 and "500.00" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.sqlite"]  # a read-only open left two files here
    path.chmod(0o444)  # a store we may not write is still read (immutable), and nothing is written beside it
    assert main(["results", "--store", str(path)]) == 0 and "500.00" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.sqlite"]


def test_results_of_a_suite_the_store_does_not_hold_names_those_it_holds(store, capsys):
    store.record(cell(), HW, ok(cell(), 0.5), "t", None)
    assert main(["results", "--store", str(store.path), "--suite", "nosuch"]) == 2
    assert "no suite 'nosuch' in" in capsys.readouterr().err


def test_results_without_a_store_is_one_line_and_creates_nothing(tmp_path, capsys):
    path = tmp_path / "none.sqlite"
    assert main(["results", "--store", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("partrain: error: no results store at") and "\n" not in err
    assert not path.exists()


def test_a_file_that_is_not_a_store_is_refused(tmp_path):
    path = tmp_path / "notes.sqlite"
    path.write_text("not a database, just text " * 100)
    with pytest.raises(PartrainError, match="cannot be opened"):
        Store(path)


def test_a_store_of_another_schema_version_is_refused(tmp_path):
    path = tmp_path / "old.sqlite"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 99")
    db.commit()
    db.close()
    with pytest.raises(PartrainError, match="schema version 99"):
        Store(path)
