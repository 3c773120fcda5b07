"""The run vocabulary: what to train (``Job``), how to parallelize it (``Parallelism``), and
the machinery around the run (``Machinery``), joined in one ``RunConfig``.

Every field says once, in its metadata (``option``), its command-line flag, its help, its
group and the range of values it accepts. From that one place ``add_options`` builds the
argparse options (each default written once, here), ``check_numbers`` refuses every bad
number with one line naming the option and its range (``--lr must be a finite number > 0,
got nan``) before any worker starts, and ``RunConfig.to_argv`` writes the command line that
runs a configuration (what ``recommend`` prints and ``bench`` runs). ``ParallelDims`` is the
validated (pp, dp) shape of the worker grid, after torchtitan's ``ParallelDims``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field

from partrain.errors import PartrainError
from partrain.spec import SCHEDULES, SPECS, StrategySpec, strategy_spec


@dataclass(frozen=True)
class Option:
    """How a field appears on the command line and which values it accepts."""

    help: str
    group: str
    flag: str | None = None  # default: --field-name; "" for a field with no flag of its own
    lo: float | None = None  # smallest value accepted (inclusive unless lo_open)
    hi: float | None = None  # largest value accepted (inclusive unless hi_open)
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple | None = None
    negate: str | None = None  # a boolean default True set False by this flag (--no-eval)


def option(default, help: str, group: str, **kw):
    """A dataclass field whose metadata is its ``Option``."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"option": Option(help, group, **kw)})
    return field(default=default, metadata={"option": Option(help, group, **kw)})


DATA, OPTIM, PARALLEL, RUN, SPEED = "model and data", "optimization", "parallelism", "run", "speed"
PRECISIONS = ("fp32", "bf16", "fp16")
MAX_THREADS = 1024  # intra-op threads per worker: beyond this torch's pool fails without a message
FLOAT32_MAX = 3.4028234663852886e38  # the optimizers hold lr and weight decay as float32 tensors: above this, a traceback


@dataclass
class Job:
    """What to train, on what, for how long, with which optimizer. Defaults are the main job:
    an MLP on MNIST."""

    model: str = option("mlp", "zoo model (see `partrain models`) or package.module:factory", DATA)
    dataset: str = option("mnist", "dataset (see `partrain datasets`)", DATA)
    data_dir: str | None = option(None, "where the datasets are (default: $PARTRAIN_DATA_DIR, else ~/.partrain/data)", DATA)
    synthetic: bool = option(False, "generated data of the dataset's shape instead of the real files", DATA)
    model_options: dict = option({}, "keyword arguments of the model factory (--activation)", DATA, flag="")
    epochs: int = option(1, "epochs over the training split", OPTIM, lo=1)
    steps: int | None = option(None, "stop after this many optimizer steps in total", OPTIM, lo=1)
    # benchmarks: a window of 20 steps of a few ms each read 22% apart between repeats (run69u)
    min_seconds: float = option(0.0, "with --steps: more steps, within the epoch, until the steps after the first five "
                                "last about this many seconds at their median (a benchmark's window; 0: off)", OPTIM,
                                lo=0, hi=7 * 24 * 3600)
    limit: int | None = option(None, "train on the first N samples only", OPTIM, lo=1)
    eval_limit: int | None = option(None, "evaluate on the first N test samples only", OPTIM, lo=1)
    evaluate: bool = option(True, "skip evaluation on the test split", OPTIM, negate="--no-eval")
    # batch_size is the global batch, summed over data-parallel replicas
    batch_size: int = option(64, "global batch, summed over data-parallel workers", OPTIM, lo=1)
    lr: float = option(0.01, "learning rate", OPTIM, lo=0, lo_open=True, hi=FLOAT32_MAX)
    momentum: float = option(0.9, "SGD momentum", OPTIM, lo=0, hi=1, hi_open=True)
    weight_decay: float = option(0.0, "L2 penalty", OPTIM, lo=0, hi=FLOAT32_MAX)
    optimizer: str = option("sgd", "optimizer", OPTIM, choices=("sgd", "adam"))
    seed: int = option(0, "seeds weights, data order and synthetic data", OPTIM, lo=0, hi=2**32 - 1)
    # numerics, so part of the job: a plan is ranked at the precision asked for, never another
    precision: str = option("fp32", "compute precision: fp32, or bf16/fp16 autocast (fp16 with a gradient scaler)",
                            SPEED, choices=PRECISIONS)


