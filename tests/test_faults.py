"""Faults end cleanly (issue 19, items 2 and 4): a kill while checkpoints are written leaves a
set that resumes exactly; the launcher's death takes its workers with it; Ctrl-C and SIGTERM
print one line and exit 130; a stopped worker is the rank named."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

PARTRAIN = str(Path(sys.executable).with_name("partrain"))
DDP = ["train", "--model", "mlp", "--strategy", "ddp", "--workers", "2", "--threads", "1", "--limit", "640",
       "--batch-size", "64", "--eval-limit", "64", "--timeout", "20", "--quiet"]


def _start(args: list[str], data_dir: Path, tmp_path: Path, start_method: str | None = None) -> subprocess.Popen:
    """A ``partrain`` command in a session of its own (as a terminal's job), its temp dir private,
    with Ctrl-C's default disposition as a terminal gives it: a shell without job control
    starts its background jobs with SIGINT ignored, and Python then installs no handler for it
    (the suite run as ``make test &`` from a script would otherwise see no interrupt at all)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    env = {**os.environ, "PARTRAIN_DATA_DIR": str(data_dir), "TMPDIR": str(scratch)}
    if start_method:  # the suite's is the fork server (tests/conftest.py)
        env["PARTRAIN_START_METHOD"] = start_method
    return subprocess.Popen([PARTRAIN, *args], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError):
                pass
    return out


def _workers(launcher: int, n: int, timeout: float = 120) -> list[int]:
    """The launcher's ``n`` worker processes, once all have started: its spawned children, or its fork server's."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = []
        for k in _children(launcher):
            command = Path(f"/proc/{k}/cmdline").read_text(errors="ignore")
            if "forkserver" in command:
                kids += _children(k)
            elif "multiprocessing" in command and "resource_tracker" not in command:
                kids.append(k)
        if len(kids) >= n:
            return kids
        time.sleep(0.05)
    raise AssertionError("the workers never started")


def _handles_sigint(pid: int, timeout: float = 30) -> None:
    """Wait until ``pid`` no longer ignores SIGINT: the launcher ignores it while it starts the
    workers (who inherit that), and a Ctrl-C in that window would be lost, not tested."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        ignored = int(next(line for line in status if line.startswith("SigIgn:")).split()[1], 16)
        if not ignored & (1 << (signal.SIGINT - 1)):
            return
        time.sleep(0.01)
    raise AssertionError("the launcher kept ignoring SIGINT")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _json_run(args, data_dir, tmp_path) -> dict:
    proc = _start([*args, "--json"], data_dir, tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out)


def test_a_kill_while_checkpointing_leaves_a_set_that_resumes_exactly(data_dir, tmp_path):
    """SIGKILL the whole job at several moments of a run that checkpoints every epoch; each
    resume must finish with the per-step losses of the run that was never stopped."""
    run = [*DDP, "--epochs", "6"]
    straight = _json_run(run, data_dir, tmp_path)["step_losses"]
    for delay in (2.0, 3.5, 5.0):
        ckpt = tmp_path / f"ckpt{delay}"
        proc = _start([*run, "--checkpoint", str(ckpt)], data_dir, tmp_path)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGKILL)  # launcher and workers at once, wherever they are
        proc.wait()
        if not (ckpt / "LATEST").exists():
            continue  # killed before the first set was whole: nothing to resume, nothing torn
        resumed = _json_run([*run, "--resume", str(ckpt), "--checkpoint", str(ckpt)], data_dir, tmp_path)
        assert resumed["step_losses"] == straight


