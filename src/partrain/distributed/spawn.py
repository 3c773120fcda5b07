"""Starting local workers when no launcher did: ``torch.multiprocessing``, a private rendezvous.

Run directly with ``--workers N``, partrain starts N worker processes on this machine with
``torch.multiprocessing`` (the ``spawn`` start method: fresh interpreters, no inherited
threads). ``PARTRAIN_START_METHOD=forkserver`` forks them instead from one fresh,
single-threaded server per launcher that imported torch once: each worker starts in ~0.02 s
where importing torch took 1-2 s on the 2-vCPU VM (the test suite runs so, ``tests/conftest.py``).
Not the default, because a forked worker's resident set counts the shared libraries' pages only
as it touches them: its peak read 351 MB where a spawned one, or one torchrun started, read
410-415 MB (the mlp on MNIST, session 102), and the memory predictions' baseline is a fresh
process's. Either way each worker gets the launcher's environment and working directory as
they are when it starts.

They find each other through a ``FileStore`` in a private directory (mode 0700,
removed afterwards), not a TCP store: a TCP store listens on every interface, has no
authentication, and PyTorch's elastic agent unpickles what is in it, so any process that can
reach the port can run code as the training user. Gloo (or NCCL) binds its own connections to
the loopback interface. A local run therefore opens no socket reachable from outside the
machine and reads nothing another user can write; the fork server listens on a Unix socket
that only this user can open (mode 0600, in a directory of mode 0700, as ``multiprocessing``
makes it).

Failure handling, as the elastic agent gave it and more:

- a worker that raises or dies ends the run: the others are stopped, and the error names
  the rank (a ``PartrainError`` found by a worker comes back as that one line);
- a worker stopped by a signal (SIGSTOP) while its peers time out waiting for it is the
  rank named, not the peer whose collective timed out;
- workers die with the launcher (``PR_SET_PDEATHSIG``, with the fork server, which leaves
  with the launcher), so a ``kill -9`` of ``partrain`` orphans nothing; Ctrl-C reaches the launcher alone, which stops the workers (each worker
  runs in a session of its own, as torchrun's do: ``_worker`` says what that is worth);
- nothing is left in ``$TMPDIR``.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import forkserver
from pathlib import Path

import torch.multiprocessing as mp

from partrain.errors import DEBUG_ENV, PartrainError

RENDEZVOUS_ENV = "PARTRAIN_RENDEZVOUS_FILE"  # a worker started here reads its FileStore path from it
_PR_SET_PDEATHSIG = 1  # linux/prctl.h

START_METHOD_ENV = "PARTRAIN_START_METHOD"  # "spawn" (the default) or "forkserver"
_PRELOAD = ["torch", "torch.distributed", "partrain.train", "partrain.distributed.launch"]  # the fork server's imports


def start_method() -> str:
    """How ``spawn`` starts workers: ``$PARTRAIN_START_METHOD``, checked, or "spawn"."""
    method = os.environ.get(START_METHOD_ENV) or "spawn"
    if method not in ("spawn", "forkserver") or method not in mp.get_all_start_methods():
        raise PartrainError(f"{START_METHOD_ENV}={method}: use spawn or forkserver (where this platform has it)")
    return method


# More local workers than this many per core cannot help and only exhausts the machine
# (`--workers 1000` forks until memory runs out; `--threads 100000` crashes the OpenMP runtime).
MAX_PER_CORE = 4


def check_local_workers(workers: int, more: str) -> None:
    """Refuse to start more local workers than this machine can run; ``more`` says where more go."""
    cores = os.cpu_count() or 1
    if workers > MAX_PER_CORE * cores:
        raise PartrainError(f"--workers {workers} on a machine with {cores} cores: at most {MAX_PER_CORE * cores} "
                            f"local workers; {more}")


class WorkerFailed(PartrainError):
    """A worker process died or raised; names the rank."""

    exit_status = 1


def private_dir(prefix: str = "partrain-") -> Path:
    """A fresh directory only this user can enter (``mkdtemp`` makes it 0700)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def loopback_interface() -> str:
    """The name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), "lo")


def local_network_env() -> dict[str, str]:
    """Environment that binds a local job's gloo and NCCL sockets to loopback (the user's
    own settings win)."""
    lo = loopback_interface()
    return {name: os.environ.get(name, lo) for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}


try:  # looked up once, here: a child between fork and exec may call it without loading anything
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; elsewhere a
    no-op, and the parent's own clean-up is what remains)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, sig)


def child_env() -> dict[str, str]:
    """The environment for a Python child: this process's import path made explicit (a user's
    model package stays importable) and nothing implicit added to it (see ``python_command``)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "PYTHONSAFEPATH": "1"}


