"""The scratch engine under mpirun: the processes mode talks over mpi4py and still
reproduces serial's per-step losses. Skipped where mpirun or mpi4py is absent (CI has
neither; ``apt-get install openmpi-bin libopenmpi-dev && pip install mpi4py`` adds them)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from partrain.scratch import ScratchConfig, run

pytestmark = [pytest.mark.skipif(shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
                                 reason="needs mpirun and mpi4py"), pytest.mark.multiproc]
STEPS = 6


def mpirun(n: int, *train_args: str) -> subprocess.CompletedProcess:
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = ["mpirun", *root, "--oversubscribe", "-n", str(n), sys.executable, "-m", "partrain", "train",
           "--engine", "scratch", *train_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def args(data_dir, strategy: str) -> list[str]:
    return ["--strategy", strategy, "--workers", "2", "--dtype", "float64", "--steps", str(STEPS),
            "--limit", str(STEPS * 64), "--eval-limit", "300", "--data-dir", str(data_dir), "--json"]


@pytest.mark.parametrize("strategy", ["ddp", "model-parallel"])
def test_under_mpirun_the_processes_talk_mpi_and_reproduce_serial(data_dir, strategy):
    serial = run(ScratchConfig(dtype="float64", steps=STEPS, limit=STEPS * 64, eval_limit=300, data_dir=str(data_dir)))
    done = mpirun(2, *args(data_dir, strategy))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 prints the run, rank 1 nothing
    result = json.loads(lines[0])
    assert result["backend"] == "mpi" and result["processes"] == 2
    np.testing.assert_allclose(result["step_losses"], serial.step_losses, rtol=0, atol=1e-6)
    assert result["epochs"][-1]["test_accuracy"] == serial.test_accuracy


def test_mpirun_with_another_process_count_is_one_line(data_dir):
    done = mpirun(3, *args(data_dir, "ddp"))
    assert done.returncode != 0
    assert "partrain: error: mpirun started 3 processes and this run needs 2: use mpirun -n 2" in done.stderr
    assert "Traceback" not in done.stderr
