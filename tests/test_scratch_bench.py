"""The scratch engine in the benchmark harness: suites with an ``engine`` key, scratch cells
run by the suite runner into the results store with their own serial baseline, old stores
migrated, both engines' curves labelled, and the predictor kept away from scratch cells."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sqlite3
from pathlib import Path

import pytest

from partrain.bench import Store, load_suite
from partrain.bench.runner import figures, run_cells
from partrain.bench.store import COLUMNS, RUN_COLUMNS, Outcome
from partrain.bench.suite import Cell, suite_from_dict
from partrain.cli import build_parser
from partrain.errors import PartrainError
from partrain.predict.machine import Hardware, fingerprint
from partrain.report import plots
from partrain.scratch import STRATEGIES, ScratchConfig
from partrain.scratch.bench import argv, command_line, scratch_config, stored_config
from partrain.scratch.cli import config_from_args
from partrain.validate import validate

REPO = Path(__file__).resolve().parents[1]
HW = Hardware("Test CPU", 2, 8, None, 0, "gloo", "2.13.0")


def cell(**changes) -> Cell:
    base = dict(model="mlp", dataset="mnist", strategy="serial", workers=1, batch_size=64, microbatches=None, lr=0.01,
                warmup_steps=1, steps=3, limit=512, engine="scratch")
    return Cell(**{**base, **changes})


# --- suites -------------------------------------------------------------------------------


def test_the_scratch_suite_parses_into_both_engines_cells():
    suite = load_suite(REPO / "suites" / "scratch.toml")
    cells = suite.cells()
    assert suite.engine == ("torch", "scratch")
    for engine in ("torch", "scratch"):
        mine = [c for c in cells if c.engine == engine]
        assert {c.strategy for c in mine} == set(STRATEGIES)
        assert {c.dataset for c in mine} == {"mnist", "ocr-letters"} and {c.workers for c in mine} == {1, 2}
    for c in cells:  # every scratch cell can run, but serial on two workers
        if c.engine == "scratch" and not (c.strategy == "serial" and c.workers == 2):
            scratch_config(c, None, suite.timeout)
    with pytest.raises(PartrainError, match="serial is one process"):
        scratch_config(cell(workers=2), None, 60)


def test_the_engine_key_is_checked_and_defaults_to_torch():
    assert suite_from_dict({"models": ["mlp"]}, "s").engine == ("torch",)
    assert suite_from_dict({"models": ["mlp"], "engine": "scratch", "strategies": ["threads"]}, "s").engine == ("scratch",)
    with pytest.raises(PartrainError, match="engine must be one of torch, scratch, got 'numpy'"):
        suite_from_dict({"models": ["mlp"], "engine": "numpy"}, "s")
    with pytest.raises(PartrainError, match="unknown strategy 'threads'"):  # a scratch mode, and no scratch engine
        suite_from_dict({"models": ["mlp"], "strategies": ["threads"]}, "s")


def test_a_torch_cell_keeps_the_key_it_had_before_engines():
    """Stores written before the engine key hold torch cells under these keys: they must
    still be found (not run again), and their serial baselines still match."""
    torch_cell = cell(engine="torch")
    later = ("repeat", "engine", "precision", "channels_last", "compile",  # fields the first stores did not have
             "nodes", "workers_per_node", "link_mbit", "min_seconds")
    before = {k: v for k, v in dataclasses.asdict(torch_cell).items() if k not in later}

    def digest(fields):
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]

    assert torch_cell.key(HW.hash) == digest({**before, "repeat": 0, "hardware": HW.hash})
    assert cell().key(HW.hash) != torch_cell.key(HW.hash)
    # the scratch cell's baseline is scratch serial, never torch serial
    assert cell(strategy="ddp", workers=2).baseline_key(HW.hash) == cell().baseline_key(HW.hash)
    assert cell().baseline_key(HW.hash) != torch_cell.baseline_key(HW.hash)


@pytest.mark.parametrize("changes", [
    {}, {"strategy": "threads", "workers": 2}, {"strategy": "ddp", "workers": 2},
    {"strategy": "hybrid", "workers": 2}, {"strategy": "model-parallel", "workers": 2, "microbatches": 4},
    {"strategy": "local-sgd", "workers": 2, "steps": None, "epochs": 1, "dataset": "ocr-letters"},
])
def test_a_cell_command_line_is_its_configuration_again(changes):
    cfg = scratch_config(cell(**changes), "/data", 120)
    args = build_parser().parse_args(["train", *argv(cfg)])
    assert args.engine == "scratch" and config_from_args(args) == cfg
    assert command_line(stored_config(cfg)).startswith("partrain train --engine scratch")


# --- the runner and the store -----------------------------------------------------------------


def test_scratch_cells_run_into_the_store_with_a_scratch_serial_baseline(tmp_path, data_dir):
    cells = [cell(), cell(strategy="threads", workers=2)]  # one process each: no spawn, a few seconds
    with Store(tmp_path / "results.sqlite") as store:
        # a torch serial row of the same job, 100x slower: a scratch cell's speedup must not use it
        torch_serial = cell(engine="torch")
        slow = {"step_seconds": [1.0] * 4, "step_losses": [2.0] * 4, "epochs": [], "peak_memory_bytes": 1}
        store.record(torch_serial, fingerprint(), Outcome("ok", figures=figures(torch_serial, slow)), "t", None)
        keys = run_cells(cells, store, suite_name="t", data_dir=str(data_dir), timeout=120, show_progress=False)
        rows = store.rows(keys)
    serial, threads = rows
    for r in rows:
        assert r["status"] == "ok", r["reason"]
        assert r["engine"] == "scratch" and r["steps_run"] == 4 and r["measured_steps"] == 3
        assert r["peak_memory_bytes"] > 0 and r["final_loss"] > 0
        run = json.loads(r["config"])["run"]
        assert run["engine"] == "scratch" and run["strategy"] == r["strategy"]
    assert json.loads(threads["config"])["run"]["threads"] == 2
    assert serial["baseline_key"] == threads["baseline_key"] != torch_serial.baseline_key(fingerprint().hash)
    assert serial["speedup"] == pytest.approx(1.0)
    assert threads["speedup"] == pytest.approx(serial["seconds_per_epoch"] / threads["seconds_per_epoch"])
    assert threads["efficiency"] == pytest.approx(threads["speedup"] / 2)
    assert threads["final_loss"] == pytest.approx(serial["final_loss"], abs=1e-4)  # threads reproduce serial (float32)


@pytest.mark.parametrize("version, lacks", [(2, ("engine",)), (1, ("engine", *RUN_COLUMNS))])
def test_a_store_written_before_engines_opens_with_its_cells_as_torch(tmp_path, version, lacks):
    path = tmp_path / "old.sqlite"
    old_columns = ",\n".join(f'"{n}" {sql}' for n, sql, _ in COLUMNS if n not in lacks)
    db = sqlite3.connect(path)
    db.execute(f"CREATE TABLE cells ({old_columns})")
    db.execute(f"PRAGMA user_version = {version}")
    torch_cell = cell(engine="torch")
    db.execute("INSERT INTO cells (cell_key, baseline_key, model, dataset, strategy, workers, batch_size, lr, repeat, "
               "synthetic, warmup_steps, config, status, hardware_hash, seconds_per_epoch) "
               "VALUES (?, ?, 'mlp', 'mnist', 'serial', 1, 64, 0.01, 0, 0, 1, ?, 'ok', ?, 2.0)",
               (torch_cell.key(HW.hash), torch_cell.baseline_key(HW.hash),
                json.dumps({"cell": {k: v for k, v in dataclasses.asdict(torch_cell).items() if k != "engine"}}), HW.hash))
    db.commit()
    db.close()
    with Store(path, create=False) as store:  # read only: not migrated, read as torch all the same
        assert store.rows()[0]["engine"] == "torch"
    with Store(path) as store:
        assert store.measured(torch_cell.key(HW.hash))  # not run again
        row = store.rows()[0]
        assert row["engine"] == "torch" and row["speedup"] == 1.0
        store.record(cell(), HW, Outcome("skipped", "just a row"), "t", None)
        assert [r["engine"] for r in store.rows()] == ["torch", "scratch"]


# --- what reads the store ---------------------------------------------------------------------


def _row(engine: str, strategy: str, workers: int, seconds: float) -> dict:
    return {"engine": engine, "strategy": strategy, "workers": workers, "status": "ok", "speedup": 1.0 / seconds,
            "efficiency": 1.0 / seconds / workers, "samples_per_s": 64 / seconds, "step_seconds_median": seconds, "model": "mlp", "dataset": "mnist",
            "batch_size": 64}


def test_plots_label_each_engines_curves(tmp_path):
    rows = [_row("torch", "serial", 1, 1.0), _row("torch", "ddp", 2, 0.6),
            _row("scratch", "serial", 1, 1.0), _row("scratch", "ddp", 2, 2.0), _row("scratch", "threads", 2, 1.5)]
    lines = plots.series(rows, "workers", lambda r: r["speedup"], by_workers=False)
    assert set(lines) == {"serial (torch)", "ddp (torch)", "serial (scratch)", "ddp (scratch)", "threads (scratch)"}
    assert lines["ddp (scratch)"] == [(2, 0.5)]
    assert set(plots.series(rows[:2], "workers", lambda r: r["speedup"], by_workers=False)) == {"serial", "ddp"}
    for draw in (plots.plot_strong, plots.plot_weak):
        assert draw(rows, tmp_path / f"{draw.__name__}.png").stat().st_size > 1000


def test_validate_leaves_scratch_cells_out_and_says_so():
    row = {**_row("scratch", "ddp", 2, 0.5), "hardware_hash": HW.hash, "config": json.dumps({"run": {"strategy": "threads"}})}

    def never(*_):
        raise AssertionError("a scratch cell was profiled or predicted")

    report = validate([row], never, never, HW.hash)
    assert report.cases == [] and report.skipped == [
        "1 cells of the scratch engine: the predictor models the PyTorch engine, not validated"]


def test_scale_takes_the_engine(monkeypatch):
    seen = {}

    def fake_study(kind, suite, store, plot, **_):
        seen["cells"] = __import__("partrain.bench.scaling", fromlist=["study_cells"]).study_cells(kind, suite)
        return [], Path(plot)

    monkeypatch.setattr("partrain.bench.scaling.run_study", fake_study)
    from partrain.cli import main

    assert main(["scale", "strong", "--engine", "torch,scratch", "--strategies", "ddp", "--workers", "2",
                 "--store", ":memory:", "--quiet"]) == 0
    got = {(c.engine, c.strategy, c.workers) for c in seen["cells"]}
    assert got == {(e, s, w) for e in ("torch", "scratch") for s, w in (("serial", 1), ("ddp", 2))}


def test_a_scratch_config_round_trips_through_argparse_namespace():
    cfg = ScratchConfig(dataset="ocr", strategy="hybrid", workers=2, threads=3, dtype="float64", average_every=None)
    args = build_parser().parse_args(["train", *argv(cfg)])
    assert isinstance(args, argparse.Namespace) and config_from_args(args) == cfg


def test_train_trace_draws_a_scratch_run_with_a_row_per_thread(tmp_path, data_dir, capsys):
    from partrain.cli import main

    out = tmp_path / "trace.json"
    assert main(["train", "--engine", "scratch", "--strategy", "threads", "--threads", "2", "--steps", "4",
                 "--limit", "256", "--no-eval", "--data-dir", str(data_dir), "--trace", str(out)]) == 0
    assert "no prediction (the predictor models the PyTorch engine)" in capsys.readouterr().err
    trace = json.loads(out.read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"step", "data", "compute", "thread 0", "thread 1", "reduce", "optimizer"} <= tracks
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted({e["args"]["step"] for e in spans}) == [0, 1, 2, 3]
