"""Timelines and the HTML report: the Chrome trace of a real 2-worker GPipe run (every
measured span present, the predicted process beside it), the Gantt PNG, the report over a
synthetic 500-cell store, and both pages opened in headless Chromium (skipped without it)."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from partrain.bench.store import Outcome, Store
from partrain.bench.suite import Cell
from partrain.cli import main
from partrain.config import RunConfig
from partrain.events import EventLog, read_events
from partrain.predict.machine import fingerprint
from partrain.predict.plan import profile_batch_sizes
from partrain.profile.cache import profile_path
from partrain.profile.model import profile_model
from partrain.report.trace import (
    add_predicted,
    chrome_trace,
    measured_timeline,
    run_plan,
)
from partrain.runner import run_training

pytestmark = pytest.mark.alone  # profiles models for the predicted schedules it draws: never beside another test (make test)

EXAMPLE_CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "cluster.toml"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def gpipe_events(data_dir, tmp_path_factory) -> Path:
    """A real run: mlp, gpipe on 2 workers, 4 micro-batches, 4 steps, events recorded."""
    out = tmp_path_factory.mktemp("events") / "gpipe"
    run_training(RunConfig(model="mlp", strategy="gpipe", workers=2, microbatches=4, steps=4, batch_size=32,
                           evaluate=False, threads=1, data_dir=str(data_dir), events=str(out)), show_progress=False)
    return out


@pytest.fixture(scope="module")
def profile_dir(gpipe_events, tmp_path_factory) -> Path:
    """A model-profile cache holding the profile `partrain trace` looks up for that run."""
    directory = tmp_path_factory.mktemp("profiles")
    plan, cfg = run_plan(measured_timeline(gpipe_events).meta)
    sizes = profile_batch_sizes(plan.batch_sizes())
    profile = profile_model("mlp", "mnist", sizes, threads=1, synthetic=True)
    profile.save(profile_path(directory, "mlp", "mnist", sizes, 1, False, {}))
    return directory


def spans_of(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def names(trace: dict, kind: str) -> dict[int, str]:
    return {e["pid"] if kind == "process_name" else (e["pid"], e["tid"]): e["args"]["name"]
            for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == kind}


def test_trace_has_every_measured_span_and_the_predicted_schedule(gpipe_events, profile_dir, tmp_path):
    out = tmp_path / "run.json"
    assert main(["trace", str(gpipe_events), "-o", str(out), "--cluster", str(EXAMPLE_CLUSTER),
                 "--profile-dir", str(profile_dir), "--html", "--png"]) == 0
    trace = json.loads(out.read_text())
    processes, threads = names(trace, "process_name"), names(trace, "thread_name")
    assert processes[0] == "rank 0" and processes[1] == "rank 1" and processes[2].startswith("predicted")
    spans = spans_of(trace)
    for e in spans:  # complete events: microseconds, a named track of a named process
        assert e["ph"] == "X" and e["dur"] >= 0 and e["ts"] >= 0 and (e["pid"], e["tid"]) in threads
    # every measured span is in the trace, on its rank's process, with its duration
    events = read_events(gpipe_events)
    measured = [e for e in spans if e["pid"] in (0, 1)]
    assert len(measured) == len(events)
    # the trace keeps durations to the nanosecond (3 decimals of a microsecond): rounding both sides to whole
    # microseconds would round the trace's value twice, and 351.4996 reads 352 against 351
    assert sorted(e["dur"] for e in measured) == pytest.approx(
        sorted((e["end"] - e["start"]) * 1e6 for e in events), abs=1e-3)
    # rank r runs stage r: 4 forwards and 4 backwards per step, the micro-batch in args
    for rank in (0, 1):
        on_stage = [e for e in measured if e["pid"] == rank and threads[rank, e["tid"]] == f"stage {rank}"]
        assert sorted(e["args"]["mb"] for e in on_stage if e["cat"] == "forward") == sorted(list(range(4)) * 4)
        assert sum(e["cat"] == "backward" for e in on_stage) == 16
        assert sum(threads[rank, e["tid"]] == "optimizer" for e in measured if e["pid"] == rank) == 4
        assert sum(threads[rank, e["tid"]] == "step" for e in measured if e["pid"] == rank) == 4
    # the predicted process: the simulated gpipe step under each of the 4 measured steps
    predicted = [e for e in spans if e["pid"] == 2]
    forwards = [e for e in predicted if e["cat"] == "forward"]
    assert len(forwards) == 4 * 2 * 4  # steps x stages x micro-batches
    assert {threads[2, e["tid"]] for e in forwards} == {"rank 0: stage 0", "rank 1: stage 1"}
    # gpipe: on each stage all forwards of a step end before its first backward starts
    for stage in (0, 1):
        mine = [e for e in predicted if e["args"].get("stage") == stage and e["args"]["step"] == 0]
        last_f = max(e["ts"] + e["dur"] for e in mine if e["cat"] == "forward")
        # ts and dur are each rounded to the nanosecond (3 decimals of a microsecond): their sum
        # may pass the next start by up to 1 ns and a float's last bit (63.239000000000004 > 63.238 + 0.001)
        assert last_f <= min(e["ts"] for e in mine if e["cat"] == "backward") + 2e-3
    assert trace["otherData"]["predicted_step_ms"] > 0 and trace["otherData"]["plan"] == "gpipe M=4"
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "trace-data" in out.with_suffix(".html").read_text()


def test_data_parallel_trace_has_allreduce_buckets_and_a_breakdown(data_dir, tmp_path):
    events = tmp_path / "ddp"
    run_training(RunConfig(model="mlp", strategy="ddp", workers=2, bucket_mb=0.25, steps=3, evaluate=False, threads=1,
                           data_dir=str(data_dir), events=str(events)), show_progress=False)
    timeline = measured_timeline(events)
    from partrain.predict.cluster import load_cluster

    profile = profile_model("mlp", "mnist", [16, 32], threads=1, synthetic=True)
    add_predicted(timeline, profile, load_cluster(EXAMPLE_CLUSTER), run_plan(timeline.meta)[0])
    trace = chrome_trace(timeline)
    threads = names(trace, "thread_name")
    buckets = {threads[e["pid"], e["tid"]] for e in spans_of(trace) if e["cat"] == "allreduce" and e["pid"] < 2}
    assert buckets and all(b.startswith("allreduce bucket ") for b in buckets)  # one track per bucket
    assert all("bytes" in e["args"] for e in spans_of(trace) if e["cat"] == "allreduce" and e["pid"] < 2)
    predicted = {threads[e["pid"], e["tid"]] for e in spans_of(trace) if e["pid"] == 2}
    assert {"every rank: data", "every rank: compute", "every rank: optimizer"} <= predicted


def test_trace_of_a_directory_without_events_is_one_clear_error(tmp_path, capsys):
    assert main(["trace", str(tmp_path), "-o", str(tmp_path / "t.json")]) == 2
    assert "no events in" in capsys.readouterr().err and not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("files, words", [
    ({"rank0.jsonl": '{"x":'}, ["rank0.jsonl line 1 is not JSON"]),
    ({"rank0.jsonl": '{"rank": 0, "name": "data", "start": 0.1, "end": 0.2}\n[1, 2]\n'}, ["rank0.jsonl line 2 lacks 'rank'"]),
    ({"rank0.jsonl": '{"rank": 0, "name": "data", "start": 0.1, "end": 0.2}\n', "rank0.meta.json": "{"},
     ["rank0.meta.json is not JSON"]),
    ({"rank0.jsonl": '{"rank": 0, "name": "data", "start": "abc", "end": 0.2}\n'}, ["rank0.jsonl line 1 holds 'abc' at 'start'"]),
    ({"rank0.jsonl": '{"rank": 0, "name": "data", "start": 0.1, "end": 0.2}\n', "rank0.meta.json": '{"rank": 0, "config": 5}'},
     ["rank0.meta.json holds 5 at 'config'"]),
    ({"rank0.jsonl": '{"rank": "0", "name": "data", "start": 0.1, "end": 0.2}\n'}, ["holds '0' at 'rank'"]),
])
def test_trace_of_events_that_partrain_did_not_write_is_one_clear_error(tmp_path, capsys, files, words):
    ev = tmp_path / "ev"
    ev.mkdir()
    for name, text in files.items():
        (ev / name).write_text(text)
    assert main(["trace", str(ev), "-o", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and all(w in err.splitlines()[-1] for w in words), err
    assert not (tmp_path / "t.json").exists()


def _record_run(directory: Path, world: int, ranks: range | None = None, ago_s: float = 0.0) -> None:
    """What a run of ``world`` ranks writes with --events (its ``ranks`` only, as when the
    others stopped before writing), ``ago_s`` seconds ago: a 10 ms step each, all at once."""
    logs = [EventLog(str(directory), rank) for rank in (ranks or range(world))]
    for log in logs:
        log.wall0 -= ago_s
        log.record("step", log.t0, log.t0 + 0.01, step=0)
    for log in logs:
        log.write({"world_size": world} if log.rank == 0 else None)


def test_events_of_an_earlier_run_with_more_ranks_are_removed_and_left_out(tmp_path):
    ev = tmp_path / "ev"
    _record_run(ev, 2)
    stale = {p.name: p.read_text() for p in ev.glob("rank1.*")}
    (ev / "notes.txt").write_text("mine")
    _record_run(ev, 1)  # the same directory again, one rank: rank 0 removes rank 1's files, nothing else
    assert sorted(p.name for p in ev.iterdir()) == ["notes.txt", "rank0.jsonl", "rank0.meta.json"]
    for name, text in stale.items():  # as a partrain without the clean-up left them: the reader leaves them out
        (ev / name).write_text(text)
    assert {e["rank"] for e in read_events(ev)} == {0}
    assert measured_timeline(ev).processes == ["rank 0"]


def test_a_rank_that_another_run_left_is_refused_in_one_line(tmp_path, capsys):
    ev = tmp_path / "ev"
    _record_run(ev, 2, ago_s=3600)
    assert measured_timeline(ev).processes == ["rank 0", "rank 1"]  # one run's ranks overlap in time
    _record_run(ev, 2, ranks=range(1))  # this run's rank 1 wrote nothing: its file is the hour-old run's
    assert main(["trace", str(ev), "--no-predicted", "-o", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "rank1.jsonl is another run's" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "t.json").exists()


# ---- the report --------------------------------------------------------------------------------


def synthetic_store(path: Path, cells: int = 500) -> Path:
    """``cells`` plausible cells (some skipped, some failed) on this machine's fingerprint."""
    rng, hw = random.Random(0), fingerprint()
    combos = [(m, s, w, b, lr) for m in ("mlp", "cnn", "resnet18", "vgg11", "mobilenetv2")
              for s, ws in (("serial", [1]), ("ddp", [1, 2, 4, 8]), ("fsdp", [2, 4]), ("gpipe", [2, 4]), ("1f1b", [2, 4]))
              for w in ws for b in (32, 64, 128, 256) for lr in (0.01, 0.1, 0.5)]
    with Store(path) as store:
        for i, (model, strategy, workers, batch, lr) in enumerate(combos[:cells]):
            cell = Cell(model, "mnist", strategy, workers, batch, 4 if strategy in ("gpipe", "1f1b") else None, lr)
            cfg = cell.run_config(None, 300)
            step = 0.01 * batch / 64 * (1.0 if strategy == "serial" else rng.uniform(0.4, 1.2))
            status = "ok" if i % 23 else ("failed" if i % 2 else "skipped")
            figures = {} if status != "ok" else {
                "steps_run": 25, "measured_steps": 20, "step_seconds_median": step, "step_seconds_p10": step * 0.9,
                "step_seconds_p90": step * 1.2, "seconds_per_epoch": step * 60000 / batch, "epoch_extrapolated": 1,
                "epoch_samples": 60000, "samples_per_s": batch / step, "peak_memory_bytes": 2**29,
                "peak_memory_per_worker": [2**29 - k * 2**24 for k in range(workers)], "final_loss": 1.0}
            outcome = Outcome(status, None if status == "ok" else "a reason, <escaped>", figures,
                              {**cfg.to_dict(), "resolved": {"pp": cfg.dims.pp, "dp": cfg.dims.dp}},
                              "2026-01-01T00:00:00", "2026-01-01T00:00:10", 10.0, 0.5)
            store.record(cell, hw, outcome, "synthetic", None)
    return path