def python_command() -> list[str]:
    """This interpreter, with the working directory kept off the import path (``-P``): a child
    started as ``python -m partrain`` or ``python -c ...`` in a directory holding a ``numpy.py``
    would otherwise import that file instead of NumPy."""
    return [sys.executable, "-P"]


def leave_at_once(status: int = 0) -> None:
    """End this child process now, its output flushed, without the interpreter's teardown: with
    torch and the training machinery imported, freeing every module's objects takes 0.6 s on
    the 2-vCPU VM (session 95), wall time of the profile that waits on the child's exit. For
    a probe's child whose work is done and said: no file of its own is left half-written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # there, but not ours
        return True
    return True


def _worker(index: int, entrypoint: Callable, args: tuple, nprocs: int, run_dir: str, launcher_pid: int,
            env: dict[str, str]) -> None:
    """One worker: set its place in the job, run ``entrypoint``, leave the result or the error in ``run_dir``."""
    # a forked worker's parent is the fork server, which leaves as soon as the launcher does (the
    # launcher holds the other end of its pipe): dying with it is dying with the launcher
    die_with_parent(signal.SIGKILL)
    if not alive(launcher_pid):  # the launcher died before that took effect
        os._exit(1)
    os.environ.clear()  # the launcher's environment now, not the fork server's when it started
    os.environ.update(env)
    # a forked worker holds the write end of the pipe the fork server waits on to leave (so that it
    # outlives its clients): left open, a launcher killed with -9 would leave the server, and so
    # its workers, running
    alive_fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive_fd is not None:  # None in a spawned worker
        os.close(alive_fd)
        forkserver._forkserver._forkserver_alive_fd = None
    # a session of its own, as torchrun starts each worker: where the kernel groups the CPU by
    # session (CONFIG_SCHED_AUTOGROUP, on by default in desktop and cloud kernels) workers of one
    # session shared one group's turn at the cores. On the 2-vCPU VM a 4-stage 1F1B over 4 such
    # workers (the gallery's tokens3d, batch 32, 8 micro-batches) stepped in 28.7-28.8 ms, and in
    # 22.6-23.9 with a session each (session 98, torch.multiprocessing workers either way); under
    # torchrun, 23.0-24.6. The worker still dies with the launcher (above), and a group signal to
    # the launcher's session (a bench cell's stop) reaches the launcher, which stops the workers
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs))
    os.environ[RENDEZVOUS_ENV] = os.path.join(run_dir, "store")
    out = Path(run_dir)
    try:
        result = entrypoint(*args)
    except PartrainError as err:  # bad input found by a worker: one line, exit status 2
        if os.environ.get(DEBUG_ENV) and err.__cause__ is not None:  # `partrain --debug`: what lies behind it
            traceback.print_exception(err.__cause__, file=sys.stderr)
        _report(out, index, user=True, message=str(err), status=err.exit_status)
        sys.exit(err.exit_status)
    except BaseException as err:  # a crash keeps its traceback, on this worker's stderr
        from partrain.distributed.launch import peer_left

        casualty = peer_left(err) is not None
        if casualty:  # a peer closed its connections as it left (its group goes before its report is written)
            _await_a_peer_report(out, index)
        if not _user_error_from_a_peer(out):  # not when a peer found bad input and quit, cutting this one off
            print(f"partrain: worker rank {index} crashed:\n{traceback.format_exc()}", file=sys.stderr)
        last = (traceback.format_exception_only(type(err), err) or [type(err).__name__])[-1].strip()
        _report(out, index, user=False, message=last, casualty=casualty)
        sys.exit(1)
    tmp = out / f"result{index}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(result, f)  # read back only by our launcher, from a directory only we can enter
    tmp.rename(out / f"result{index}.pkl")


def _report(run_dir: Path, rank: int, user: bool, message: str, status: int = 1, casualty: bool = False) -> None:
    """Leave this worker's error for the launcher and its peers, whole or not at all. A
    ``casualty`` failed only because a peer's connection closed: the peer is the cause."""
    tmp = run_dir / f"error{rank}.tmp"
    tmp.write_text(json.dumps({"user": user, "message": message, "status": status, "casualty": casualty}))
    tmp.rename(run_dir / f"error{rank}.json")