@dataclass
class Parallelism:
    """How the job is spread over workers: the strategy and the parameters that matter to it."""

    strategy: str = option("serial", f"one of: {', '.join(SPECS)}", PARALLEL)
    workers: int = option(1, "number of workers (default: 1, or the launcher's world size)", PARALLEL, lo=1)
    pp: int | None = option(None, "hybrid: pipeline stages", PARALLEL, lo=1)
    dp: int | None = option(None, "hybrid: data-parallel pipeline replicas", PARALLEL, lo=1)
    backend: str | None = option(None, "default: nccl when every worker has a GPU, else gloo", PARALLEL,
                                 choices=("gloo", "nccl"))
    microbatches: int | None = option(None, "pipelines: micro-batches per batch (default: 2 x stages)", PARALLEL, lo=1)
    schedule: str | None = option(None, f"pipelines: one of {', '.join(SCHEDULES)} (default: by strategy)", PARALLEL)
    stages_per_worker: int = option(1, "interleaved-1f1b: stages per pipeline worker", PARALLEL, lo=1)
    recompute: bool = option(False, "pipelines: recompute activations in backward", PARALLEL)
    balance: str = option("time", "pipeline cut balanced by measured time or parameters", PARALLEL,
                          choices=("time", "params"))
    split_points: list[int] | None = option(None, "pipelines: explicit first block index of each stage after the "
                                            "first, e.g. 3,6", PARALLEL)
    bucket_mb: float = option(25.0, "ddp: gradient bucket size in MB", PARALLEL, lo=0, lo_open=True, hi=1e6)
    average_every: int | str = option(1, "local-sgd: steps between parameter averages, or 'epoch'", PARALLEL)


@dataclass
class Machinery:
    """What the run needs around training: threads, timeouts, where to write."""

    threads: int | None = option(None, "intra-op threads per worker (default: cores / local workers)", RUN,
                                 lo=1, hi=MAX_THREADS)
    # collective timeout: a dead peer fails the run, never hangs it
    timeout_s: float = option(300.0, "seconds a collective may wait for a peer", RUN, flag="--timeout", lo=0.001,
                              hi=7 * 24 * 3600)  # the backends count whole milliseconds: less is 0, every wait fails
    checkpoint: str | None = option(None, "directory to write a checkpoint into after every epoch", RUN)
    resume: str | None = option(None, "checkpoint directory to resume from", RUN)
    events: str | None = option(None, "directory for per-rank event traces (timelines)", RUN)
    save_model: str | None = option(None, "file to write the trained model's full state_dict into (torch.save)", RUN)
    # execution only: the same numbers (to rounding), a different speed
    channels_last: bool = option(False, "4-D activations and weights in channels-last memory format (convolutions on "
                                 "GPUs)", SPEED)
    compile: bool = option(False, "torch.compile the model (per pipeline stage); the first steps pay the compilation",
                           SPEED)


# options other commands take beyond the run vocabulary's: name -> (range, integer?)
COMMAND_OPTIONS: dict[str, tuple[Option, bool]] = {
    "max_mb": (Option("largest message in MiB", RUN, lo=0, lo_open=True), False),
    "top": (Option("plans to show", RUN, lo=1), True),
    "worst": (Option("worst cases to list", RUN, lo=0), True),
    "repeats": (Option("runs of every cell", RUN, lo=1), True),
    "warmup_steps": (Option("steps left out of the statistics", RUN, lo=0), True),
    "timeout": (Option("seconds per cell", RUN, lo=0, lo_open=True), False),
}


def _options() -> dict[str, tuple[dataclasses.Field, Option]]:
    return {f.name: (f, f.metadata["option"]) for cls in (Job, Parallelism, Machinery)
            for f in dataclasses.fields(cls)}


def flag_of(name: str) -> str:
    opt = _options()[name][1] if name in _options() else None
    return opt.flag if opt is not None and opt.flag else "--" + name.replace("_", "-")


def _range_text(opt: Option, integer: bool) -> str:
    what = "an integer" if integer else "a finite number"
    if opt.hi == FLOAT32_MAX:  # the float32 bound, said in words rather than as 3.40282e+38
        return f"{_range_text(dataclasses.replace(opt, hi=None), integer)} that float32 holds"
    if opt.lo is not None and opt.hi is not None:
        if integer:
            return f"{what} in {int(opt.lo)}..{int(opt.hi)}"
        return f"{what} in {'(' if opt.lo_open else '['}{opt.lo:g}, {opt.hi:g}{')' if opt.hi_open else ']'}"
    if opt.lo is not None:
        return f"{what} {'>' if opt.lo_open else '>='} {opt.lo:g}"
    return what


def check_number(name: str, value, opt: Option, integer: bool, flag: str | None = None) -> None:
    """Refuse ``value`` unless it is of the right kind, finite and within ``opt``'s range."""
    flag = flag or flag_of(name)
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    ok = ok and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (opt.lo is None or (value > opt.lo if opt.lo_open else value >= opt.lo))
    ok = ok and (opt.hi is None or (value < opt.hi if opt.hi_open else value <= opt.hi))
    if not ok:
        raise PartrainError(f"{flag} must be {_range_text(opt, integer)}, got {value!r}")


