"""The ``partrain`` command line: each subcommand is a parser plus a function.

``main`` turns a ``PartrainError`` into one line on stderr and exit status 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import traceback

from partrain import __version__
from partrain.config import SCHEDULES, STRATEGIES, RunConfig
from partrain.errors import PartrainError
from partrain.scratch.cli import add_engine_option


def _print_table(table) -> None:
    """A rich table on stdout: the terminal's width, or 200 columns when piped (no wrapping in logs)."""
    from rich.console import Console

    Console(width=None if sys.stdout.isatty() else 200).print(table)


def _positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    """An argparse type: a finite number above 0 (nan, inf and negatives refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="mlp", help="zoo model (see `partrain models`) or package.module:factory (default: mlp)")
    g.add_argument("--dataset", default="mnist", help="dataset (see `partrain datasets`; default: mnist)")
    g.add_argument("--data-dir", help="where the datasets are (default: $PARTRAIN_DATA_DIR, else ~/.partrain/data)")
    g.add_argument("--synthetic", action="store_true", help="generated data of the dataset's shape instead of the real files")
    g.add_argument("--activation", choices=["relu", "sigmoid"], help="hidden activation of the mlp (default: relu)")


def add_train_args(p: argparse.ArgumentParser) -> None:
    add_data_args(p)
    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=int, default=1, help="epochs over the training split (default: 1)")
    g.add_argument("--steps", type=int, help="stop after this many optimizer steps in total")
    g.add_argument("--limit", type=int, help="train on the first N samples only")
    g.add_argument("--eval-limit", type=int, help="evaluate on the first N test samples only")
    g.add_argument("--no-eval", dest="evaluate", action="store_false", help="skip evaluation on the test split")
    g.add_argument("--batch-size", type=int, default=64, help="global batch, summed over data-parallel workers (default: 64)")
    g.add_argument("--lr", type=float, default=0.01, help="learning rate (default: 0.01)")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: 0.9)")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    g.add_argument("--seed", type=int, default=0, help="seeds weights, data order and synthetic data (default: 0)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--strategy", default="serial", help=f"one of: {', '.join(STRATEGIES)} (default: serial)")
    g.add_argument("--workers", type=int, help="number of workers (default: 1, or the launcher's world size)")
    g.add_argument("--pp", type=int, help="hybrid: pipeline stages")
    g.add_argument("--dp", type=int, help="hybrid: data-parallel pipeline replicas")
    g.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl when every worker has a GPU, else gloo")
    g.add_argument("--microbatches", type=int, help="pipelines: micro-batches per batch (default: 2 x stages)")
    g.add_argument("--schedule", help=f"pipelines: one of {', '.join(SCHEDULES)} (default: by strategy)")
    g.add_argument("--stages-per-worker", type=int, default=1, help="interleaved-1f1b: stages per pipeline worker")
    g.add_argument("--recompute", action="store_true", help="pipelines: recompute activations in backward")
    g.add_argument("--balance", choices=["time", "params"], default="time", help="pipeline cut balanced by measured time or parameters")
    g.add_argument("--split-points", type=_int_list, help="pipelines: explicit first block index of each stage after the first, e.g. 3,6")
    g.add_argument("--bucket-mb", type=float, default=25.0, help="ddp: gradient bucket size in MB (default: 25)")
    g.add_argument("--average-every", default="1", help="local-sgd: steps between parameter averages, or 'epoch' (default: 1)")

    g = p.add_argument_group("run")
    g.add_argument("--threads", type=int, help="intra-op threads per worker (default: cores / local workers)")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait for a peer (default: 300)")
    g.add_argument("--checkpoint", help="directory to write a checkpoint into after every epoch")
    g.add_argument("--resume", help="checkpoint directory to resume from")
    g.add_argument("--events", help="directory for per-rank event traces (timelines)")
    g.add_argument("--save-model", help="file to write the trained model's full state_dict into (torch.save)")
    g.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    from partrain.distributed.launch import detect_launcher

    workers = args.workers
    if workers is None:
        info = detect_launcher()
        workers = info.world_size if info.launched else 1
    options = {"activation": args.activation} if args.activation else {}
    return RunConfig(
        model=args.model, dataset=args.dataset, data_dir=args.data_dir, synthetic=args.synthetic, model_options=options,
        epochs=args.epochs, steps=args.steps, limit=args.limit, eval_limit=args.eval_limit, evaluate=args.evaluate,
        batch_size=args.batch_size, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
        optimizer=args.optimizer, seed=args.seed, strategy=args.strategy, workers=workers, pp=args.pp, dp=args.dp,
        backend=args.backend, microbatches=args.microbatches, schedule=args.schedule,
        stages_per_worker=args.stages_per_worker, recompute=args.recompute, balance=args.balance,
        split_points=args.split_points, bucket_mb=args.bucket_mb, average_every=args.average_every,
        threads=args.threads, timeout_s=args.timeout, checkpoint=args.checkpoint, resume=args.resume, events=args.events,
        save_model=args.save_model,
    )


def summary_line(result) -> str:
    cfg, s = result.config, result.summary()
    parts = [f"{cfg['model']} on {cfg['dataset']}, {cfg['strategy']} x{result.world_size}"]
    if s["test_accuracy"] is not None:
        parts.append(f"test accuracy {s['test_accuracy']:.2%}")
    if s["final_loss"] is not None:
        parts.append(f"final loss {s['final_loss']:.4f}")
    if s["seconds_per_epoch"] is not None:
        parts.append(f"{s['seconds_per_epoch']:.1f} s/epoch")
    if s["seconds_per_step"]:
        parts.append(f"{s['seconds_per_step'] * 1e3:.2f} ms/step, {s['samples_per_s']:,.0f} samples/s")
    return ", ".join(parts)


def cmd_train(args: argparse.Namespace) -> int:
    from partrain.runner import run_training

    result = run_training(config_from_args(args), show_progress=not (args.quiet or args.json))
    if result is None:  # not rank 0 of a launched job
        return 0
    if result.partition:
        print(f"pipeline partition:\n{result.partition}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(), default=str))
    else:
        print(summary_line(result))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from partrain.data import dataset_spec
    from partrain.models import build_model, count_parameters, list_models

    import torch

    spec = dataset_spec(args.dataset)
    print(f"models for {spec.name} {spec.input_shape}, {spec.num_classes} classes:")
    for name in list_models():
        with torch.device("meta"):  # count parameters without allocating them
            model = build_model(name, spec.input_shape, spec.num_classes)
        from partrain.models import model_blocks

        print(f"  {name:<12} {count_parameters(model):>14,} parameters  {len(model_blocks(model)):>3} blocks")
    print("or --model package.module:factory for your own (returns an nn.Module, optionally with its blocks)")
    return 0


def cmd_datasets(args: argparse.Namespace) -> int:
    from partrain.data import list_datasets, resolve_data_dir

    print(f"data directory: {resolve_data_dir(args.data_dir)}")
    for spec in list_datasets():
        shape = "x".join(map(str, spec.input_shape))
        kind = "synthetic" if spec.synthetic_only else "real"
        print(f"  {spec.name:<14} {shape:<10} {spec.num_classes:>5} classes {spec.train_size:>9,} train {spec.test_size:>7,} test  {kind:<9} {spec.description}")
    return 0

STORE_HELP = "results store, an SQLite file (default: $PARTRAIN_STORE, else ~/.partrain/results.sqlite)"


def _float_list(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _str_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _print_rows(rows: list[dict], title: str, output: str | None = None) -> None:
    """The results table on stdout (a terminal's width, else 200 columns) or into ``output``."""
    from rich.console import Console

    from partrain.bench.table import results_view

    if output is None:
        _print_table(results_view(rows, title))
        return
    with open(output, "w") as out:
        Console(file=out, width=200).print(results_view(rows, title))


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
    p.add_argument("--list", action="store_true", help="print the suite's cells and exit; runs and stores nothing")
    p.add_argument("--quiet", action="store_true", help="no progress and no table")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from partrain.bench import Store, builtin_suite, fingerprint, load_suite, run_suite

    if (args.suite_file is None) == (args.suite is None):
        raise PartrainError("give a suite file or --suite quick|thesis, one of the two")
    suite = load_suite(args.suite_file) if args.suite_file else builtin_suite(args.suite, fingerprint())
    if args.list:
        for cell in suite.cells():
            print(cell.label)
        return 0
    with Store(args.store) as store:
        rows = store.rows(run_suite(suite, store, force=args.force, data_dir=args.data_dir, show_progress=not args.quiet))
        path = store.path
    if not args.quiet:
        _print_rows(rows, f"suite {suite.name} ({path}); * = extrapolated epoch")
    return 0


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

    with Store(args.store, create=False) as store:
        rows = store.rows()
        path = store.path
    if args.suite:
        rows = [r for r in rows if r["suite"] == args.suite]
    if args.format == "table":
        _print_rows(rows, f"{len(rows)} cells in {path}; * = extrapolated epoch", args.output)
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
    p.add_argument("--strategies", type=_str_list, help="comma-separated (default: serial for sweeps, ddp for scaling)")
    p.add_argument("--workers", type=_int_list, help="comma-separated (default: 1 for sweeps, 1,2,4 for scaling)")
    p.add_argument("--batch-size", type=_int_list, help="batch-size: the values swept; strong: the global batch; "
                   "weak: the batch per worker (default: 16..512 for the sweep, else 64)")
    p.add_argument("--lr", type=_float_list, help="lr: the values swept (default: 0.001,0.01,0.1,0.5), else one (0.01)")
    p.add_argument("--microbatches", type=int, help="pipelines: micro-batches per batch (default: 2 x stages)")
    p.add_argument("--epochs", type=int, help="train whole epochs (the sweeps' default: 1)")
    p.add_argument("--steps", type=int, help="measured steps after warm-up, epoch extrapolated (scaling default: 20)")
    p.add_argument("--warmup-steps", type=int, help="steps left out of the step-time statistics (default: 5)")
    p.add_argument("--limit", type=int, help="train on the first N samples only")
    p.add_argument("--eval-limit", type=int, help="evaluate on the first N test samples only")
    p.add_argument("--synthetic", action="store_true", default=None, help="generated data of the dataset's shape")
    p.add_argument("--threads", type=_positive_int, help="intra-op threads per worker (default: 1)")
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
        "data_dir": args.data_dir,
    }
    suite = study_suite(args.kind, options)
    with Store(args.store) as store:
        rows, png = run_study(args.kind, suite, store, args.plot or f"partrain-{args.kind}.png",
                              force=args.force, show_progress=not args.quiet)
    if not args.quiet:
        _print_rows(rows, f"{args.kind} study; * = extrapolated epoch")
    print(f"plot: {png}")
    return 0


