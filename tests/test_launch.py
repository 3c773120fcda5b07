"""Launcher detection: each launcher's environment gives the same LaunchInfo fields."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from partrain.distributed.launch import (
    LaunchInfo,
    detect_launcher,
    first_slurm_host,
    free_port,
    peer_left,
)
from partrain.distributed.spawn import _state, spawn
from partrain.errors import PartrainError

REPO = Path(__file__).resolve().parents[1]


def test_run_directly():
    assert detect_launcher({}) == LaunchInfo("none")


def test_torchrun():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    assert detect_launcher(env) == LaunchInfo("torchrun", 3, 4, 1, 2, "10.0.0.1", 29400)


def test_open_mpi_and_mpich():
    ompi = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert detect_launcher(ompi) == LaunchInfo("mpirun", 5, 8, 1, 4, "127.0.0.1", 29500)
    pmi = {"PMI_RANK": "2", "PMI_SIZE": "3", "MASTER_ADDR": "node1"}
    assert detect_launcher(pmi) == LaunchInfo("mpirun", 2, 3, 0, 3, "node1", 29500)


def test_slurm_srun():
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NNODES": "2", "SLURM_NODELIST": "gpu[07-08]"}
    assert detect_launcher(env) == LaunchInfo("slurm", 6, 8, 2, 4, "gpu07", 29500)
    assert detect_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).launcher == "none"  # an allocation, not a launch


@pytest.mark.parametrize("nodelist,first", [("node[03-05,09],gpu1", "node03"), ("a1,a2", "a1"), ("solo", "solo"), ("n[1,4]", "n1")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_bad_variable_is_a_clear_error():
    with pytest.raises(PartrainError, match="RANK='x' is not an integer"):
        detect_launcher({"RANK": "x", "WORLD_SIZE": "2"})


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


_LEAVE = """
import atexit, sys
from partrain.distributed.spawn import leave_at_once
atexit.register(lambda: print("torn down"))
sys.stdout.write("said")  # no newline: still in the buffer
sys.stderr.write("warned")
leave_at_once(3)
print("never")
"""


def test_leave_at_once_flushes_what_was_said_and_skips_the_teardown():
    from partrain.distributed.spawn import child_env, python_command

    done = subprocess.run([*python_command(), "-c", _LEAVE], capture_output=True, text=True, env=child_env(), timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "said", "warned")


_FREE_AND_MEASURE = """
import re, sys, torch
from partrain.distributed.launch import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
rss = lambda: int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
blocks = [torch.ones(2**20) for _ in range(64)]  # 64 x 4 MB, each past glibc's default mmap threshold
held = rss()
del blocks
print(kept, held - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_keep_freed_memory_keeps_pages_a_step_frees():
    """Freed activations stay in the process (the next step reuses them without faulting pages
    in); glibc's default hands them back to the OS at once."""
    def freed_bytes(mode: str) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", _FREE_AND_MEASURE, mode], capture_output=True, text=True, check=True)
        kept, freed = out.stdout.split()
        return kept, int(freed)

    kept, returned = freed_bytes("keep")
    assert kept == "True"
    assert returned < 16 * 2**20  # at most a few MB of 256 MB went back
    assert freed_bytes("default")[1] > 200 * 2**20  # the default returns nearly all of it


def test_a_connection_a_peer_closed_is_told_apart_from_other_errors():
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:14559. This is ...")
    assert peer_left(gloo) == "Connection closed by peer"
    try:  # the pipelining stage raises its own error from the backend's
        raise RuntimeError("[Stage 1] failed to run forward") from gloo
    except RuntimeError as wrapped:
        assert peer_left(wrapped) == "Connection closed by peer"
    assert peer_left(RuntimeError("Read error [10.0.0.2]:5000: Connection reset by peer")) == "Connection reset by peer"
    assert peer_left(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert peer_left(ValueError("Expected more than 1 value per channel")) is None
    assert peer_left(BrokenPipeError(32, "Broken pipe")) is None  # `partrain train | head`: stdout's reader left


_WAITS_FOR_A_PEER = """
import os, sys, time
import torch.distributed as dist
from partrain.distributed.launch import detect_launcher, init_process_group
info = detect_launcher()
init_process_group(info, "gloo", timeout_s=600)
open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
if info.rank == 0:
    dist.barrier()  # rank 1 never comes: blocked in gloo, where no Python signal handler runs
time.sleep(600)
"""


def test_torchruns_workers_die_with_it_when_it_is_killed_outright(tmp_path):
    """torchrun starts each worker in a session of its own, so killing torchrun's process group
    (what a timed-out benchmark cell gets) misses them: they must die with their launcher."""
    import os
    import signal
    import time

    script = tmp_path / "worker.py"
    script.write_text(_WAITS_FOR_A_PEER)
    pids = tmp_path / "pids"
    pids.mkdir()
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--master-port", str(free_port()), str(script), str(pids)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.2)
            workers = [int(p.name) for p in pids.iterdir()]
        assert len(workers) == 2, "the workers did not start"
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while (alive := [p for p in workers if _running(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, f"workers {alive} outlived their launcher"
    finally:
        for pid in workers:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (the kernel's state, as ``spawn`` reads it)."""
    return _state(pid) not in ("", "Z")


def _leaves_then_says_why(delay_s: float) -> None:
    """Rank 0 found bad input and leaves, but says so only ``delay_s`` later (its process group
    goes first); rank 1, cut off by that, fails at once on the closed connection."""
    import time

    if os.environ["RANK"] == "0":
        time.sleep(delay_s)
        raise PartrainError("the bad input rank 0 found")
    raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:12345")


def test_the_rank_that_left_is_named_not_the_peer_its_leaving_cut_off():
    # a launcher of its own, whose workers write to its stderr
    code = ("from partrain.distributed.spawn import spawn\nfrom tests.test_launch import _leaves_then_says_why\n"
            "try:\n    spawn(_leaves_then_says_why, (1.0,), 2)\nexcept Exception as err:\n    print('raised:', err)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    # not "worker rank 1 failed (RuntimeError: ...)", and no casualty's traceback burying the line
    assert proc.stdout == "raised: the bad input rank 0 found\n", proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def _what_a_worker_sees(burn_s: float) -> tuple[str | None, str, int]:
    deadline = time.process_time() + burn_s
    while time.process_time() < deadline:  # CPU its launcher is to count as its own
        pass
    return os.environ.get("PARTRAIN_TEST_SEEN"), os.getcwd(), os.getppid()


@pytest.mark.multiproc
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_workers_see_the_launchers_environment_and_directory_now_and_count_as_its_cpu(tmp_path, monkeypatch,
                                                                                       start_method):
    """Forked, workers come from a server that started with the first run: each sees the
    environment and working directory its launcher has when it starts them (not the server's from
    then), as spawned ones do, and their CPU counts as the launcher's own, as a profile's measure
    of other processes' load needs."""
    from partrain.profile.timing import cpu_seconds

    monkeypatch.setenv("PARTRAIN_START_METHOD", start_method)
    first = spawn(_what_a_worker_sees, (0.0,), 2)
    monkeypatch.setenv("PARTRAIN_TEST_SEEN", "after")
    monkeypatch.chdir(tmp_path)
    before = cpu_seconds()[1]
    later = spawn(_what_a_worker_sees, (0.5,), 2)
    assert cpu_seconds()[1] - before >= 2 * 0.5 * 0.9  # clock ticks: 10 ms each
    assert [seen for seen, _, _ in later.values()] == ["after", "after"]
    assert all(cwd == str(tmp_path) for _, cwd, _ in later.values())
    parents = {parent for _, _, parent in first.values()} | {parent for _, _, parent in later.values()}
    if start_method == "spawn":
        assert parents == {os.getpid()}
    else:  # one server for both runs, not this process
        assert len(parents) == 1 and parents != {os.getpid()}


def test_an_unknown_start_method_is_one_line(monkeypatch):
    monkeypatch.setenv("PARTRAIN_START_METHOD", "fork")
    with pytest.raises(PartrainError, match="PARTRAIN_START_METHOD=fork: use spawn or forkserver"):
        spawn(_what_a_worker_sees, (0.0,), 2)
