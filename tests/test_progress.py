"""Messages on long work: the suite runner's per-cell lines in a log, and stdout keeping its
place among stderr when both go to one file."""

from __future__ import annotations

import os
import subprocess
import sys

from partrain.bench.runner import CellProgress
from partrain.bench.store import Outcome
from partrain.bench.suite import Cell


def test_cell_progress_in_a_log_names_the_cell_the_count_left_and_an_eta(capsys):
    """The ETA is the cells' own mean seconds times the cells left, whatever else took the
    time between them (a model's or a link's profile, taken once before its first cell)."""
    cells = [Cell("mlp", "mnist", "serial", 1, 64, None, 0.01), Cell("mlp", "mnist", "ddp", 2, 64, None, 0.01),
             Cell("cnn", "mnist", "ddp", 2, 64, None, 0.01), Cell("cnn", "mnist", "serial", 1, 64, None, 0.01)]
    with CellProgress(len(cells), True) as progress:
        for cell, seconds in zip(cells, (10.0, 30.0, 5.0, 5.0)):
            progress.begin(cell)
            progress.end(cell, Outcome("skipped", "not here"), seconds)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[")]
    assert lines[0] == "[1/4, 3 left after it] mlp/mnist serial x1 b64 lr0.01"
    assert lines[1] == "[2/4, 2 left after it, ETA 30 s] mlp/mnist ddp x2 b64 lr0.01"  # 10 s a cell, 3 left
    assert lines[2] == "[3/4, 1 left after it, ETA 40 s] cnn/mnist ddp x2 b64 lr0.01"  # 20 s a cell, 2 left
    assert lines[3] == "[4/4, 0 left after it, ETA 15 s] cnn/mnist serial x1 b64 lr0.01"
    assert "skipped  cnn/mnist ddp x2" in err and "4 cells: 4 skipped" in err


def test_cells_measured_before_leave_the_count_and_the_eta(capsys):
    """A resumed suite: two cells measured before, then two to run. The count and the ETA are
    over the cells that run (the ETA read 0 s, the measured cells counted as instant)."""
    cells = [Cell("mlp", "mnist", "serial", 1, b, None, 0.01) for b in (16, 32, 64, 128)]
    with CellProgress(len(cells), True) as progress:
        for i, cell in enumerate(cells):
            if i < 2:
                progress.end(cell, None)
                continue
            progress.begin(cell)
            progress.end(cell, Outcome("skipped", "not here"))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[")]
    assert lines == ["[1/2, 1 left after it] mlp/mnist serial x1 b64 lr0.01", lines[1]]
    assert lines[1].startswith("[2/2, 0 left after it, ETA ")
    assert err.count("measured before") == 2 and "4 cells: 2 measured, 2 skipped" in err


def test_stdout_keeps_its_order_among_stderr_in_one_file(data_dir, tmp_path):
    """train --trace prints the run's summary (stdout), then what it wrote (stderr): in that
    order also when both are one file, where stdout would otherwise be held in a block buffer."""
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as a user's shell has it
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, "-m", "partrain", "train", "--model", "mlp", "--steps", "3", "--limit", "640",
                               "--no-eval", "--threads", "1", "--data-dir", str(data_dir), "--quiet",
                               "--trace", str(tmp_path / "t.json"), "--no-predicted"],
                              stdout=out, stderr=subprocess.STDOUT, env=env, timeout=300)
    text = log.read_text()
    assert proc.returncode == 0, text
    assert 0 <= text.index("mlp on mnist, serial x1") < text.index(f"wrote {tmp_path / 't.json'}")
