"""The results store: one SQLite table, one row per benchmark cell on one machine.

Why SQLite: it ships with Python, one file holds every result, and its transactions make
the store safe to kill. The database runs in WAL mode and every cell is written in one
transaction after the cell finished, so killing the runner at any moment loses at most
the cell in flight; the file is never half-written. A concurrent reader (``partrain
results`` while a suite runs) sees the cells committed so far.

A row is keyed by ``cell_key``: the hash of the normalized cell configuration, the
hardware fingerprint's hash and the repeat index (``Cell.key``). Running a cell again
(after a failure, or with ``--force``) replaces its row, so the store holds the latest
run of every cell and a resumed suite has every cell exactly once.

Every cell records the device it ran on (``cpu`` or the GPU's name) and the numerics it ran
with (precision, channels-last, compile), so that ``validate`` holds a GPU prediction only
against GPU cells. A store written before these columns existed (schema 1) is migrated when
opened for writing: the columns are added, and its rows say what they ran with: fp32, eager,
and the GPU when the machine had one and the run's backend was not gloo, else ``cpu``
(``legacy_run_columns``). Opened only to read, the same values are filled in as rows are read.

Speedup and efficiency are not stored: they are computed when the rows are read
(``with_speedup``), against the serial rows that share the cell's ``baseline_key``, so
they do not depend on the order in which the cells ran and stay right when a serial
baseline is measured again.
"""

from __future__ import annotations

import csv
import json
import os
import random
import sqlite3
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from partrain import __version__
from partrain.bench.suite import Cell
from partrain.errors import PartrainError
from partrain.predict.machine import Hardware

STORE_ENV = "PARTRAIN_STORE"
DEFAULT_STORE = Path("~/.partrain/results.sqlite")
SCHEMA_VERSION = 2  # 2: device, precision, channels_last, compile, gpu_memory_mib
STATUSES = ("ok", "skipped", "failed", "timeout")

# (column, SQL type, meaning). The order is the order of every export.
COLUMNS: list[tuple[str, str, str]] = [
    ("id", "INTEGER PRIMARY KEY", "row id, in the order cells were first stored"),
    ("cell_key", "TEXT NOT NULL UNIQUE", "hash of the normalized cell, the hardware hash and the repeat"),
    ("baseline_key", "TEXT NOT NULL", "shared with the serial cells this cell's speedup is measured against"),
    ("suite", "TEXT", "the suite or scaling study that ran the cell"),
    ("engine", "TEXT NOT NULL DEFAULT 'torch'", "torch: PyTorch's modules and strategies; scratch: the NumPy engine "
     "(partrain.scratch); a cell's speedup is against the serial run of its own engine"),
    ("model", "TEXT NOT NULL", ""),
    ("dataset", "TEXT NOT NULL", ""),
    ("strategy", "TEXT NOT NULL", ""),
    ("workers", "INTEGER NOT NULL", ""),
    ("batch_size", "INTEGER NOT NULL", "global batch"),
    ("microbatches", "INTEGER", "pipelines: micro-batches per batch, the default resolved when the cell ran"),
    ("lr", "REAL NOT NULL", ""),
    ("repeat", "INTEGER NOT NULL", "repeat index, 0-based"),
    ("synthetic", "INTEGER NOT NULL", "1: generated data"),
    ("warmup_steps", "INTEGER NOT NULL", "steps left out of the step-time statistics"),
    ("steps", "INTEGER", "measured steps after warm-up (steps mode)"),
    ("epochs", "INTEGER", "whole epochs (epochs mode)"),
    ("limit_samples", "INTEGER", "trained on the first N samples only"),
    ("threads", "INTEGER", "intra-op threads per worker"),
    ("device", "TEXT", "what the cell trained on: cpu, or the GPU's name"),
    ("precision", "TEXT", "fp32 | bf16 | fp16 (autocast)"),
    ("channels_last", "INTEGER", "1: --channels-last"),
    ("compile", "INTEGER", "1: --compile"),
    ("nodes", "INTEGER", "emulated nodes the cell ran across (NULL: this machine)"),
    ("workers_per_node", "INTEGER", "across emulated nodes: workers on each"),
    ("link_mbit", "REAL", "across emulated nodes: the shaped rate of their link, Mbit/s"),
    ("config", "TEXT NOT NULL", "JSON: the full cell and RunConfig"),
    ("status", "TEXT NOT NULL", "ok | skipped | failed | timeout"),
    ("reason", "TEXT", "why a cell was skipped or failed"),
    ("steps_run", "INTEGER", "optimizer steps taken, warm-up included"),
    ("measured_steps", "INTEGER", "steps in the step-time statistics"),
    ("step_seconds_median", "REAL", "rank 0's wall time per step after warm-up"),
    ("step_seconds_p10", "REAL", ""),
    ("step_seconds_p90", "REAL", ""),
    ("seconds_per_epoch", "REAL", "measured over whole epochs, or extrapolated"),
    ("epoch_extrapolated", "INTEGER", "1: median step time x steps in a full epoch"),
    ("epoch_samples", "INTEGER", "samples in the epoch of seconds_per_epoch"),
    ("samples_per_s", "REAL", "global batch / median step time"),
    ("peak_memory_bytes", "INTEGER", "the largest peak over the workers (RSS on CPU, allocator peak on GPU)"),
    ("peak_memory_per_worker", "TEXT", "JSON list, by rank"),
    ("test_accuracy", "REAL", "after the last whole epoch (epochs mode only)"),
    ("final_loss", "REAL", "training loss of the last step"),
    ("partition", "TEXT", "pipelines: the blocks, parameters and measured time of each stage"),
    ("wall_seconds", "REAL", "the cell's process, start to exit"),
    ("load_average", "REAL", "1-minute load average as the cell started (the previous cell's share decays in it); "
     "above the cores, other work was competing"),
    ("hardware_hash", "TEXT NOT NULL", ""),
    ("cpu_model", "TEXT", ""),
    ("cpu_cores", "INTEGER", ""),
    ("memory_gib", "INTEGER", ""),
    ("gpu", "TEXT", ""),
    ("gpu_count", "INTEGER", ""),
    ("gpu_memory_mib", "INTEGER", "per GPU"),
    ("backend", "TEXT", "default collective backend of the machine"),
    ("torch_version", "TEXT", ""),
    ("partrain_version", "TEXT", ""),
    ("git_commit", "TEXT", "None when partrain is not a git checkout"),
    ("started_at", "TEXT", "UTC, ISO 8601"),
    ("finished_at", "TEXT", "UTC, ISO 8601"),
]
COLUMN_NAMES = [name for name, _, _ in COLUMNS]
# columns schema 2 added, and what a row stored before them ran with (legacy_run_columns)
RUN_COLUMNS = ("device", "precision", "channels_last", "compile", "gpu_memory_mib")
COMPUTED = ["speedup", "efficiency"]  # added by with_speedup when rows are read
_JSON_COLUMNS = ("config", "peak_memory_per_worker")