# how long a worker cut off by a peer, and the launcher that sees only that worker fail, wait
# for the peer's own report: the peer leaves its process group (closing the connections) a
# moment before it writes why it left, and that moment can be long on a loaded machine
PEER_REPORT_GRACE_S = 5.0


def _await_a_peer_report(run_dir: Path, rank: int, grace_s: float = PEER_REPORT_GRACE_S) -> None:
    """Wait until another rank has reported its error, or ``grace_s`` has passed."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not [p for p in run_dir.glob("error*.json") if p.name != f"error{rank}.json"]:
        time.sleep(0.02)


def _is_casualty(run_dir: Path, rank: int) -> bool:
    """Whether ``rank`` reported that it failed only because a peer's connection closed."""
    report = run_dir / f"error{rank}.json"
    return report.exists() and _read_report(report).get("casualty", False)


def _read_report(path: Path) -> dict:
    """A worker's error as ``_report`` left it: {"user": bad input or not, "message": its line}."""
    return json.loads(path.read_text())


def _user_error_from_a_peer(run_dir: Path) -> bool:
    """Whether a worker has reported bad input (a ``PartrainError``): its peers then fail only
    because it left, and their tracebacks (``Connection closed by peer``) would bury its line."""
    return any(_read_report(report)["user"] for report in run_dir.glob("error*.json"))


def _stat(pid: int) -> list[str]:
    """Process ``pid``'s /proc stat fields from its state on (field 3 of proc(5)); [] if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _state(pid: int) -> str:
    """The kernel's one-letter process state ('T' = stopped), '' if it is gone."""
    return (_stat(pid) or [""])[0]