def check_numbers(values: dict) -> None:
    """Every known numeric option in ``values`` (a config's fields, or a command's parsed
    arguments) checked against its range: the one place bad numbers are refused."""
    for name, (f, opt) in _options().items():
        if opt.lo is None and opt.hi is None or values.get(name) is None:
            continue
        value = values[name]
        for v in value if isinstance(value, (list, tuple)) else [value]:
            check_number(name, v, opt, integer=_parser_of(f) in (int, _int_list))
    for name, (opt, integer) in COMMAND_OPTIONS.items():
        value = values.get(name)
        for v in value if isinstance(value, (list, tuple)) else [] if value is None else [value]:
            check_number(name, v, opt, integer, flag="--" + name.replace("_", "-"))


def _parser_of(f: dataclasses.Field):
    """What turns the option's text into the field's value (annotations are strings here)."""
    return {"int": int, "int | None": int, "float": float, "float | None": float,
            "list[int] | None": _int_list}.get(f.type, str)


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_options(parser: argparse.ArgumentParser, names: list[str] | None = None, groups: bool = True,
                **defaults) -> None:
    """argparse options for the fields ``names`` (default: every field with a flag), from their
    metadata: the help says the default, which is the field's own unless ``defaults`` overrides it."""
    made: dict[str, argparse._ArgumentGroup] = {}
    for name, (f, opt) in _options().items():
        if opt.flag == "" or (names is not None and name not in names):
            continue
        target = made.setdefault(opt.group, parser.add_argument_group(opt.group)) if groups else parser
        default = defaults.get(name, f.default if f.default is not dataclasses.MISSING else None)
        shown = default is not None and not isinstance(default, bool) and "default:" not in opt.help
        help_text = opt.help + (f" (default: {default})" if shown else "")
        flag = flag_of(name)
        if opt.negate:
            target.add_argument(opt.negate, dest=name, action="store_false", help=opt.help)
        elif f.type == "bool":
            target.add_argument(flag, dest=name, action="store_true", default=default, help=help_text)
        else:
            target.add_argument(flag, dest=name, type=_parser_of(f), default=default, choices=opt.choices, help=help_text,
                                metavar=None if opt.choices else flag[2:].replace("-", "_").upper())


@dataclass(frozen=True)
class ParallelDims:
    """The worker grid: ``pp`` pipeline stages times ``dp`` data-parallel replicas."""

    world_size: int
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "pp", "dp"):
            if getattr(self, name) < 1:
                raise PartrainError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.pp * self.dp != self.world_size:
            raise PartrainError(
                f"pp x dp = {self.pp} x {self.dp} = {self.pp * self.dp} differs from the "
                f"world size {self.world_size}: choose --pp and --dp whose product is --workers"
            )


# always on a printed command line, for the reader, even at their defaults
ALWAYS_IN_ARGV = ("model", "dataset", "strategy", "workers", "batch_size")


