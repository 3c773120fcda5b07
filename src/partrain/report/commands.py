"""``partrain trace``, ``partrain report`` and ``train --trace``: parsers and handlers.

Kept out of ``cli.py``: it only calls ``add_parsers(sub)`` and ``add_train_trace(p)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from partrain.errors import PartrainError
from partrain.outputs import check_file

PROFILE_DIR_HELP = "profile cache directory (default: $PARTRAIN_PROFILE_DIR, else ~/.partrain/profiles)"


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "trace", help="a run's timeline as Chrome trace JSON (Perfetto, chrome://tracing), measured beside predicted",
        description="Turn the per-rank events of `partrain train --events DIR` into Chrome trace-event JSON: one "
        "process per rank, a track per activity (data, each pipeline stage's forwards and backwards, allreduce "
        "buckets, optimizer, averaging), and a 'predicted' process with the predictor's simulated schedule of the "
        "same plan laid under every measured step. Open it in https://ui.perfetto.dev or chrome://tracing; --html "
        "writes an offline viewer, --png a Gantt chart.",
    )
    p.add_argument("events", metavar="EVENTS_DIR", help="the directory given to train --events")
    p.add_argument("-o", "--output", default="trace.json", help="trace JSON to write (default: trace.json)")
    add_trace_options(p)
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser(
        "report", help="one self-contained HTML file: results, scaling, predicted vs measured, timelines",
        description="Write one HTML file that needs no network (styles, scripts and PNG images inside it) from a "
        "results store: the cells with speedup and efficiency (sortable, filterable, paged), scaling plots, "
        "predicted against measured per strategy with the noise floor, the measured and predicted best plans with "
        "the commands that run them, memory per worker, and the timelines of runs recorded with --events. "
        "Predictions use cached profiles only (run `partrain validate` to measure missing ones).",
    )
    p.add_argument("--store", help="results store, an SQLite file (default: $PARTRAIN_STORE, else ~/.partrain/results.sqlite)")
    p.add_argument("-o", "--output", default="report.html", help="HTML file to write (default: report.html)")
    p.add_argument("--events", action="append", default=[], metavar="DIR",
                   help="a run's events directory (train --events) to draw as a timeline; repeatable")
    p.add_argument("--profile-dir", help=PROFILE_DIR_HELP)
    p.add_argument("--title", help="the report's title (default: from the store)")
    p.set_defaults(func=cmd_report)


def add_trace_options(p: argparse.ArgumentParser, profile_flag: str = "--profile-dir") -> None:
    g = p.add_argument_group("trace")
    g.add_argument("--html", nargs="?", const=True, metavar="FILE",
                   help="also write a self-contained HTML timeline viewer (default name: the trace's, .html)")
    g.add_argument("--png", nargs="?", const=True, metavar="FILE",
                   help="also write a Gantt chart of the last steps, measured above predicted (default name: .png)")
    g.add_argument("--no-predicted", dest="predicted", action="store_false",
                   help="leave the predictor's schedule out (it needs the model and hardware profiles; measured when not cached)")
    g.add_argument("--cluster", help="predict for this cluster TOML instead of this machine's hardware profile")
    g.add_argument(profile_flag, dest="trace_profile_dir", help=PROFILE_DIR_HELP)


def add_train_trace(p: argparse.ArgumentParser) -> None:
    """``train --trace FILE``: record events (into a temporary directory unless --events) and write the trace."""
    p.add_argument("--trace", metavar="FILE", help="write the run's timeline as Chrome trace JSON (see `partrain trace`)")
    add_trace_options(p, "--trace-profile-dir")
    train = p.get_default("func")

    def with_trace(args: argparse.Namespace) -> int:
        if not args.trace:
            return train(args)
        from partrain.distributed.launch import detect_launcher

        if detect_launcher().launched:  # each rank is its own process: none knows when the others wrote
            raise PartrainError("--trace needs the workers partrain starts itself: under a launcher, record with "
                                "--events DIR on a shared path and run `partrain trace DIR` once the job ended")
        check_trace_outputs(args.trace, args, "--trace")
        with tempfile.TemporaryDirectory(prefix="partrain-events-") as tmp:
            args.events = args.events or tmp
            status = train(args)
            if status == 0 and Path(args.events, "rank0.jsonl").is_file():  # rank 0 of a launched job writes it
                write_outputs(args.events, args.trace, args)
        return status

    p.set_defaults(func=with_trace)


def cmd_trace(args: argparse.Namespace) -> int:
    check_trace_outputs(args.output, args, "--output")
    write_outputs(args.events, args.output, args)
    return 0


def trace_outputs(output: str, args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """The HTML viewer's and the Gantt chart's paths, when asked for: named, or the trace's with
    another suffix."""
    html = (Path(output).with_suffix(".html") if args.html is True else Path(args.html)) if args.html else None
    png = (Path(output).with_suffix(".png") if args.png is True else Path(args.png)) if args.png else None
    return html, png


def check_trace_outputs(output: str, args: argparse.Namespace, flag: str) -> None:
    """Every file the trace will write, refused before the run or the reading if it cannot be."""
    html, png = trace_outputs(output, args)
    for name, path in ((flag, output), ("--html", html), ("--png", png)):
        if path is not None:
            check_file(name, path)


def write_outputs(events: str, output: str, args: argparse.Namespace) -> None:
    from partrain.atomic import write_atomic
    from partrain.report.gantt import write_gantt
    from partrain.report.timeline_html import timeline_page
    from partrain.report.trace import chrome_trace, measured_timeline, write_trace

    timeline = measured_timeline(events)
    if args.predicted:
        add_prediction(timeline, args.cluster, args.trace_profile_dir)
    html, png = trace_outputs(output, args)
    paths = [write_trace(timeline, output)]
    if html:
        paths.append(write_atomic(html, timeline_page(chrome_trace(timeline), f"partrain timeline: {events}")))
    if png:
        paths.append(write_gantt(timeline, png))
    for note in timeline.notes:
        print(f"note: {note}", file=sys.stderr)
    print("\n".join(f"wrote {p}" for p in paths), file=sys.stderr)


def add_prediction(timeline, cluster: str | None, profile_dir: str | None) -> None:
    """The predicted process, from cached profiles or new ones (announced on stderr)."""
    from partrain.predict.cluster import load_cluster
    from partrain.predict.plan import profile_batch_sizes
    from partrain.profile.cache import RunOptions, hardware_for, load_or_profile
    from partrain.report.trace import add_predicted, run_plan

    if timeline.meta.get("engine") == "scratch":
        timeline.notes.append("a run of the scratch engine: no prediction (the predictor models the PyTorch engine)")
        return
    plan, cfg = run_plan(timeline.meta)
    if plan is None:
        timeline.notes.append("the run recorded no configuration (events from an older partrain): no prediction")
        return
    if cluster:
        hw = load_cluster(cluster)
    else:
        print(f"predicting {plan.label()}: this machine's collectives with {cfg.workers} workers...", file=sys.stderr)
        hw = hardware_for(cfg.workers, profile_dir)[0]
    local = cfg.workers if hw.nodes <= 1 else min(cfg.workers, hw.workers_per_node)
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // local)  # what the run's workers used (set_threads)
    print(f"predicting {plan.label()}: the {cfg.model} profile at {threads} thread(s)...", file=sys.stderr)
    profile, _, _ = load_or_profile(cfg.model, cfg.dataset, profile_batch_sizes(plan.batch_sizes()), threads,
                                    profile_dir, cfg.data_dir, cfg.synthetic, cfg.model_options,
                                    run=RunOptions(None, cfg.precision, cfg.channels_last, cfg.compile))
    add_predicted(timeline, profile, hw, plan)


def cmd_report(args: argparse.Namespace) -> int:
    from partrain.report.html import build_report

    check_file("--output", args.output)
    path = build_report(args.store, args.output, args.events, args.profile_dir, args.title)
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB): open it in a browser", file=sys.stderr)
    return 0
