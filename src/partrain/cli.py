"""The ``partrain`` command line: each subcommand is a parser plus a function.

``main`` turns a ``PartrainError`` into one line on stderr and exit status 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import traceback

from partrain import __version__
from partrain.commands.args import add_model_options, model_options
from partrain.commands.bench import (
    add_bench_parser,
    add_results_parser,
    add_scale_parser,
)
from partrain.commands.predict import add_predict_parser
from partrain.commands.profile import add_profile_parser
from partrain.commands.recommend import add_recommend_parser
from partrain.commands.validate import add_validate_parser
from partrain.config import RunConfig, add_options, check_numbers
from partrain.errors import DEBUG_ENV, PartrainError
from partrain.report import commands as report_commands
from partrain.scratch.cli import add_engine_option
from partrain.serve.command import add_parser as add_serve_parser
from partrain.sweep.command import add_parser as add_sweep_parser


def add_train_args(p: argparse.ArgumentParser) -> None:
    """Every ``RunConfig`` option, generated from its fields (``config.add_options``)."""
    add_options(p, workers=None)  # without --workers: 1, or the launcher's world size
    add_model_options(p)
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    from partrain.distributed.launch import detect_launcher

    workers = args.workers
    if workers is None:
        info = detect_launcher()
        workers = info.world_size if info.launched else 1
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(RunConfig) if hasattr(args, f.name)}
    return RunConfig(**{**given, "workers": workers, "model_options": model_options(args)})


def summary_line(result) -> str:
    cfg, s = result.config, result.summary()
    parts = [f"{cfg['model']} on {cfg['dataset']}, {cfg['strategy']} x{result.world_size}"]
    if s["test_accuracy"] is not None:
        parts.append(f"test accuracy {s['test_accuracy']:.2%}")
    if s["final_loss"] is not None:
        parts.append(f"final loss {s['final_loss']:.4f}")
    if s["seconds_per_epoch"] is not None:
        parts.append(f"{s['seconds_per_epoch']:.1f} s/epoch" + (" (extrapolated)" if s["epoch_extrapolated"] else ""))
    if s["seconds_per_step"]:
        parts.append(f"{s['seconds_per_step'] * 1e3:.2f} ms/step, {s['samples_per_s']:,.0f} samples/s")
    return ", ".join(parts)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)  # a bad configuration is refused before the runner and its strategies load
    from partrain.runner import run_training

    result = run_training(cfg, show_progress=not (args.quiet or args.json))
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
    import torch

    from partrain.data import dataset_spec
    from partrain.models import build_model, count_parameters, list_models

    spec = dataset_spec(args.dataset)
    print(f"models for {spec.name} {spec.input_shape}, {spec.num_classes} classes:")
    for name in list_models():
        try:
            with torch.device("meta"):  # count parameters without allocating them
                model = build_model(name, spec.input_shape, spec.num_classes)
        except PartrainError:  # an image model on token data, gpt on images
            print(f"  {name:<12} {'-':>14}  (not for {spec.name}'s input shape)")
            continue
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


class OneLineParser(argparse.ArgumentParser):
    """Bad usage is one line, as every other refusal is, with where the usage is explained
    (argparse printed its whole usage block first: 25 lines for ``train --epochs nan``); exit 2."""

    def error(self, message: str):
        self.exit(2, f"partrain: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
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
    report_commands.add_train_trace(p)
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
    report_commands.add_parsers(sub)
    add_sweep_parser(sub)
    add_serve_parser(sub)
    return parser


def _terminate(signum, frame):
    """SIGTERM ends a command as Ctrl-C does: workers stopped, temporary files removed."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    # every line out at once: into a file or pipe, stdout then keeps its place among stderr
    # and the workers' own output (a block buffer would hold it back until exit)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    set_debug = args.debug and DEBUG_ENV not in os.environ
    if set_debug:
        os.environ[DEBUG_ENV] = "1"  # for the workers this process starts
    try:
        check_numbers(vars(args))  # every bad number refused here, in one line, before any work
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
    finally:
        if set_debug:  # main() called in-process (tests, a notebook) leaves the environment as it was
            del os.environ[DEBUG_ENV]