def spawn(entrypoint: Callable, args: tuple, nprocs: int, poll_s: float = 0.1) -> dict[int, object]:
    """Run ``entrypoint(*args)`` in ``nprocs`` local workers; returns {rank: return value}.

    ``entrypoint`` must be a module-level function (workers are spawned, so it is pickled).
    In a worker, ``distributed.launch.detect_launcher`` reads the worker's rank and its
    rendezvous file from the environment.
    """
    method = start_method()
    run_dir = private_dir()
    # the working directory stays off the children's import path (a planted numpy.py there never
    # runs); workers set their own thread count
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           **local_network_env()}
    saved = {k: os.environ.get(k) for k in ("PYTHONSAFEPATH", "OMP_NUM_THREADS")}
    # what the workers, or the fork server if this call starts it, start with: off the import path
    # as above; the server with one thread (NumPy's BLAS would start a pool of threads as torch
    # imports it, and a process forked with threads running may inherit a lock one of them held)
    os.environ.update(PYTHONSAFEPATH="1", OMP_NUM_THREADS="1" if method == "forkserver" else env["OMP_NUM_THREADS"])
    if method == "forkserver":
        mp.set_forkserver_preload(_PRELOAD)  # read once, when the server starts
    context = None
    # Ctrl-C is the launcher's: workers start with SIGINT ignored, so a Ctrl-C while they start
    # prints nothing from them. A disposition inherited as ignored through exec is one Python
    # keeps: spawned workers are started (exec'd) with it ignored, or the fork server is, and every
    # worker forked from it starts so; the launcher ignores it only for that moment (not while the
    # server imports torch, seconds the first time: a Ctrl-C then is the launcher's to handle)
    ignore = threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignore else None
    try:
        try:
            if method == "forkserver":
                forkserver.ensure_running()
            else:  # spawned interpreters inherit it the same way, when they start
                context = _start(method, entrypoint, args, nprocs, run_dir, env)
        finally:
            if ignore:
                signal.signal(signal.SIGINT, handler)
            _restore(saved)  # the workers (or their server) have their environment; this process gets its own back
        context = context or _start(method, entrypoint, args, nprocs, run_dir, env)
        pids = [p.pid for p in context.processes]
        casualty_since = None
        while True:
            codes = [p.exitcode for p in context.processes]
            if all(code == 0 for code in codes):
                break
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            # a rank killed by a signal is the cause, a peer that then lost its connection the casualty:
            # both may have exited by this poll, and the error names the cause
            # next, a rank that reported bad input: a peer it left then failed on a closed connection
            failed.sort(key=lambda rank: (codes[rank] >= 0, codes[rank] != PartrainError.exit_status,
                                          _is_casualty(run_dir, rank)))
            if failed and _is_casualty(run_dir, failed[0]) and None in codes:
                # only casualties have exited: the peer that left is still on its way out, with its reason
                casualty_since = casualty_since or time.monotonic()
                if time.monotonic() - casualty_since < PEER_REPORT_GRACE_S:
                    time.sleep(poll_s)
                    continue
            if failed:
                stopped = [rank for rank, pid in enumerate(pids) if _state(pid) == "T"]
                raise _failure(run_dir, failed[0], codes[failed[0]], stopped)
            time.sleep(poll_s)
        results = {}
        for rank in range(nprocs):
            with open(run_dir / f"result{rank}.pkl", "rb") as f:
                results[rank] = pickle.load(f)
        return results
    finally:
        if context is not None:
            _stop(context.processes)
        shutil.rmtree(run_dir, ignore_errors=True)


def fork_server_cpu_s() -> float:
    """CPU seconds of this process's fork server, if it started one, and of the workers it forked
    and has reaped (every worker of a finished ``spawn``): this process's own work, though not
    counted with its children's."""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    fields = _stat(pid) if pid else []
    # utime, stime, cutime, cstime: fields 14-17 of proc(5), counted from the state (field 3)
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _start(method: str, entrypoint: Callable, args: tuple, nprocs: int, run_dir: Path, env: dict[str, str]):
    return mp.start_processes(_worker, args=(entrypoint, args, nprocs, str(run_dir), os.getpid(), env),
                              nprocs=nprocs, join=False, start_method=method)


def _restore(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _stop(processes) -> None:
    """Stop every worker still running: SIGKILL (a stopped process ignores SIGTERM until continued)."""
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(timeout=10)


def _failure(run_dir: Path, rank: int, code: int, stopped: list[int]) -> PartrainError:
    """The error that names who failed: a frozen peer first, then the worker's own report."""
    if stopped:
        return WorkerFailed(
            f"worker rank {stopped[0]} stopped responding (the process is stopped, e.g. by SIGSTOP), "
            f"so rank {rank} gave up waiting for it; the other workers were stopped"
        )
    report = run_dir / f"error{rank}.json"
    if report.exists():
        error = _read_report(report)
        if error["user"]:
            told = PartrainError(error["message"])
            told.exit_status = error.get("status", PartrainError.exit_status)  # 1 for a worker that waited too long
            return told
        reason = error["message"][:300]
    elif code < 0:
        reason = f"killed by {signal.Signals(-code).name}"
    else:
        reason = f"exit code {code}"
    return WorkerFailed(f"worker rank {rank} failed ({reason}); the other workers were stopped")