PROFILE_DIR_HELP = "profile cache directory (default: $PARTRAIN_PROFILE_DIR, else ~/.partrain/profiles)"


def add_profile_parser(sub) -> None:
    p = sub.add_parser(
        "profile", help="profile a model block by block, or this machine's collectives (--hardware)",
        description="Measure a model on one worker: per block and batch size forward and backward time, output and "
        "saved-activation bytes, parameters, FLOPs; the optimizer step, the data loading, the process's baseline "
        "memory. With --hardware: time allreduce, all-gather, reduce-scatter, broadcast and send/recv with local "
        "workers over message sizes and fit latency + size / bandwidth. Profiles are cached and reused.",
    )
    add_data_args(p)
    p.add_argument("--batch-sizes", type=_int_list, default=[8, 32], help="batch sizes to profile (default: 8,32)")
    p.add_argument("--threads", type=_positive_int, help="intra-op threads (default: every core for a model, 1 per worker for --hardware)")
    p.add_argument("--hardware", action="store_true", help="profile the collectives instead of a model")
    p.add_argument("--workers", type=_positive_int, default=2, help="--hardware: local workers (default: 2; a launcher's world size under one)")
    p.add_argument("--max-mb", type=_positive_float, default=64.0, help="--hardware: largest message in MiB (default: 64)")
    p.add_argument("--profile-dir", help=PROFILE_DIR_HELP)
    p.add_argument("--refresh", action="store_true", help="measure again even when a cached profile exists")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    import os

    from partrain.profile.collectives import default_sizes
    from partrain.profile.hardware import hardware_path, hardware_table, profile_dir, profile_hardware
    from partrain.profile.model import load_or_profile, profile_table

    if args.hardware:
        hw = profile_hardware(args.workers, default_sizes(int(args.max_mb * 2**20)), threads=args.threads or 1)
        if hw is None:  # a launched worker other than rank 0
            return 0
        path = hw.save(hardware_path(profile_dir(args.profile_dir), hw.nodes * hw.workers_per_node))
        print(json.dumps(hw.to_dict()) if args.json else "", end="\n" if args.json else "")
        if not args.json:
            _print_table(hardware_table(hw))
        print(f"hardware profile: {path}", file=sys.stderr)
        return 0
    options = {"activation": args.activation} if args.activation else {}
    profile, path, reused = load_or_profile(
        args.model, args.dataset, args.batch_sizes, args.threads or os.cpu_count() or 1, args.profile_dir,
        args.data_dir, args.synthetic, options, refresh=args.refresh,
    )
    if args.json:
        print(json.dumps(profile.to_dict()))
    else:
        _print_table(profile_table(profile))
    _announce_profile(profile, path, reused)
    return 0


