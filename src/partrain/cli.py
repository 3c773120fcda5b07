"""The ``partrain`` command line: each subcommand is a parser plus a function.

``main`` turns a ``PartrainError`` into one line on stderr and exit status 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from partrain import __version__
from partrain.config import RunConfig
from partrain.spec import SCHEDULES, SPECS
from partrain.commands.args import int_list, add_data_args
from partrain.commands.bench import add_bench_parser, add_results_parser, add_scale_parser
from partrain.commands.predict import add_predict_parser
from partrain.commands.profile import add_profile_parser
from partrain.commands.recommend import add_recommend_parser
from partrain.commands.validate import add_validate_parser
from partrain.errors import PartrainError


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
    g.add_argument("--strategy", default="serial", help=f"one of: {', '.join(SPECS)} (default: serial)")
    g.add_argument("--workers", type=int, help="number of workers (default: 1, or the launcher's world size)")
    g.add_argument("--pp", type=int, help="hybrid: pipeline stages")
    g.add_argument("--dp", type=int, help="hybrid: data-parallel pipeline replicas")
    g.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl when every worker has a GPU, else gloo")
    g.add_argument("--microbatches", type=int, help="pipelines: micro-batches per batch (default: 2 x stages)")
    g.add_argument("--schedule", help=f"pipelines: one of {', '.join(SCHEDULES)} (default: by strategy)")
    g.add_argument("--stages-per-worker", type=int, default=1, help="interleaved-1f1b: stages per pipeline worker")
    g.add_argument("--recompute", action="store_true", help="pipelines: recompute activations in backward")
    g.add_argument("--balance", choices=["time", "params"], default="time", help="pipeline cut balanced by measured time or parameters")
    g.add_argument("--split-points", type=int_list, help="pipelines: explicit first block index of each stage after the first, e.g. 3,6")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="partrain",
        description="How should I parallelize this training job on this hardware, and how fast will it be? "
        "partrain trains with any strategy, benchmarks, predicts and recommends.",
    )
    parser.add_argument("--version", action="version", version=f"partrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("train", help="train a model with a parallelization strategy",
                       description="Train a model with any strategy, on one CPU, on GPUs, or under torchrun/mpirun/srun.")
    add_train_args(p)
    p.set_defaults(func=cmd_train)

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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PartrainError as err:
        print(f"partrain: error: {err}", file=sys.stderr)
        return err.exit_status
    except KeyboardInterrupt:
        print("partrain: interrupted", file=sys.stderr)
        return 130