@pytest.fixture(scope="module")
def big_report(gpipe_events, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    store = synthetic_store(tmp / "store.sqlite")
    out = tmp / "report.html"
    assert main(["report", "--store", str(store), "-o", str(out), "--events", str(gpipe_events),
                 "--profile-dir", str(tmp / "no-profiles")]) == 0
    return out


def test_report_is_one_self_contained_bounded_file(big_report):
    text = big_report.read_text()
    assert len(text) < 3_000_000  # 500 cells: capped plots, not one image per cell
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", text), "the report fetches nothing"
    assert text.count("<tr class=") >= 500 and "a reason, &lt;escaped&gt;" in text
    assert "No recommendation without cached profiles" in text and "Not predicted" in text  # the report never measures
    assert 'class="timeline"' in text and text.count("data:image/png;base64,") >= 3
    assert not list(big_report.parent.glob(".*.tmp"))  # written through a temporary file, renamed


def test_report_without_a_store_is_one_clear_error(tmp_path, capsys):
    assert main(["report", "--store", str(tmp_path / "none.sqlite"), "-o", str(tmp_path / "r.html")]) == 2
    assert "no results store" in capsys.readouterr().err and not (tmp_path / "r.html").exists()


# ---- in a real browser ----------------------------------------------------------------------------

# Injected before the page's own scripts: records errors; once the page has loaded, checks
# what must have rendered and writes the verdict into the DOM, which --dump-dom prints.
CHECK = """<script>
window.__errors = [];
window.addEventListener('error', function (e) { window.__errors.push(String(e.message)); });
var __ce = console.error; console.error = function () { window.__errors.push([].join.call(arguments, ' ')); __ce.apply(console, arguments); };
window.addEventListener('load', function () { setTimeout(function () {
  var bad = window.__errors.slice();
  try { (%s)(bad); } catch (e) { bad.push('check threw ' + e); }
  var d = document.createElement('div'); d.id = 'check-status';
  d.textContent = bad.length ? 'CHECK-FAIL ' + bad.join(' | ') : 'CHECK-OK';
  document.body.appendChild(d);
}, 200); });
</script>"""

REPORT_CHECK = """function (bad) {
  var tables = document.querySelectorAll('table.sortable');
  if (!tables.length) bad.push('no tables');
  tables.forEach(function (t) { if (!t.tBodies[0].rows.length) bad.push('empty table'); });
  var imgs = document.querySelectorAll('img');
  if (imgs.length < 3) bad.push('only ' + imgs.length + ' images');
  imgs.forEach(function (i) { if (!(i.naturalWidth > 0 && i.getBoundingClientRect().height > 0)) bad.push('image not rendered: ' + i.alt); });
  if (!document.querySelector('img.timeline')) bad.push('no timeline');
  var cells = document.getElementById('cells'), pager = cells.parentNode.querySelector('.pager').textContent;
  if (cells.tBodies[0].rows.length !== 50 || pager.indexOf('500 of 500 rows, page 1 of 10') < 0) bad.push('paging: ' + pager);
  cells.tHead.rows[0].cells[3].click();  // ms/step, ascending
  var v = Array.prototype.map.call(cells.tBodies[0].rows, function (r) { return Number(r.cells[3].dataset.v); });
  for (var i = 1; i < v.length; i++) if (v[i] < v[i - 1]) { bad.push('not sorted'); break; }
  var f = cells.parentNode.querySelector('input.filter'); f.value = 'resnet18 fsdp x4'; f.oninput();
  Array.prototype.forEach.call(cells.tBodies[0].rows, function (r) { if (r.textContent.indexOf('resnet18/mnist fsdp x4') < 0) bad.push('filter'); });
}"""

TIMELINE_CHECK = """function (bad) {
  var svg = document.getElementById('timeline-svg');
  if (!svg) { bad.push('no timeline svg'); return; }
  var spans = svg.querySelectorAll('rect.span').length;
  if (spans < 20) bad.push('only ' + spans + ' spans drawn');
  var labels = svg.textContent;
  ['rank 0', 'rank 1', 'predicted'].forEach(function (p) { if (labels.indexOf(p) < 0) bad.push('no row of ' + p); });
  if (svg.getBoundingClientRect().height < 100) bad.push('timeline not laid out');
}"""


def open_in_chromium(page: Path, check: str, tmp_path: Path) -> tuple[str, str]:
    checked = tmp_path / f"checked-{page.name}"
    checked.write_text(page.read_text().replace("<head>", "<head>" + CHECK % check, 1))
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
         "--window-size=1280,900", "--virtual-time-budget=10000", "--dump-dom", checked.as_uri()],
        capture_output=True, text=True, timeout=120)
    return proc.stdout, proc.stderr