@pytest.fixture(scope="module")
def ten_steps(data_dir, tmp_path_factory) -> Path:
    """One checkpointed 10-step DDP run that the resume tests below share (each copies it)."""
    where = tmp_path_factory.mktemp("ten_steps")
    _json_run([*DDP, "--steps", "10", "--checkpoint", str(where / "ckpt")], data_dir, where)
    return where / "ckpt"


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    shutil.copytree(ckpt, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_resume_refuses_an_incomplete_set_before_any_worker_starts(data_dir, tmp_path, ten_steps):
    ckpt = _copy(ten_steps, tmp_path)
    newest = ckpt / (ckpt / "LATEST").read_text()
    (newest / "rank1.pt").unlink()
    proc = _start([*DDP, "--resume", str(ckpt)], data_dir, tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip() == f"partrain: error: checkpoint {newest} lacks rank 1's file: the set is incomplete; " \
                          "resume from another checkpoint or start afresh"


def test_resume_applies_a_new_learning_rate_and_says_so(data_dir, tmp_path, ten_steps):
    ckpt = _copy(ten_steps, tmp_path)
    same = _json_run([*DDP, "--epochs", "2", "--resume", str(ckpt)], data_dir, tmp_path)["step_losses"]
    proc = _start([*DDP, "--epochs", "2", "--resume", str(ckpt), "--lr", "0.05", "--json"], data_dir, tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "resuming with lr 0.01 -> 0.05" in err
    faster = json.loads(out)["step_losses"]
    assert faster[:10] == same[:10] and faster[10:] != same[10:]


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_the_launchers_death_takes_its_workers_with_it(data_dir, tmp_path, start_method):
    """Spawned, the workers are the launcher's children; forked, its fork server's, which leaves with it."""
    proc = _start([*DDP, "--epochs", "200"], data_dir, tmp_path, start_method)
    workers = _workers(proc.pid, 2)
    os.kill(proc.pid, signal.SIGKILL)  # the launcher alone
    proc.wait()
    # a worker still importing torch sets its parent-death signal only after the import, then sees
    # its parent gone and exits: on a loaded machine that import took over 10 s (clean-clone CI)
    deadline = time.monotonic() + 45
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(w) for w in workers)


@pytest.mark.parametrize("sig, after_s, start_method", [(signal.SIGINT, 0.2, "spawn"), (signal.SIGINT, 0.2, None),
                                                      (signal.SIGINT, 3.0, None), (signal.SIGTERM, 1.0, None)])
def test_interrupting_a_two_worker_run_is_one_line_and_status_130(sig, after_s, start_method, data_dir, tmp_path):
    """At 0.2 s the workers are still importing torch (spawned) or starting; at 3 s they are training."""
    proc = _start([*DDP, "--epochs", "200"], data_dir, tmp_path, start_method)
    workers = _workers(proc.pid, 2)
    _handles_sigint(proc.pid)
    time.sleep(after_s)
    os.killpg(proc.pid, sig) if sig == signal.SIGINT else os.kill(proc.pid, sig)  # Ctrl-C reaches the whole job
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.strip() == "partrain: interrupted"
    time.sleep(0.5)
    assert not any(_alive(w) for w in workers)
    assert not [p for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("torchinductor_")]


def test_a_stopped_worker_is_the_rank_named(data_dir, tmp_path):
    proc = _start([*DDP, "--epochs", "200", "--timeout", "5"], data_dir, tmp_path)
    workers = sorted(_workers(proc.pid, 2))  # spawned in rank order, so pids ascend with rank
    time.sleep(1.5)
    os.kill(workers[1], signal.SIGSTOP)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1].startswith("partrain: error: worker rank 1 stopped responding")


def test_interrupting_a_scratch_run_stops_its_workers_at_once(data_dir, tmp_path):
    """The scratch engine's workers are spawned as train's are: SIGTERM stops them now (they
    trained on to the end of the run, 33 s, before)."""
    proc = _start(["train", "--engine", "scratch", "--strategy", "ddp", "--workers", "2", "--epochs", "50",
                   "--batch-size", "16"], data_dir, tmp_path)
    workers = _workers(proc.pid, 2)
    time.sleep(3.0)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and err.strip() == "partrain: interrupted"
    time.sleep(0.5)
    assert not any(_alive(w) for w in workers)
    assert not [p for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("torchinductor_")]


def test_a_worker_that_waits_too_long_says_so_without_blaming_itself(data_dir, monkeypatch, capsys):
    """Rank 1's model sleeps in a step; rank 0 times out in the allreduce. Before, rank 0 was
    named as failed, with its traceback; now one line says it waited, exit status 1."""
    from partrain.cli import main

    monkeypatch.setenv("PARTRAIN_DATA_DIR", str(data_dir))
    # --timeout is the group's: it also bounds the ranks' meeting, which a loaded machine can
    # delay by seconds (two workers importing torch at once), so it is well above that
    argv = ["train", "--model", "tests.userfactory:slow_rank1", "--strategy", "ddp", "--workers", "2", "--threads", "1",
            "--limit", "640", "--batch-size", "64", "--no-eval", "--timeout", "15", "--quiet"]
    started = time.monotonic()
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("partrain: error: worker rank 0 waited longer than --timeout 15 s for another worker")
    assert time.monotonic() - started < 150  # the sleeper (300 s) was stopped, not waited for


def test_two_bench_runs_on_one_store_lose_nothing_and_store_each_cell_once(data_dir, tmp_path):
    import sqlite3

    suite = tmp_path / "s.toml"
    suite.write_text('models = ["mlp"]\ndatasets = ["mnist"]\nstrategies = ["serial", "ddp"]\nworkers = [1, 2]\n'
                     "batch_sizes = [32]\nwarmup_steps = 1\nsteps = 2\nlimit = 512\nthreads = 1\n")
    store = tmp_path / "s.sqlite"
    runs = [_start(["bench", str(suite), "--store", str(store)], data_dir, tmp_path) for _ in range(2)]
    for run in runs:
        _, err = run.communicate(timeout=600)
        assert run.returncode == 0, err
    with sqlite3.connect(store) as db:
        rows = db.execute("SELECT strategy, workers, batch_size, status FROM cells").fetchall()
    # serial x1, ddp x1, ddp x2 (serial x2 is stored as skipped): 4 cells, each once. Both runs
    # start at once on the same first cell, so 4 cells already make them contend (8 cost 15 s more)
    assert len(rows) == len(set(rows)) == 4
    assert sorted(r[3] for r in rows).count("ok") == 3


def test_a_full_disk_while_checkpointing_is_one_line_and_leaves_nothing(data_dir, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        proc = _start(["train", "--model", "mlp", "--steps", "3", "--limit", "256", "--eval-limit", "32", "--quiet",
                       "--checkpoint", str(disk / "ck")], data_dir, tmp_path)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2
        assert err.strip().startswith("partrain: error: cannot write checkpoint ")
        assert "the disk is full" in err and len(err.strip().splitlines()) == 1
        assert not [p for p in (disk / "ck").rglob("*") if p.is_file()]  # no torn file, no .tmp
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
