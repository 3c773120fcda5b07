"""Timestamped events for timelines and the predictor.

Each worker keeps a list of spans (name, start, end, attributes) in memory and writes them
once, at the end of the run, to ``<dir>/rank<R>.jsonl``: nothing touches the disk on the
hot path. Beside it ``rank<R>.meta.json`` holds the wall-clock time of the log's zero (so
ranks, and nodes with synchronized clocks, line up on one timeline) and, from rank 0, the
run's configuration (so ``partrain trace`` can simulate the same plan). Off (the default), ``span`` returns one shared no-op context manager, so a
disabled trace costs a method call per span (well under a microsecond).

A directory used again holds the files of an earlier run whose ranks this run does not have:
rank 0 removes them when it writes, the reader keeps only rank 0's run's ranks, and refuses a
rank whose events do not overlap rank 0's in time (left by a run that stopped before writing).
"""

from __future__ import annotations

import contextlib
import json
import re
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
        if self.rank == 0 and (ranks := _ranks_of(info)) is not None:
            remove_stale(self.directory, ranks)
        return path


# the names `write` gives a rank's files; nothing else in the directory is the event log's
_FILE = re.compile(r"rank(\d+)\.(jsonl|meta\.json)")


def _rank_of(path: Path) -> int | None:
    match = _FILE.fullmatch(path.name)
    return int(match.group(1)) if match else None


def _ranks_of(meta: dict) -> int | None:
    """How many ranks wrote events: the scratch engine's processes (its world counts threads
    too), else the world size; None for meta from before either was recorded."""
    ranks = meta.get("processes", meta.get("world_size"))
    return ranks if isinstance(ranks, int) and not isinstance(ranks, bool) else None


def remove_stale(directory: Path, ranks: int) -> None:
    """Remove the event files of ranks ``ranks`` and above: an earlier run's, with more workers.
    Done by rank 0 when it writes (it alone knows the run's world then); a run that fails
    before writing leaves the directory as it was."""
    for path in directory.iterdir():
        rank = _rank_of(path)
        if rank is not None and rank >= ranks and not path.is_dir():
            path.unlink(missing_ok=True)


def read_events(directory: str | Path, metas: dict[int, dict] | None = None) -> list[dict]:
    """The events of rank 0's run from a run's event directory, ordered by start time.

    Files of ranks beyond rank 0's recorded world are an earlier run's and are left out; a rank
    within it whose events do not overlap rank 0's in time is refused in one line. ``metas``:
    the directory's ``read_meta``, where the caller has read it already."""
    directory = Path(directory)
    metas = read_meta(directory) if metas is None else metas
    ranks = _ranks_of(metas.get(0, {}))
    by_rank: dict[int | None, list[dict]] = {}  # None: a rank*.jsonl of another name, read as before
    for path in sorted(directory.glob("rank*.jsonl")):  # not rank*.meta.json
        rank = _rank_of(path)
        if ranks is not None and rank is not None and rank >= ranks:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if line:
                by_rank.setdefault(rank, []).append(_record(path, line, _EVENT, f"line {number}"))
    _check_one_run(directory, by_rank, metas)
    events = [e for records in by_rank.values() for e in records]
    return sorted(events, key=lambda e: (e["start"], e["rank"]))


def _check_one_run(directory: Path, by_rank: dict[int | None, list[dict]], metas: dict[int, dict]) -> None:
    """Every rank's span of wall-clock time (log start to last event end) overlaps rank 0's:
    one run's ranks all live through its training, so a rank that does not is another run's.
    Costs nothing more than the meta files; across nodes it trusts their clocks to agree
    within a run's length."""
    if 0 not in by_rank or "wall0" not in metas.get(0, {}):
        return

    def span(rank):
        wall0 = metas[rank]["wall0"]
        return wall0, wall0 + max(e["end"] for e in by_rank[rank])

    start0, end0 = span(0)
    for rank in sorted(r for r in by_rank if r and "wall0" in metas.get(r, {})):
        start, end = span(rank)
        if end < start0 or start > end0:
            raise PartrainError(f"{directory / f'rank{rank}.jsonl'} is another run's (recorded "
                                f"{time.ctime(start)}, rank 0's {time.ctime(start0)}): record the run again "
                                "into an empty directory")


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
