"""A run's timeline as Chrome trace-event JSON, measured beside predicted.

Input: the per-rank events a run wrote with ``train --events DIR`` (``partrain.events``).
Output: the JSON object format of the Trace Event Format (Google, "Trace Event Format",
2016; what chrome://tracing, Perfetto's UI and PyTorch's profiler read): complete events
(``"ph": "X"``, ``ts`` and ``dur`` in microseconds) and metadata events (``"ph": "M"``)
naming processes and threads.

- one process per rank; within it one track (tid) per activity: the loop's ``step`` and
  ``data``, one per pipeline stage (its forwards and backwards: they never overlap on a
  rank, and one row per stage is the pipeline diagram of the GPipe and PipeDream papers),
  one per DDP allreduce bucket (buckets overlap backward and each other), ``optimizer``,
  ``average``; arguments carry step, stage, micro-batch and bytes;
- one more process, ``predicted``: the predictor's simulated schedule of the same plan
  (``predict.pipeline_sim``, over the model and hardware profiles), one step laid at the
  start of every measured step on rank 0 (or right after the previous predicted step while
  that one still runs), so measured and predicted sit one above the other. Data-parallel and serial plans have no schedule to
  simulate: their predicted step is the breakdown laid end to end (data, forward and
  backward, exposed communication, optimizer).

Ranks are aligned on the wall clock each rank read when its event log started (same
machine: exact to microseconds; several nodes: as good as their clock synchronisation).
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from partrain.atomic import write_atomic
from partrain.errors import PartrainError
from partrain.events import read_events, read_meta

PREDICTED = "predicted"


@dataclass
class Span:
    process: str  # "rank 0", ..., or "predicted"
    track: str  # the row within the process
    name: str
    cat: str  # forward | backward | data | allreduce | optimizer | ... (colour and legend)
    start_s: float  # seconds since the trace's origin
    dur_s: float
    args: dict = field(default_factory=dict)


@dataclass
class Timeline:
    spans: list[Span]
    processes: list[str]  # in display order
    meta: dict  # rank 0's meta: the run's config, pp, dp, world size
    plan: str = ""
    measured_step_s: float | None = None  # median step on rank 0 after the first
    predicted_step_s: float | None = None
    notes: list[str] = field(default_factory=list)


# ---- measured ---------------------------------------------------------------------------------


def track_of(event: dict) -> tuple[str, str, str]:
    """(track, span name, category) of one event."""
    name = event["name"]
    if name in ("forward", "backward") and "stage" in event:
        letter = "F" if name == "forward" else "B"
        return f"stage {event['stage']}", f"{letter}{event.get('mb', '')}", name
    if name == "allreduce" and "bucket" in event:
        return f"allreduce bucket {event['bucket']}", "allreduce", name
    return name, name, name


def track_order(track: str) -> tuple:
    """Rows top to bottom: step, data, compute, communication, optimizer, anything else;
    the predicted process's "rank R: ..." rows grouped by rank first."""
    owner, _, what = track.rpartition(": ")
    head = what.split(" ")[0]
    kind = {"step": 0, "data": 1, "stage": 2, "forward": 2, "backward": 3, "forward+backward": 3, "compute": 3,
            "allreduce": 4, "average": 5, "runtime": 6, "optimizer": 7}.get(head, 8)
    number = what.split(" ")[-1]
    return owner.split(" ")[-1].zfill(6), kind, number.zfill(6) if number.isdigit() else what


def measured_timeline(directory: str | os.PathLike) -> Timeline:
    """Every span the run's ranks recorded, on one clock."""
    directory = Path(directory)
    if not directory.is_dir() or not any(directory.glob("rank*.jsonl")):
        raise PartrainError(f"no events in {directory}: record them with `partrain train ... --events {directory}`")
    metas = read_meta(directory)
    events = read_events(directory, metas)  # only rank 0's run's ranks
    if not events:  # every file left out as an earlier run's: rank 0's own recorded nothing
        raise PartrainError(f"no events of the last run in {directory}: record them with "
                            f"`partrain train ... --events {directory}`")
    # wall-clock zero of each rank; events written before meta files existed keep their own zero
    wall0 = {r: m.get("wall0", 0.0) for r, m in metas.items()}
    origin = min(wall0.get(e["rank"], 0.0) + e["start"] for e in events)
    spans = []
    for e in events:
        track, name, cat = track_of(e)
        args = {k: v for k, v in e.items() if k not in ("rank", "name", "start", "end")}
        start = wall0.get(e["rank"], 0.0) + e["start"] - origin
        spans.append(Span(f"rank {e['rank']}", track, name, cat, start, max(0.0, e["end"] - e["start"]), args))
    ranks = sorted({e["rank"] for e in events})
    timeline = Timeline(spans, [f"rank {r}" for r in ranks], metas.get(0, {}))
    steps = [s.dur_s for s in step_spans(timeline)]
    if steps:  # the first step pays shape inference and first touches: left out when others exist
        timeline.measured_step_s = statistics.median(steps[1:] or steps)
    return timeline