def _announce_profile(profile, path, reused: bool, extra: str = "") -> None:
    """On stderr: which model profile a command used, and whether the machine was busy when it was taken."""
    from partrain.profile.model import busy_warning

    print(f"model profile: {path}{' (cached)' if reused else ''}{extra}", file=sys.stderr)
    if warning := busy_warning(profile):
        print(warning, file=sys.stderr)


def add_predict_parser(sub) -> None:
    p = sub.add_parser(
        "predict", help="predict time per step and epoch, memory and breakdown for every strategy",
        description="Predict, for every strategy and the parameters that matter (pp x dp, micro-batches, schedule, "
        "bucket size, averaging period), seconds per step and per epoch, peak memory per worker and the breakdown "
        "compute / exposed communication / pipeline bubble / optimizer / data, from a model profile and this "
        "machine's hardware profile (each measured first if not cached) or a cluster file.",
    )
    add_data_args(p)
    p.add_argument("--workers", type=_positive_int, default=1, help="number of workers (default: 1)")
    p.add_argument("--batch-size", type=_positive_int, default=64, help="global batch (default: 64)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: 0.9)")
    p.add_argument("--threads", type=_positive_int, help="intra-op threads per worker (default: cores / local workers, as train)")
    p.add_argument("--strategies", type=_str_list, help="only these strategies (comma-separated)")
    p.add_argument("--cluster", help="cluster TOML to predict for instead of this machine (see examples/cluster.toml)")
    p.add_argument("--profile-batch-sizes", type=_int_list, help="model profile batch sizes (default: covering the plans)")
    p.add_argument("--profile-dir", help=PROFILE_DIR_HELP)
    p.add_argument("--all", action="store_true", help="also list the plans that cannot run, with the reason")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    p.set_defaults(func=cmd_predict)


