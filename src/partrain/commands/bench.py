"""``partrain bench``, ``results`` and ``scale``: measure suites into the results store and show them."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from partrain.commands.args import (
    STORE_HELP,
    float_list,
    int_list,
    print_table,
    str_list,
)
from partrain.errors import PartrainError
from partrain.outputs import check_file


def print_rows(rows: list[dict], title: str, output: str | None = None) -> None:
    """The results table on stdout (a terminal's width, else 200 columns) or into ``output``.

    Into a file it is rendered in memory first (a few hundred bytes a row) and written whole:
    an error or Ctrl-C while rendering leaves the file as it was, as the CSV and JSON exports do."""
    import io

    from rich.console import Console

    from partrain.atomic import write_atomic
    from partrain.bench.table import results_view

    if output is None:
        print_table(results_view(rows, title))
        return
    console = Console(file=io.StringIO(), width=200)
    console.print(results_view(rows, title))
    write_atomic(output, console.file.getvalue(), text=True)


def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench", help="measure a suite (model x dataset x strategy x workers) into the results store",
        description="Run every cell of a benchmark suite in fresh worker processes and store what it measured. "
        "Cells already measured on this hardware are not run again (--force runs them again); "
        "cells that cannot run are stored as skipped with the reason.",
    )
    p.add_argument("suite_file", nargs="?", metavar="SUITE.toml", help="suite file (see suites/quick.toml)")
    p.add_argument("--suite", choices=["quick", "thesis"], help="a built-in suite instead of a file; thesis is sized to this machine")
    p.add_argument("--store", help=STORE_HELP)
    p.add_argument("--data-dir", help="where the datasets are (default: the suite's data_dir, else $PARTRAIN_DATA_DIR)")
    p.add_argument("--force", action="store_true", help="run cells again even when already measured on this hardware")
    p.add_argument("--profile-dir", help="where --profile's profiles and, across emulated nodes, each link's hardware "
                   "profile are kept (default: $PARTRAIN_PROFILE_DIR, else ~/.partrain/profiles)")
    p.add_argument("--profile", action="store_true",
                   help="take the profiles `partrain validate` predicts these cells from, fresh, right before the first "
                   "cell that needs each (a model's before its first cell, the collectives' before the first cell of "
                   "that many workers), into --profile-dir: validate then measures nothing, and its profiles saw the "
                   "machine as the cells did")
    p.add_argument("--repeats", type=int, metavar="N",
                   help="run every cell N times, minutes apart, instead of the suite's repeats: validate holds each "
                   "cell at the median of its runs, reports how far they spread, and counts a pick the runs cannot "
                   "order from the fastest as a tie")
    p.add_argument("--rerun-over", type=float, metavar="F",
                   help="with repeats: run a cell once more (twice at most), after the others, where its repeats' step "
                   "times lie more than F apart (0.15: the slowest 15%% over the fastest), instead of the suite's "
                   "rerun_over: validate holds it at the median of its runs")
    p.add_argument("--list", action="store_true", help="print the suite's cells and exit; runs and stores nothing")
    p.add_argument("--quiet", action="store_true", help="no progress and no table")
    from partrain.config import add_options

    # train's own flags, for every cell: instead of the suite's precisions / channels_last / compile
    add_options(p, ["precision", "channels_last", "compile"], precision=None)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from partrain.bench import Store, builtin_suite, fingerprint, load_suite, run_suite

    if (args.suite_file is None) == (args.suite is None):
        raise PartrainError("give a suite file or --suite quick|thesis, one of the two")
    suite = load_suite(args.suite_file) if args.suite_file else builtin_suite(args.suite, fingerprint())
    given = {"precisions": (args.precision,) if args.precision else None,
             "channels_last": args.channels_last or None, "compile": args.compile or None, "repeats": args.repeats,
             "rerun_over": args.rerun_over}
    if any(v is not None for v in given.values()):
        suite = suite.replace(**{k: v for k, v in given.items() if v is not None})
    if args.list:
        for cell in suite.cells():
            print(cell.label)
        return 0
    from partrain.bench.nodes import refusal

    if reason := refusal(suite.cells()):  # before the store is made: a refused suite leaves nothing
        raise PartrainError(reason)
    with Store(args.store) as store:
        rows = store.rows(run_suite(suite, store, force=args.force, data_dir=args.data_dir, show_progress=not args.quiet,
                                    profile_dir=args.profile_dir, profile=args.profile))
        path = store.path
    if not args.quiet:
        print_rows(rows, f"suite {suite.name} ({path}); * = extrapolated epoch")
    return _verdict(rows, suite.name, path)


def _verdict(rows: list[dict], name: str, path) -> int:
    """0 when a cell is measured (now or before); 1, said in one line, when none is (each one
    failed, timed out or cannot run here): a script must not go on as if it had figures."""
    if not rows or any(r["status"] == "ok" for r in rows):
        return 0
    counts = ", ".join(f"{n} {status}" for status, n in sorted(Counter(r["status"] for r in rows).items()))
    print(f"partrain: no cell of suite {name} was measured ({counts}); `partrain results --store {path} --suite {name}` "
          "gives each one's reason", file=sys.stderr)
    return 1


def add_results_parser(sub) -> None:
    p = sub.add_parser("results", help="show or export the results store",
                       description="Show the stored benchmark cells as a table, or export every stored field as CSV or JSON.")
    p.add_argument("--store", help=STORE_HELP)
    p.add_argument("--suite", help="only the cells of this suite or study (e.g. quick, scale-strong)")
    p.add_argument("--format", choices=["table", "csv", "json"], default="table", help="default: table")
    p.add_argument("--output", help="write to this file instead of stdout")
    p.set_defaults(func=cmd_results)


def cmd_results(args: argparse.Namespace) -> int:
    from partrain.bench import Store
    from partrain.bench.table import write_export

    if args.output is not None:
        check_file("--output", args.output)
    with Store(args.store, create=False) as store:
        rows = store.rows()
        path = store.path
    if args.suite:
        names = sorted({r["suite"] for r in rows})
        rows = [r for r in rows if r["suite"] == args.suite]
        if not rows:  # a misspelt name printed an empty table
            raise PartrainError(f"no suite {args.suite!r} in {path}: it holds {', '.join(names) or 'no cells'}")
    if args.format == "table":
        print_rows(rows, f"{len(rows)} cells in {path}; * = extrapolated epoch", args.output)
    else:
        write_export(rows, args.format, args.output)
    return 0


def add_scale_parser(sub) -> None:
    p = sub.add_parser(
        "scale", help="scaling study: batch-size or lr sweep, strong or weak scaling, with a PNG plot",
        description="Run a scaling study into the results store and plot it. batch-size: time per epoch and accuracy "
        "against the global batch, with the perfect-scaling / diminishing-returns / maximal-data-parallelism regimes. "
        "lr: accuracy against the learning rate. strong: speedup and efficiency against workers at a fixed global "
        "batch. weak: throughput against workers at a fixed batch per worker.",
    )
    p.add_argument("kind", choices=["batch-size", "lr", "strong", "weak"])
    p.add_argument("--model", default="mlp", help="zoo model or package.module:factory (default: mlp)")
    p.add_argument("--dataset", default="mnist", help="default: mnist")
    p.add_argument("--strategies", type=str_list, help="comma-separated (default: serial for sweeps, ddp for scaling)")
    p.add_argument("--workers", type=int_list, help="comma-separated (default: 1 for sweeps, 1,2,4 for scaling)")
    p.add_argument("--batch-size", type=int_list, help="batch-size: the values swept; strong: the global batch; "
                   "weak: the batch per worker (default: 16..512 for the sweep, else 64)")
    p.add_argument("--lr", type=float_list, help="lr: the values swept (default: 0.001,0.01,0.1,0.5), else one (0.01)")
    p.add_argument("--microbatches", type=int, help="pipelines: micro-batches per batch (default: 2 x stages)")
    p.add_argument("--engine", type=str_list, help="comma-separated: torch (default), scratch (the NumPy engine, "
                   "its own serial baseline), or torch,scratch for both engines' curves on one plot")
    p.add_argument("--epochs", type=int, help="train whole epochs (the sweeps' default: 1)")
    p.add_argument("--steps", type=int, help="measured steps after warm-up, epoch extrapolated (scaling default: 20)")
    p.add_argument("--warmup-steps", type=int, help="steps left out of the step-time statistics (default: 5)")
    p.add_argument("--limit", type=int, help="train on the first N samples only")
    p.add_argument("--eval-limit", type=int, help="evaluate on the first N test samples only")
    p.add_argument("--synthetic", action="store_true", default=None, help="generated data of the dataset's shape")
    p.add_argument("--threads", type=int, help="intra-op threads per worker (default: 1)")
    p.add_argument("--repeats", type=int, help="runs of every cell (default: 1)")
    p.add_argument("--timeout", type=float, help="seconds per cell (default: 600)")
    p.add_argument("--data-dir", help="where the datasets are (default: $PARTRAIN_DATA_DIR, else ~/.partrain/data)")
    p.add_argument("--store", help=STORE_HELP)
    p.add_argument("--force", action="store_true", help="run cells again even when already measured on this hardware")
    p.add_argument("--plot", help="PNG file to draw (default: partrain-KIND.png)")
    p.add_argument("--quiet", action="store_true", help="no progress and no table")
    p.set_defaults(func=cmd_scale)


def cmd_scale(args: argparse.Namespace) -> int:
    from partrain.bench import Store
    from partrain.bench.scaling import run_study, study_suite

    options = {
        "models": [args.model], "datasets": [args.dataset], "strategies": args.strategies, "workers": args.workers,
        "batch_sizes": args.batch_size, "lrs": args.lr, "microbatches": args.microbatches, "epochs": args.epochs,
        "steps": args.steps, "warmup_steps": args.warmup_steps, "limit": args.limit, "eval_limit": args.eval_limit,
        "synthetic": args.synthetic, "threads": args.threads, "repeats": args.repeats, "timeout": args.timeout,
        "data_dir": args.data_dir, "engine": args.engine,
    }
    suite = study_suite(args.kind, options)
    plot = check_file("--plot", args.plot or f"partrain-{args.kind}.png")
    with Store(args.store) as store:
        rows, png = run_study(args.kind, suite, store, plot,
                              force=args.force, show_progress=not args.quiet)
    if not args.quiet:
        print_rows(rows, f"{args.kind} study; * = extrapolated epoch")
    print(f"plot: {png}")
    return 0