@dataclass
class RunConfig(Machinery, Parallelism, Job):
    """One training run: a ``Job`` run with a ``Parallelism`` and its ``Machinery``, validated
    where it is built, so that a bad configuration is refused before any process is spawned
    or any data is read."""

    def __post_init__(self) -> None:
        strategy_spec(self.strategy)  # names the choices when unknown
        check_numbers(dataclasses.asdict(self))
        for name in ("optimizer", "balance", "backend", "precision"):
            choices = _options()[name][1].choices
            if getattr(self, name) not in choices and not (name == "backend" and self.backend is None):
                raise PartrainError(f"unknown {flag_of(name)} {getattr(self, name)!r}: choose {' or '.join(choices)}")
        self._check_average_every()
        self._check_parallel()
        if self.min_seconds and not self.steps:
            raise PartrainError("--min-seconds lengthens a run of --steps, within its epoch: give --steps too")

    def _check_average_every(self) -> None:
        if isinstance(self.average_every, str) and self.average_every != "epoch":
            try:
                self.average_every = int(self.average_every)
            except ValueError:
                raise PartrainError(
                    f"--average-every takes a number of steps or 'epoch', got {self.average_every!r}"
                ) from None
        if isinstance(self.average_every, int) and self.average_every < 1:
            raise PartrainError(f"--average-every must be at least 1, got {self.average_every}")

    def _check_parallel(self) -> None:
        spec = self.spec
        kind = spec.family
        if kind == "serial" and self.workers != 1:
            raise PartrainError(f"strategy serial runs on one worker, got --workers {self.workers}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise PartrainError(f"unknown schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if self.schedule is not None and not spec.pipelined:
            raise PartrainError(f"--schedule applies to pipeline strategies, not {self.strategy}")
        if self.stages_per_worker > 1 and self.pipeline_schedule != "interleaved-1f1b":
            raise PartrainError("--stages-per-worker > 1 needs --schedule interleaved-1f1b")
        if self.pipeline_schedule == "interleaved-1f1b" and self.stages_per_worker < 2:
            raise PartrainError("--schedule interleaved-1f1b needs --stages-per-worker 2 or more")
        if kind != "hybrid" and (self.pp is not None or self.dp is not None):
            raise PartrainError(f"--pp/--dp apply to the hybrid strategy; {self.strategy} sets them from --workers")
        dims = self.dims  # validates pp x dp == workers
        if kind == "shared":  # each worker steps on its own rows of the global batch
            if self.batch_size % self.workers:
                raise PartrainError(f"global batch {self.batch_size} is not divisible by {self.workers} hogwild workers: "
                                    f"choose a multiple of {self.workers}")
            return
        if dims.dp > 1 and self.batch_size % (dims.dp * self.num_microbatches) != 0:
            raise PartrainError(
                f"global batch {self.batch_size} is not divisible by dp x micro-batches = "
                f"{dims.dp} x {self.num_microbatches}: choose a multiple of {dims.dp * self.num_microbatches}"
            )
        if (dims.pp > 1 or self.num_microbatches > 1) and (self.batch_size // dims.dp) % self.num_microbatches != 0:
            raise PartrainError(
                f"batch {self.batch_size // dims.dp} per pipeline is not divisible by "
                f"{self.num_microbatches} micro-batches: choose a batch that is a multiple of it"
            )
        if dims.pp > 1 and spec.micro_batched and self.num_microbatches < dims.pp:
            raise PartrainError(
                f"{self.num_microbatches} micro-batches for {dims.pp} pipeline stages: the "
                f"{self.pipeline_schedule} schedule needs at least as many micro-batches as stages "
                f"(--microbatches {dims.pp} or more)"
            )
        if spec.pipelined and not spec.micro_batched and self.microbatches not in (None, 1):
            raise PartrainError(f"{self.strategy} runs one batch at a time: use gpipe or 1f1b for micro-batches")

    @property
    def spec(self) -> StrategySpec:
        return SPECS[self.strategy]

    @property
    def kind(self) -> str:
        return self.spec.family

    @property
    def dims(self) -> ParallelDims:
        kind, w = self.kind, self.workers
        if kind == "pipeline":
            return ParallelDims(w, pp=w, dp=1)
        if kind == "hybrid":
            pp = self.pp if self.pp is not None else (w // self.dp if self.dp else 2 if w % 2 == 0 else w)
            dp = self.dp if self.dp is not None else max(1, w // pp)
            return ParallelDims(w, pp=pp, dp=dp)
        return ParallelDims(w, pp=1, dp=w)

    @property
    def pipeline_schedule(self) -> str | None:
        """The schedule a pipeline run uses (model-parallel is GPipe with one micro-batch)."""
        if not self.spec.pipelined:
            return None
        return self.schedule if self.schedule is not None else self.spec.default_schedule

    @property
    def num_microbatches(self) -> int:
        if not self.spec.micro_batched:
            return 1
        return self.microbatches if self.microbatches is not None else 2 * self.dims.pp * self.stages_per_worker

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_argv(self, always: tuple[str, ...] = ALWAYS_IN_ARGV) -> list[str]:
        """The ``partrain train`` arguments that run this configuration (``to_argv``)."""
        return to_argv(dataclasses.asdict(self), always)


def model_option_argv(options: dict) -> list[str]:
    """A model's options as the command line gives them: the mlp's ``--activation`` and
    ``--hidden 256,128``, every other as ``--model-option key=value`` (a Python literal)."""
    argv: list[str] = []
    for key, value in sorted(options.items()):
        if key == "activation":
            argv += ["--activation", str(value)]
        elif key == "hidden" and isinstance(value, list | tuple):
            argv += ["--hidden", ",".join(map(str, value))]
        else:
            argv += ["--model-option", f"{key}={value!r}"]
    return argv


def to_argv(values: dict, always: tuple[str, ...] = ALWAYS_IN_ARGV) -> list[str]:
    """The ``partrain train`` arguments for the fields in ``values``: every one that differs
    from its default, and the ``always`` ones. The one place a command line is written:
    ``recommend`` prints it, ``bench`` runs it; ``config_from_args`` of it is the same
    configuration again (a test)."""
    argv: list[str] = []
    for name, (f, opt) in _options().items():
        if name not in values:
            continue
        value = values[name]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if name == "model_options":
            argv += model_option_argv(value)
            continue
        if value == default and name not in always:
            continue
        if opt.negate:
            argv += [] if value else [opt.negate]
        elif isinstance(value, bool):
            argv += [flag_of(name)] if value else []
        elif isinstance(value, list):
            argv += [flag_of(name), ",".join(map(str, value))]
        elif value is not None:
            argv += [flag_of(name), f"{value!r}" if isinstance(value, float) else str(value)]
    return argv