def cmd_predict(args: argparse.Namespace) -> int:
    import os

    from partrain.predict.strategies import (
        candidate_plans, enumerate_plans, predict_plan, predictions_table, profile_batch_sizes,
    )
    from partrain.profile.hardware import hardware_for, load_cluster
    from partrain.profile.model import load_or_profile

    if args.cluster:
        hw = load_cluster(args.cluster)
    else:
        hw, hw_path, hw_reused = hardware_for(args.workers, args.profile_dir)
        if not hw_reused:
            print(f"measured this machine's collectives with {args.workers} workers: {hw_path}", file=sys.stderr)
    local = args.workers if hw.nodes <= 1 else min(args.workers, hw.workers_per_node)
    cores_here = os.cpu_count() or 1
    threads = args.threads or max(1, cores_here // (1 if args.cluster else local))
    options = {"activation": args.activation} if args.activation else {}
    plans = candidate_plans(args.workers, args.batch_size)  # the profile is sized to cover every plan
    sizes = args.profile_batch_sizes or profile_batch_sizes([b for plan in plans for b in plan.batch_sizes()])
    profile, path, reused = load_or_profile(args.model, args.dataset, sizes, threads, args.profile_dir, args.data_dir,
                                            args.synthetic, options)
    checked = enumerate_plans(profile, args.workers, args.batch_size, args.optimizer, args.momentum, args.threads,
                              with_invalid=True)
    wanted = [(plan, why) for plan, why in checked if not args.strategies or plan.strategy in args.strategies]
    predictions = [predict_plan(profile, hw, plan) for plan, why in wanted if why is None]
    limit = hw.memory_limit_per_worker(local)
    if args.json:
        print(json.dumps({"hardware": hw.description, "memory_limit_bytes": limit, "model_profile": str(path),
                          "predictions": [p.to_dict() for p in predictions],
                          "invalid": [{"plan": p.label(), "reason": why} for p, why in wanted if why and args.all]}))
        return 0
    title = f"{args.model} on {args.dataset}, {args.workers} worker(s), batch {args.batch_size}, {hw.description}"
    _print_table(predictions_table(predictions, title, limit))
    for plan, why in wanted:
        if why and args.all:
            print(f"  cannot run {plan.label()}: {why}")
    _announce_profile(profile, path, reused, f"; memory limit {limit / 2**30:.1f} GiB per worker")
    return 0


def add_validate_parser(sub) -> None:
    p = sub.add_parser(
        "validate", help="hold predictions against the results store: error per strategy, memory, worst cases",
        description="Predict every successful cell of the results store measured on this machine, with the "
        "configuration it ran, and report the mean absolute percentage error of the time per step per strategy and "
        "overall, the memory error, how often the predicted fastest strategy was the measured fastest, a "
        "predicted-against-measured scatter plot and the worst cases.",
    )
    p.add_argument("--store", help=STORE_HELP)
    p.add_argument("--data-dir", help="where the datasets are (default: $PARTRAIN_DATA_DIR, else ~/.partrain/data)")
    p.add_argument("--profile-dir", help=PROFILE_DIR_HELP)
    p.add_argument("--plot", default="partrain-validate.png", help="scatter plot PNG (default: partrain-validate.png)")
    p.add_argument("--worst", type=int, default=10, help="worst cases to list (default: 10)")
    p.add_argument("--recommendations", action="store_true",
                   help="judge the recommender: for every job measured under several plans, was its pick the measured "
                   "fastest (hit rate), how much slower if not (regret), and Kendall tau of the orderings; once as "
                   "recommend ranks (plans that train as serial does) and once as recommend --async ranks")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    from partrain.bench import Store
    from partrain.predict.strategies import profile_batch_sizes
    from partrain.predict.validate import plot_scatter, report_tables, validate
    from partrain.profile.hardware import fingerprint, hardware_for
    from partrain.profile.model import busy_warning, load_or_profile

    with Store(args.store, create=False) as store:
        rows = store.rows()

    def profile_for(cfg, needed):
        profile = load_or_profile(cfg.model, cfg.dataset, profile_batch_sizes(needed), cfg.threads or 1,
                                  args.profile_dir, args.data_dir, cfg.synthetic, cfg.model_options)[0]
        if warning := busy_warning(profile):
            print(warning, file=sys.stderr)
        return profile, profile.profile_seconds

    report = validate(rows, profile_for, lambda workers: hardware_for(workers, args.profile_dir)[0], fingerprint())
    if not report.cases:
        raise PartrainError("no successful cells measured on this machine in the store: run `partrain bench` first")
    if args.recommendations:
        return _report_recommendations(report, args.json)
    png = plot_scatter(report, args.plot)
    if args.json:
        print(json.dumps({**report.to_dict(), "plot": str(png)}))
        return 0
    for table in report_tables(report, args.worst):
        _print_table(table)
    for line in report.skipped:
        print(f"  skipped {line}")
    print(f"plot: {png}")
    return 0


def _report_recommendations(report, as_json: bool) -> int:
    """The recommender judged twice: as ``recommend`` ranks by default (plans that train as
    serial does) and as ``recommend --async`` ranks (local SGD and Hogwild compete too)."""
    from partrain.recommend import recommendation_outcomes, summarize_outcomes

    modes = {"synchronous": recommendation_outcomes(report.cases),
             "with_async": recommendation_outcomes(report.cases, include_async=True)}
    if not modes["with_async"]:
        raise PartrainError("no job in the store was measured under two or more plans: run a suite with several strategies")
    summaries = {mode: {**summarize_outcomes(outcomes), "profile_cost": report.profile_cost()}
                 for mode, outcomes in modes.items()}
    if as_json:
        print(json.dumps({mode: {"summary": summaries[mode], "groups": [o.__dict__ for o in outcomes]}
                          for mode, outcomes in modes.items()}))
        return 0
    named = (("synchronous", "recommend", "plans that train as serial does"),
             ("with_async", "recommend --async", "local SGD competes too"))
    for mode, command, what in named:
        if modes[mode]:
            _print_table(_outcome_table(modes[mode], f"{command} ({what}): the pick against the measured fastest"))
    for mode, command, _ in named:
        s = summaries[mode]
        if s["groups"]:
            print(f"{command}: {s['groups']} jobs, top-1 hit rate {s['hit_rate']:.0%} "
                  f"({s['hit_rate_within_noise']:.0%} counting picks the benchmark's repeats cannot tell from the "
                  f"fastest), regret mean {s['mean_regret']:.1%} (worst {s['worst_regret']:.1%}), "
                  f"Kendall tau {s['kendall_tau']:.2f} ({s['kendall_tau_within_noise']:.2f} with pairs whose repeats "
                  "overlap counted as ties)")
    print(f"profiling cost {report.profile_cost():.1%} of the benchmark time of the cells it predicts")
    return 0


def _outcome_table(outcomes, title: str):
    from rich.table import Table

    table = Table(title=title)
    for name in ("job", "plans", "picked (predicted fastest)", "measured fastest", "regret", "Kendall tau"):
        table.add_column(name)
    for o in outcomes:
        table.add_row(o.key, str(o.plans), o.picked, o.best + (" (repeats overlap the pick's)" if o.tie else ""),
                      f"{o.regret:.1%}", f"{o.tau:.2f}")
    return table


def add_recommend_parser(sub) -> None:
    p = sub.add_parser(
        "recommend", help="the fastest plan that fits, why, and the command that runs it",
        description="Enumerate every plan (strategy x workers up to N x pp/dp split x micro-batches x schedule x "
        "batch), drop those that cannot run or do not fit in memory (saying why), rank the rest by predicted time "
        "per epoch, explain the winner, and print the command that runs it. Profiles are measured first when not "
        "cached. --run trains the winner straight away and prints the measured step time beside the prediction.",
    )
    add_data_args(p)
    p.add_argument("--workers", type=_positive_int, help="at most this many workers (default: the cluster's, else 1)")
    p.add_argument("--cluster", help="cluster TOML to recommend for instead of this machine (see examples/cluster.toml)")
    p.add_argument("--batch-size", type=_positive_int, help="fix the global batch (default: free, 32/64/128 per worker)")
    p.add_argument("--memory-limit", help="memory per worker, e.g. 2GB (default: the device's, or RAM / local workers)")
    p.add_argument("--objective", choices=["time", "memory"], default="time", help="rank by time per epoch (default) or memory")
    p.add_argument("--threads", type=_positive_int, help="intra-op threads per worker (default: cores / local workers, as train)")
    p.add_argument("--async", dest="include_async", action="store_true",
                   help="also rank local-sgd and hogwild, which do not reproduce serial training")
    p.add_argument("--top", type=int, default=8, help="plans to show (default: 8)")
    p.add_argument("--all", action="store_true", help="list every plan that was dropped, with the reason")
    p.add_argument("--profile-dir", help=PROFILE_DIR_HELP)
    p.add_argument("--refresh", action="store_true", help="profile again even when cached")
    p.add_argument("--run", action="store_true", help="train the recommended plan now")
    p.add_argument("--steps", type=int, default=100, help="--run: optimizer steps to train (default: 100)")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.set_defaults(func=cmd_recommend)


def cmd_recommend(args: argparse.Namespace) -> int:
    import os
    import time

    from rich.console import Console

    from partrain.predict.strategies import profile_batch_sizes
    from partrain.profile.hardware import hardware_for, load_cluster
    from partrain.profile.model import load_or_profile
    from partrain.recommend import needed_batch_sizes, parse_bytes, recommend, recommendation_table

    console = Console(stderr=True)
    hw = load_cluster(args.cluster) if args.cluster else None
    workers = args.workers or (hw.nodes * hw.workers_per_node if hw else 1)
    if workers < 1:
        raise PartrainError(f"--workers must be at least 1, got {workers}")
    start, profiled = time.perf_counter(), []
    if hw is None:
        with console.status(f"measuring this machine's collectives with {workers} workers (cached afterwards)..."):
            hw, _, reused = hardware_for(workers, args.profile_dir)
        profiled += [] if reused else ["collectives"]
    sizes = profile_batch_sizes(needed_batch_sizes(workers, args.batch_size))
    options = {"activation": args.activation} if args.activation else {}

    def profile_for(threads: int):
        threads = min(threads, os.cpu_count() or 1)  # a cluster's cores are not here: profile on ours
        with console.status(f"profiling {args.model} on {args.dataset} with {threads} thread(s), batches {sizes}..."):
            profile, _, reused = load_or_profile(args.model, args.dataset, sizes, threads, args.profile_dir, args.data_dir,
                                                 args.synthetic, options, refresh=args.refresh)
        profiled.extend([] if reused else [f"{args.model} at {threads} thread(s)"])
        return profile

    limit = parse_bytes(args.memory_limit) if args.memory_limit else None
    rec = recommend(profile_for, hw, workers, args.batch_size, limit, args.objective, args.threads, args.include_async)
    rec.data_dir, rec.profile_seconds, rec.profile_reused = args.data_dir, time.perf_counter() - start, not profiled
    measured = _run_recommended(rec, args) if args.run else None
    if args.json:
        print(json.dumps({**rec.to_dict(), "measured": measured}, default=str))
        return 0
    if profiled:
        print(f"profiled {', '.join(profiled)} in {rec.profile_seconds:.1f} s (cached for next time)", file=sys.stderr)
    _print_table(recommendation_table(rec, args.top))
    print(f"\n{rec.explanation()}\n")
    dropped = rec.rejected if args.all else rec.rejected[:3]
    if rec.rejected:
        print(f"{len(rec.rejected)} plans dropped{' (first 3; --all lists them)' if not args.all else ''}:")
        for plan, reason in dropped:
            print(f"  {plan.label()} on {plan.workers} workers, batch {plan.batch_size}: {reason}")
    print(f"\nrun it here:\n  {rec.local_command()}\nor on each node, under torchrun:\n  {rec.torchrun_command()}")
    if measured:
        print(f"\nmeasured {measured['seconds_per_step'] * 1e3:.2f} ms/step over {measured['steps']} steps, predicted "
              f"{measured['predicted_seconds_per_step'] * 1e3:.2f} ms/step ({measured['error']:+.0%})")
    return 0


def _run_recommended(rec, args: argparse.Namespace) -> dict:
    """Train the winner for ``--steps`` steps; its measured step time beside the prediction."""
    from partrain.runner import run_training

    cfg = rec.winner.plan.to_config(args.model, args.dataset, data_dir=args.data_dir, synthetic=args.synthetic,
                                    model_options={"activation": args.activation} if args.activation else {},
                                    steps=args.steps, eval_limit=1000)
    result = run_training(cfg, show_progress=not args.json)
    if result is None:
        return {}
    summary, predicted = result.summary(), rec.winner.median_step_s
    print(f"trained {rec.winner.plan.label()}: test accuracy {summary['test_accuracy']:.2%} after {summary['steps']} steps",
          file=sys.stderr)
    return {**summary, "predicted_seconds_per_step": predicted,
            "error": summary["seconds_per_step"] / predicted - 1 if summary["seconds_per_step"] else None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="partrain",
        description="How should I parallelize this training job on this hardware, and how fast will it be? "
        "partrain trains with any strategy, benchmarks, predicts and recommends.",
    )
    parser.add_argument("--version", action="version", version=f"partrain {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, also print the traceback behind it (your model's code, say)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("train", help="train a model with a parallelization strategy",
                       description="Train a model with any strategy, on one CPU, on GPUs, or under torchrun/mpirun/srun.")
    add_train_args(p)
    p.set_defaults(func=cmd_train)
    add_engine_option(p)  # --engine scratch routes to partrain.scratch

    p = sub.add_parser("models", help="list the model zoo with parameter counts", description="List the model zoo.")
    p.add_argument("--dataset", default="mnist", help="count parameters for this dataset's input shape (default: mnist)")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("datasets", help="list the datasets", description="List the datasets and where partrain looks for them.")
    p.add_argument("--data-dir", help="data directory to report (default: $PARTRAIN_DATA_DIR, else ~/.partrain/data)")
    p.set_defaults(func=cmd_datasets)

    add_bench_parser(sub)
    add_results_parser(sub)
    add_scale_parser(sub)
    add_profile_parser(sub)
    add_predict_parser(sub)
    add_validate_parser(sub)
    add_recommend_parser(sub)
    return parser


def _terminate(signum, frame):
    """SIGTERM ends a command as Ctrl-C does: workers stopped, temporary files removed."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.func(args)
    except PartrainError as err:
        if args.debug and err.__cause__ is not None:
            traceback.print_exception(err.__cause__, file=sys.stderr)
        print(f"partrain: error: {err}", file=sys.stderr)
        return err.exit_status
    except KeyboardInterrupt:
        print("partrain: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `partrain results | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