def step_spans(timeline: Timeline) -> list[Span]:
    """Rank 0's steps in time order: where the predicted steps are laid."""
    return sorted((s for s in timeline.spans if s.process == "rank 0" and s.track == "step"), key=lambda s: s.start_s)


# ---- predicted --------------------------------------------------------------------------------


def run_plan(meta: dict):
    """The ``Plan`` and ``RunConfig`` the run's rank 0 recorded (None when it recorded none)."""
    from partrain.predict.plan import Plan
    from partrain.validate import row_config

    if "config" not in meta:
        return None, None
    run = {**meta["config"], "resolved": {"split_points": meta.get("split_points")}}
    cfg = row_config({"config": {"run": run}})
    return Plan.from_config(cfg), cfg


def simulated_step(profile, hardware, plan) -> tuple[list[tuple], float]:
    """One steady-state step of ``plan`` as the predictor simulates it: ([(row, name, cat,
    start, dur, args)], step seconds), start 0 at the step's first action on rank 0.

    Pipelines: the predictor's own event simulation (``predict.pipeline.simulate_plan``).
    Other plans: the predicted breakdown end to end.
    """
    from partrain.predict.pipeline import simulate_plan
    from partrain.predict.predictor import predict_plan

    if plan.kind not in ("pipeline", "hybrid"):
        pred = predict_plan(profile, hardware, plan)
        parts = [("data", pred.data_s), ("compute", pred.compute_s), ("allreduce", pred.comm_s), ("optimizer", pred.optimizer_s)]
        out, t = [], 0.0
        for name, seconds in parts:
            if seconds > 0:
                out.append((f"every rank: {name}", "forward+backward" if name == "compute" else name, name, t, seconds, {}))
                t += seconds
        return out, pred.median_step_s
    sim = simulate_plan(profile, hardware, plan)
    zero = min(start for rank, *_, start, _ in sim.spans if rank == 0)
    out = []
    for rank, kind, stage, mb, start, end in sim.spans:
        if end - start <= 0:
            continue  # "sends": the step's wait for its messages, zero work
        if kind in ("F", "B"):
            row, name, cat = f"rank {rank}: stage {stage}", f"{kind}{mb}", "forward" if kind == "F" else "backward"
            args = {"stage": stage, "mb": mb}
        else:
            row, name, cat, args = f"rank {rank}: {kind}", kind, kind, {}
        out.append((row, name, cat, start - zero, end - start, args))
    return out, sim.step_s


def add_predicted(timeline: Timeline, profile, hardware, plan) -> None:
    """Lay the simulated step at the start of each measured step of rank 0, or right after
    the previous predicted step where that one is still running (predicted slower than measured)."""
    step, step_s = simulated_step(profile, hardware, plan)
    timeline.predicted_step_s = step_s
    timeline.plan = plan.label()
    anchors = [s.start_s for s in step_spans(timeline)]
    if not anchors:  # events of a partrain that recorded no step spans: one predicted step, at the start
        anchors = [min(s.start_s for s in timeline.spans)]
        timeline.notes.append("the run recorded no step spans: one predicted step is drawn, at the start")
    at = -float("inf")
    for k, anchor in enumerate(anchors):
        at = max(anchor, at + step_s)
        for row, name, cat, start, dur, args in step:
            timeline.spans.append(Span(PREDICTED, row, name, cat, at + start, dur, {**args, "step": k}))
    timeline.processes.append(PREDICTED)


# ---- Chrome trace JSON ------------------------------------------------------------------------


def chrome_trace(timeline: Timeline) -> dict:
    """The Trace Event Format's JSON object: process and thread names, then complete events."""
    pids = {p: i for i, p in enumerate(timeline.processes)}
    tids: dict[tuple[str, str], int] = {}
    for process in timeline.processes:
        tracks = sorted({s.track for s in timeline.spans if s.process == process}, key=track_order)
        for i, track in enumerate(tracks):
            tids[process, track] = i + 1
    events = []
    for process, pid in pids.items():
        label = f"{process} (simulated: {timeline.plan})" if process == PREDICTED else process
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    for (process, track), tid in tids.items():
        pid = pids[process]
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    # a predicted rank may start its step before rank 0 does, ahead of the first measured span
    shift = min(0.0, *(s.start_s for s in timeline.spans))
    for s in sorted(timeline.spans, key=lambda s: s.start_s):
        events.append({"name": s.name, "cat": s.cat, "ph": "X", "ts": round((s.start_s - shift) * 1e6, 3),
                       "dur": round(s.dur_s * 1e6, 3), "pid": pids[s.process], "tid": tids[s.process, s.track],
                       "args": s.args})
    other = {"plan": timeline.plan, "measured_step_ms": _ms(timeline.measured_step_s),
             "predicted_step_ms": _ms(timeline.predicted_step_s), "notes": timeline.notes,
             "config": timeline.meta.get("config")}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 4)


def write_trace(timeline: Timeline, path: str | os.PathLike) -> Path:
    return write_atomic(path, json.dumps(chrome_trace(timeline), separators=(",", ":")))
