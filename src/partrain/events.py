"""Timestamped events for timelines and the predictor.

Each worker keeps a list of spans (name, start, end, attributes) in memory and writes them
once, at the end of the run, to ``<dir>/rank<R>.jsonl``: nothing touches the disk on the
hot path. Beside it ``rank<R>.meta.json`` holds the wall-clock time of the log's zero (so
ranks, and nodes with synchronized clocks, line up on one timeline) and, from rank 0, the
run's configuration (so ``partrain trace`` can simulate the same plan). Off (the default), ``span`` returns one shared no-op context manager, so a
disabled trace costs a method call per span (well under a microsecond).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from pathlib import Path

from partrain.atomic import write_atomic
from partrain.errors import PartrainError

_NULL = contextlib.nullcontext()


class EventLog:
    def __init__(self, directory: str | None = None, rank: int = 0):
        self.enabled = directory is not None
        self.directory = Path(directory) if directory else None
        self.rank = rank
        self.spans: list[tuple[str, float, float, dict]] = []
        self.t0 = time.perf_counter()
        self.wall0 = time.time()  # the same instant on the wall clock: aligns ranks' timelines

    def span(self, name: str, **attrs):
        """``with events.span("forward", mb=3): ...`` records the block's wall time."""
        if not self.enabled:
            return _NULL
        return self._span(name, attrs)

    @contextlib.contextmanager
    def paused(self):
        """Record nothing inside: what a pipeline's stages do for evaluation is not training
        (they record every micro-batch forward and backward, whatever schedule runs them)."""
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was

    @contextlib.contextmanager
    def _span(self, name: str, attrs: dict):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append((name, start - self.t0, time.perf_counter() - self.t0, attrs))

    def record(self, name: str, start: float, end: float, **attrs) -> None:
        """Record a span measured elsewhere (``time.perf_counter`` seconds)."""
        if self.enabled:
            self.spans.append((name, start - self.t0, end - self.t0, attrs))

    def write(self, meta: dict | None = None) -> Path | None:
        """The spans to ``rank<R>.jsonl``; the clock anchor and ``meta`` to ``rank<R>.meta.json``."""
        if not self.enabled:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        lines = (json.dumps({"rank": self.rank, "name": name, "start": start, "end": end, **attrs}) + "\n"
                 for name, start, end, attrs in self.spans)
        path = write_atomic(self.directory / f"rank{self.rank}.jsonl", lambda f: f.writelines(lines), text=True)
        info = {"rank": self.rank, "wall0": self.wall0, "host": socket.gethostname(), **(meta or {})}
        write_atomic(self.directory / f"rank{self.rank}.meta.json", json.dumps(info, default=str))
        return path


def read_events(directory: str | Path) -> list[dict]:
    """All ranks' events from a run's event directory, ordered by start time."""
    events = []
    for path in sorted(Path(directory).glob("rank*.jsonl")):  # not rank*.meta.json
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if line:
                events.append(_record(path, line, _EVENT, f"line {number}"))
    return sorted(events, key=lambda e: (e["start"], e["rank"]))


def read_meta(directory: str | Path) -> dict[int, dict]:
    """Each rank's ``meta.json`` (clock anchor, host; rank 0 also the run's configuration)."""
    metas = (_record(p, p.read_text(errors="replace"), _META, optional=_META_OPTIONAL)
             for p in Path(directory).glob("rank*.meta.json"))
    return {int(m["rank"]): m for m in metas}


_NUMBER = (int, float)
# what each record must hold, with its type; a meta record's optional keys may be absent
_EVENT = {"rank": (int,), "name": (str,), "start": _NUMBER, "end": _NUMBER}
_META = {"rank": (int,)}
_META_OPTIONAL = {"wall0": _NUMBER, "config": (dict,), "scratch_config": (dict,)}


def _record(path: Path, text: str, keys: dict[str, tuple[type, ...]], where: str = "",
            optional: dict[str, tuple[type, ...]] | None = None) -> dict:
    """One JSON object with ``keys`` of their types (and ``optional`` ones of theirs where present),
    or one line naming the file (and line) that is not one: a file edited by hand, or another
    program's, is refused, not a traceback."""
    try:
        record = json.loads(text)
    except ValueError as err:
        record, reason = None, f"is not JSON ({err.msg})"
    else:
        missing = [k for k in keys if not isinstance(record, dict) or k not in record]
        wanted = {**keys, **(optional or {})}
        wrong = [k for k, types in wanted.items() if isinstance(record, dict) and k in record
                 and (isinstance(record[k], bool) or not isinstance(record[k], types))]
        reason = (f"lacks {missing[0]!r}" if missing else
                  f"holds {record[wrong[0]]!r} at {wrong[0]!r}, a value of the wrong type" if wrong else "")
    if reason:
        raise PartrainError(f"{path}{f' {where}' if where else ''} {reason}: not an event file that "
                            "`partrain train --events` wrote; record the run again")
    return record
