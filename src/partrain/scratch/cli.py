"""``partrain train --engine scratch``: the scratch engine behind the train command's options.

``add_engine_option(train_parser)`` adds ``--engine`` (and the few options only the scratch
engine has) and routes ``--engine scratch`` here; ``--engine torch`` (the default) runs the
train command as before.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from partrain.errors import PartrainError

# train options the scratch engine does not have, with their "not given" value
MAX_WIDTH = 65536  # a hidden layer's width: 784 x 65536 float64 weights and their gradients are 0.8 GB already
_TORCH_ONLY = {"pp": None, "dp": None, "schedule": None, "recompute": False, "split_points": None,
               "checkpoint": None, "resume": None, "save_model": None, "stages_per_worker": 1,
               "precision": "fp32", "channels_last": False, "compile": False,  # --dtype is the scratch engine's numerics
               "min_seconds": 0.0}


def add_engine_option(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--engine", choices=["torch", "scratch"], default="torch",
                   help="torch: PyTorch's modules and distributed strategies (default); scratch: the NumPy engine "
                        "with hand-written forward/backward and parallelism (strategies serial, threads, ddp, "
                        "hybrid, model-parallel, local-sgd; --threads T is threads per process)")
    g.add_argument("--dtype", choices=["float32", "float64"], help="scratch: the arrays' type (default: float32)")
    torch_train = p.get_default("func")

    def train(args: argparse.Namespace) -> int:
        if args.engine == "scratch":
            return run(args)
        if args.dtype is not None:
            raise PartrainError("--dtype belongs to the scratch engine: add --engine scratch")
        return torch_train(args)

    p.set_defaults(func=train)


def config_from_args(args: argparse.Namespace):
    from partrain.scratch.train import ScratchConfig

    if args.model != "mlp":
        raise PartrainError(f"the scratch engine builds the mlp only, not {args.model!r}: use --model mlp")
    from partrain.data.tokens import is_token_dataset

    if is_token_dataset(args.dataset):  # token ids into a Linear layer: a loss of NaN, exit 0, before
        raise PartrainError(f"the scratch engine's mlp reads images, not the token sequences of {args.dataset!r}: "
                            "train gpt with the torch engine")
    if args.optimizer != "sgd":
        raise PartrainError("the scratch engine has SGD with momentum only: leave out --optimizer")
    if args.backend not in (None, "gloo"):
        raise PartrainError("the scratch engine talks over gloo only: leave out --backend")
    for name, unset in _TORCH_ONLY.items():
        if getattr(args, name) != unset:
            raise PartrainError(f"--{name.replace('_', '-')} is an option of the torch engine; "
                                "leave it out with --engine scratch")
    from partrain.distributed.spawn import MAX_PER_CORE, check_local_workers

    check_local_workers(args.workers or 1, "the scratch engine runs on this machine")  # as train's
    cores, workers, threads = os.cpu_count() or 1, args.workers or 1, args.threads or 1
    if workers * threads > MAX_PER_CORE * cores:
        raise PartrainError(f"--workers {workers} x --threads {threads} on a machine with {cores} cores: "
                            f"at most {MAX_PER_CORE * cores} threads in all")
    if args.hidden is not None and not all(0 < width <= MAX_WIDTH for width in args.hidden):
        raise PartrainError(f"--hidden takes layer widths from 1 to {MAX_WIDTH}, got {','.join(map(str, args.hidden))}")
    every = args.average_every
    if every != "epoch":
        try:
            every = int(every)
        except ValueError:
            raise PartrainError(f"--average-every takes a number of steps or 'epoch', got {every!r}") from None
    return ScratchConfig(
        dataset=args.dataset, hidden=tuple(args.hidden or (256, 128)), activation=args.activation,
        dtype=args.dtype or "float32", epochs=args.epochs, steps=args.steps, limit=args.limit,
        eval_limit=args.eval_limit, evaluate=args.evaluate, batch_size=args.batch_size, lr=args.lr,
        momentum=args.momentum, weight_decay=args.weight_decay, seed=args.seed, strategy=args.strategy,
        workers=args.workers or 1, threads=args.threads or 1, microbatches=args.microbatches,
        average_every=None if every == "epoch" else every, timeout_s=args.timeout_s, data_dir=args.data_dir,
        synthetic=args.synthetic, events=args.events,
    )


def phases_line(result) -> str:
    """Where rank 0's step time went, e.g. 'compute 1.20 ms, comm 0.40 ms, update 0.10 ms'."""
    return ", ".join(f"{name} {ms:.2f} ms" for name, ms in result.phases_ms.items())


def run(args: argparse.Namespace) -> int:
    from partrain.outputs import check_dir
    from partrain.report.commands import check_trace_outputs

    if args.events is not None:  # where it writes, checked before it trains (as the torch engine's)
        check_dir("--events", args.events)
    if args.trace:
        check_trace_outputs(args.trace, args, "--trace")
    if args.trace:  # --trace FILE: the events into a temporary directory (unless --events), then the trace
        from partrain.report.commands import write_outputs

        with tempfile.TemporaryDirectory(prefix="partrain-events-") as tmp:
            args.events = args.events or tmp
            printed = _run(args)
            if printed:  # rank 0: every rank has written its events by now
                write_outputs(args.events, args.trace, args)
        return 0
    _run(args)
    return 0


def _run(args: argparse.Namespace) -> bool:
    """Train and print the result; False on a rank of mpirun's other than 0 (nothing printed)."""
    from partrain.cli import summary_line
    from partrain.scratch.train import run as run_scratch

    result = run_scratch(config_from_args(args), show_progress=not (args.quiet or args.json))
    if result is None:  # a rank of mpirun's other than 0: rank 0 prints the run
        return False
    if args.json:
        print(json.dumps(result.to_dict(), default=str))
    else:
        print(f"{summary_line(result)} [scratch engine; per step: {phases_line(result)}]")
    return True