@dataclass
class Outcome:
    """How one cell went: its status, the figures measured, and when."""

    status: str
    reason: str | None = None
    figures: dict = field(default_factory=dict)  # measured columns, see runner.figures
    config: dict = field(default_factory=dict)  # RunConfig.to_dict() plus "resolved": pp, dp, microbatches
    started_at: str | None = None
    finished_at: str | None = None
    wall_seconds: float | None = None
    load_average: float | None = None


def default_store_path() -> Path:
    """``$PARTRAIN_STORE``, else ``~/.partrain/results.sqlite``: one store per user, across projects."""
    return Path(os.environ.get(STORE_ENV) or DEFAULT_STORE).expanduser()


class Store:
    """The results store at ``path``, created on first use (``create=False`` to only read one)."""

    def __init__(self, path: str | os.PathLike | None = None, create: bool = True):
        self.path = Path(path).expanduser() if path is not None else default_store_path()
        if path is not None and str(path) == "":
            raise PartrainError("--store needs a file name, e.g. results.sqlite")
        if self.path.is_dir():
            raise PartrainError(f"results store {self.path} is a directory: give a file, e.g. {self.path / 'results.sqlite'}")
        if blocker := next((a for a in self.path.parents if a.exists() and not a.is_dir()), None):
            raise PartrainError(f"results store {self.path}: {blocker} is a file, not a folder")
        if not create and not self.path.is_file():
            raise PartrainError(f"no results store at {self.path}: run `partrain bench` first, or pass --store PATH")
        try:
            if create:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.db = sqlite3.connect(self.path, timeout=30)
                self.db.row_factory = sqlite3.Row
                self._check_ours()  # before the first write; again under the write lock in _prepare
                self._prepare()
            else:  # only read: nothing is created, and only SELECTs are run
                # mode=rw, not ro: a read-only connection to a WAL database makes -wal and -shm files
                # it cannot remove as it closes, so `partrain results` left two files beside the store;
                # a read-write one, the last to close, removes them. A store in a folder we may not
                # write is read immutable (no -shm file needed).
                writable = os.access(self.path.parent, os.W_OK) and os.access(self.path, os.W_OK)
                uri = f"{self.path.resolve().as_uri()}?{'mode=rw' if writable else 'immutable=1'}"
                self.db = sqlite3.connect(uri, uri=True, timeout=30)
                self.db.row_factory = sqlite3.Row
                self._check_ours()
                if not self.db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'cells'").fetchone():
                    # an empty SQLite file (`touch`): nothing to read, and only `bench` creates the table
                    raise PartrainError(f"{self.path} holds no partrain results (no cells table): run "
                                        f"`partrain bench ... --store {self.path}` first, or pass another --store")
        except sqlite3.DatabaseError as err:
            raise PartrainError(f"results store {self.path} cannot be opened: {err}") from None
        except OSError as err:
            raise PartrainError(f"results store {self.path} cannot be created: {err.strerror}") from None

    def _check_ours(self) -> None:
        """Refuse another program's database before anything is written into it."""
        names = {row[0] for row in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if names - {"cells"}:
            raise PartrainError(f"{self.path} is not a partrain results store (it holds tables such as "
                                f"{sorted(names - {'cells'})[0]!r}): pass another --store")
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        self.legacy = "cells" in names and version == 1  # migrated by _prepare, or filled in by rows()
        if "cells" in names and version not in (1, SCHEMA_VERSION):
            raise PartrainError(
                f"results store {self.path} has schema version {version}, this partrain uses {SCHEMA_VERSION}: "
                "pass another --store"
            )

    def _prepare(self) -> None:
        """Create or migrate the table in one write transaction, so that two runs opening a new
        store at once see it either absent or whole (never a table without its schema version)."""
        self._wal()
        self.db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across a killed process
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")  # the write lock now, waiting up to the connection's timeout
            self._check_ours()
            columns = ",\n  ".join(f'"{name}" {sql}' for name, sql, _ in COLUMNS)
            self.db.execute(f"CREATE TABLE IF NOT EXISTS cells (\n  {columns}\n)")
            self._add_missing_columns()
            if self.legacy:
                self._migrate()
            self.db.execute("CREATE INDEX IF NOT EXISTS cells_by_config ON cells(model, dataset, strategy, workers, batch_size)")
            self.db.execute("CREATE INDEX IF NOT EXISTS cells_by_baseline ON cells(baseline_key)")
            self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _wal(self, wait_s: float = 30.0) -> None:
        """Switch to write-ahead logging, which lets readers go on beside a writer. The switch
        needs the database to itself and SQLite answers "locked" at once, without waiting out
        the busy timeout, while another connection is opening it, so wait here."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as err:
                if "locked" not in str(err) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02 + 0.08 * random.random())

    def _migrate(self) -> None:
        """Schema 1 -> 2, inside ``_prepare``'s transaction, once ``_add_missing_columns`` has
        added the run columns: fill them in for the rows already there."""
        for row in self.db.execute("SELECT id, gpu, config FROM cells").fetchall():
            values = legacy_run_columns(dict(row))
            self.db.execute("UPDATE cells SET device = ?, precision = ?, channels_last = ?, compile = ? WHERE id = ?",
                            (values["device"], values["precision"], values["channels_last"], values["compile"], row["id"]))
        self.legacy = False

    def _add_missing_columns(self) -> None:
        """A store written before a column existed gets it, empty (NULL) in its old rows, so
        that it keeps opening and its cells keep counting as measured (the link columns of
        cells across emulated nodes came within schema 2), or at its default (``engine``:
        'torch' is right for every earlier cell). Only a column that is nullable or has a
        default can be added this way (SQLite's ADD COLUMN), which every later column is."""
        have = {row[1] for row in self.db.execute("PRAGMA table_info(cells)")}
        for name, sql, _ in COLUMNS:
            if name not in have:
                self.db.execute(f'ALTER TABLE cells ADD COLUMN "{name}" {sql}')

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def measured(self, cell_key: str) -> bool:
        """Whether the cell already has a successful run in the store."""
        row = self.db.execute("SELECT 1 FROM cells WHERE cell_key = ? AND status = 'ok'", (cell_key,)).fetchone()
        return row is not None

    def record(self, cell: Cell, hardware: Hardware, outcome: Outcome, suite: str, git_commit: str | None) -> None:
        """Store one cell's run in one transaction, replacing an earlier run of the same cell."""
        if outcome.status not in STATUSES:
            raise ValueError(f"status {outcome.status!r} is not one of {STATUSES}")
        row = {
            "cell_key": cell.key(hardware.hash), "baseline_key": cell.baseline_key(hardware.hash), "suite": suite,
            "engine": cell.engine,
            "model": cell.model, "dataset": cell.dataset, "strategy": cell.strategy, "workers": cell.workers,
            "batch_size": cell.batch_size,
            "microbatches": outcome.config.get("resolved", {}).get("microbatches", cell.microbatches), "lr": cell.lr, "repeat": cell.repeat,
            "synthetic": int(cell.synthetic), "warmup_steps": cell.warmup_steps, "steps": cell.steps,
            "epochs": cell.epochs, "limit_samples": cell.limit, "threads": cell.threads,
            "precision": cell.precision, "channels_last": int(cell.channels_last), "compile": int(cell.compile),
            "nodes": cell.nodes, "workers_per_node": cell.workers_per_node, "link_mbit": cell.link_mbit,
            "config": json.dumps({"cell": asdict(cell), "run": outcome.config}, sort_keys=True),
            "status": outcome.status, "reason": outcome.reason, **outcome.figures,
            "wall_seconds": outcome.wall_seconds, "load_average": outcome.load_average, "hardware_hash": hardware.hash, **asdict(hardware),
            "partrain_version": __version__, "git_commit": git_commit,
            "started_at": outcome.started_at, "finished_at": outcome.finished_at,
        }
        if isinstance(row.get("peak_memory_per_worker"), list):
            row["peak_memory_per_worker"] = json.dumps(row["peak_memory_per_worker"])
        unknown = set(row) - set(COLUMN_NAMES)
        if unknown:
            raise ValueError(f"not columns of the store: {sorted(unknown)}")
        names = ", ".join(f'"{n}"' for n in row)
        updates = ", ".join(f'"{n}" = excluded."{n}"' for n in row if n != "cell_key")
        with self.db:  # one transaction: the whole row or nothing
            self.db.execute(
                f"INSERT INTO cells ({names}) VALUES ({', '.join('?' * len(row))}) "
                f"ON CONFLICT(cell_key) DO UPDATE SET {updates}",
                list(row.values()),
            )

    def rows(self, cell_keys: list[str] | None = None) -> list[dict]:
        """Every row (or those of ``cell_keys``) in store order, with speedup and efficiency."""
        rows = [dict(r) for r in self.db.execute("SELECT * FROM cells ORDER BY id")]
        if self.legacy:  # a schema-1 store opened only to read: what its rows ran with, as migration would say
            rows = [{**row, **legacy_run_columns(row)} for row in rows]
        for r in rows:  # a store opened only to read, from before engines: the PyTorch engine's cells
            r.setdefault("engine", "torch")
        with_speedup(rows)
        if cell_keys is not None:
            wanted = set(cell_keys)
            rows = [r for r in rows if r["cell_key"] in wanted]
        return rows


def legacy_run_columns(row: dict) -> dict:
    """The run columns of a row stored before schema 2: fp32, eager, contiguous (the options
    did not exist), on the machine's GPU when it had one and the run's backend was not gloo
    (train picks NCCL, hence the GPU, whenever there is one), else on the CPU."""
    config = json.loads(row["config"]) if isinstance(row.get("config"), str) else row.get("config") or {}
    run = config.get("run", {})
    on_gpu = bool(row.get("gpu")) and run.get("backend") in (None, "nccl")
    return {"device": row["gpu"] if on_gpu else "cpu", "precision": run.get("precision", "fp32"),
            "channels_last": int(bool(run.get("channels_last", False))), "compile": int(bool(run.get("compile", False))),
            "gpu_memory_mib": row.get("gpu_memory_mib")}


def with_speedup(rows: list[dict]) -> list[dict]:
    """Add ``speedup`` and ``efficiency`` to each row, in place; returns ``rows``.

    speedup = median seconds per epoch of the ``ok`` serial rows with the same baseline key
    (same engine, model, dataset, global batch, lr, data, threads per worker, steps or epochs,
    and hardware), divided by the row's seconds per epoch; efficiency = speedup / workers. None
    when the row did not run or no matching serial row did.
    """
    serial: dict[str, list[float]] = {}
    for r in rows:
        if r["strategy"] == "serial" and r["status"] == "ok" and r["seconds_per_epoch"]:
            serial.setdefault(r["baseline_key"], []).append(r["seconds_per_epoch"])
    for r in rows:
        base = serial.get(r["baseline_key"])
        if r["status"] == "ok" and base and r["seconds_per_epoch"]:
            r["speedup"] = statistics.median(base) / r["seconds_per_epoch"]
            r["efficiency"] = r["speedup"] / r["workers"]
        else:
            r["speedup"] = r["efficiency"] = None
    return rows


def export_csv(rows: list[dict], out: IO[str]) -> None:
    """Every stored column plus speedup and efficiency; JSON columns stay JSON text."""
    writer = csv.DictWriter(out, fieldnames=COLUMN_NAMES + COMPUTED, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)


def export_json(rows: list[dict], out: IO[str]) -> None:
    """A JSON array of rows: every stored column plus speedup and efficiency, JSON columns decoded."""
    decoded = [{k: (json.loads(v) if k in _JSON_COLUMNS and v is not None else v) for k, v in r.items()} for r in rows]
    json.dump(decoded, out, indent=1)
    out.write("\n")
