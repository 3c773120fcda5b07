"""A benchmark cell's processes: started in their own session, watched under a timeout,
stopped as a group, and their failure told in one line.

Each command runs in a new session (process group), so that on timeout the whole group (the
launcher and its workers) is stopped at once: SIGTERM first, which ``partrain train`` turns
into a clean stop (its launcher removes its ``partrain-*`` folder in $TMPDIR), then SIGKILL for
what is left after ``STOP_GRACE_S``. Each runs with ``PR_SET_PDEATHSIG`` set to SIGTERM, so
that if the runner itself is killed the launcher's elastic agent stops its workers (SIGKILL
would kill the agent alone and leave its workers training on the cores the next cell
measures on).

Output goes to temporary files, not pipes: a long run's JSON line can exceed a pipe's
buffer, and polling a file needs no reader thread.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial

from partrain.distributed.spawn import child_env, die_with_parent

POLL_S = 0.5  # how often a running cell is checked for exit and timeout, and the bar redrawn
# How long a cell's launcher has, after SIGTERM, to stop its workers (SIGKILL, then join) and
# remove its temporary folder: milliseconds, a second on a loaded machine. Past it the group is
# SIGKILLed: a hung launcher costs an interrupted or timed-out cell at most this much.
STOP_GRACE_S = 5.0
_EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b.*")
_TORCH_LOG_LINE = re.compile(r"^[EWI]\d{4} ")  # torch's C++/elastic log lines: E1122 22:56:32.163000 ...


def run_process(cmd: list[str], timeout: float, tick: Callable[[], None]) -> tuple[str, str | None, dict | None]:
    """Run ``cmd`` in a new session; returns (status, reason, the JSON result or None)."""
    return run_processes([cmd], timeout, tick)


def run_processes(cmds: list[list[str]], timeout: float, tick: Callable[[], None],
                  env: dict[str, str] | None = None) -> tuple[str, str | None, dict | None]:
    """Run ``cmds`` side by side (one per emulated node), each in a new session; the first's
    stdout holds the JSON result. When one fails the others are stopped at once: they would
    wait for it until their rendezvous timed out."""
    with ExitStack() as files:
        outs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in cmds]
        errs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in cmds]
        procs: list[subprocess.Popen] = []
        try:
            for cmd, out, err in zip(cmds, outs, errs, strict=True):
                procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env or child_env(),
                                              start_new_session=True, preexec_fn=partial(die_with_parent, signal.SIGTERM)))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                running = [p for p in procs if p.poll() is None]
                if not running or any(p.returncode for p in procs if p not in running):
                    break
                tick()
                try:
                    running[0].wait(POLL_S)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            codes = [p.poll() for p in procs]  # before the stop: a node stopped for another's failure did not fail
            _stop_groups(procs)  # on timeout the launchers and their workers; else any straggler
        stdout = _read(outs[0])
        failed = next((i for i, code in enumerate(codes) if code), None)
        stderr = _read(errs[failed]) if failed is not None else ""
    if failed is not None:
        where = f"node {failed}: " if len(cmds) > 1 else ""
        return "failed", where + failure_reason(stderr, codes[failed]), None
    if None in codes:
        return "timeout", f"no result within the {timeout:g} s cell timeout; the cell's processes were killed", None
    try:
        return "ok", None, json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return "failed", f"exit status 0 but no JSON result on stdout: {stdout.strip()[-200:]!r}", None


def _read(file) -> str:
    file.seek(0)
    return file.read()


def _stop_groups(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every group, give the launchers ``STOP_GRACE_S`` together to exit, SIGKILL the
    rest. A launcher that exited already costs no wait; the SIGKILL comes even when a second
    Ctrl-C cuts the grace short."""
    try:
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc in procs:
            _signal_group(proc, signal.SIGKILL)  # workers the launcher left, anything that ignores SIGTERM
            proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # the group has already exited
        pass


def failure_reason(stderr: str, returncode: int) -> str:
    """One line saying why a cell failed: the last line of its stderr, made specific.

    A multi-worker run ends with the launcher's "worker rank N stopped on an error (above)";
    the exception it points to is added. A process killed by a signal says which, and
    SIGKILL from nobody we know of is most likely the kernel's out-of-memory killer.
    """
    if "ChildFailedError" in stderr:  # torchrun's (across nodes): the worker's error is above the launcher's traceback
        stderr = "\n".join(line for line in stderr[:stderr.rfind("Traceback (most recent call last)")].splitlines()
                           if not _TORCH_LOG_LINE.match(line))
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (out of memory?)" if -returncode == signal.SIGKILL else ""
        return f"killed by {name}{hint}" + (f": {lines[-1]}" if lines else "")
    if not lines:
        return f"exit status {returncode}, nothing on stderr"
    reason = lines[-1]
    if reason.endswith("(above)"):
        cause = next((line for line in reversed(lines[:-1]) if _EXCEPTION_LINE.match(line)), None)
        if cause:
            reason = f"{reason}: {cause}"
    if "SIGKILL" in reason:
        reason += " (out of memory?)"
    return reason[:500]