def console_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "CONSOLE" in line and ("ERROR" in line or "Uncaught" in line)]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_report_renders_in_chromium(big_report, tmp_path):
    dom, log = open_in_chromium(big_report, REPORT_CHECK, tmp_path)
    status = re.search(r'<div id="check-status">([^<]*)</div>', dom)
    assert status and status.group(1) == "CHECK-OK", (status and status.group(1)) or log[-2000:]
    assert not console_errors(log)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_trace_viewer_renders_in_chromium(gpipe_events, profile_dir, tmp_path):
    out = tmp_path / "run.json"
    assert main(["trace", str(gpipe_events), "-o", str(out), "--cluster", str(EXAMPLE_CLUSTER),
                 "--profile-dir", str(profile_dir), "--html"]) == 0
    dom, log = open_in_chromium(out.with_suffix(".html"), TIMELINE_CHECK, tmp_path)
    status = re.search(r'<div id="check-status">([^<]*)</div>', dom)
    assert status and status.group(1) == "CHECK-OK", (status and status.group(1)) or log[-2000:]
    assert not console_errors(log)


def test_train_trace_under_a_launcher_is_refused_before_training(monkeypatch, tmp_path, capsys):
    from types import SimpleNamespace

    import partrain.distributed.launch as launch

    monkeypatch.setattr(launch, "detect_launcher", lambda: SimpleNamespace(launched=True, world_size=2))
    assert main(["train", "--model", "mlp", "--trace", str(tmp_path / "t.json")]) == 2
    assert "--events DIR on a shared path" in capsys.readouterr().err and not (tmp_path / "t.json").exists()
