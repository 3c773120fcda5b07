"""Benchmark suites: a matrix of configurations read from TOML, expanded into cells.

A suite file lists the axes of the matrix and how much of each run to measure::

    name = "quick"
    models = ["mlp", "cnn"]          # zoo names, or package.module:factory
    datasets = ["mnist"]
    strategies = ["serial", "ddp", "gpipe", "1f1b"]
    workers = [1, 2]
    batch_sizes = [64]               # global batch
    microbatches = [4]               # pipelines only (default: 2 x stages)
    lrs = [0.01]
    repeats = 1
    warmup_steps = 5                 # dropped from the step-time statistics
    steps = 30                       # measured steps after warm-up ... or: epochs = 1
    min_seconds = 1.0                # ... and more, within the epoch, until they take at least this long
    synthetic = false                # generated data (implied for imagenet and highres)
    limit = 6000                     # train on the first N samples only
    eval_limit = 1000                # epochs mode: evaluate on the first N test samples
    threads = 1                      # intra-op threads per worker
    seed = 0
    timeout = 600                    # seconds per cell, process start to exit
    data_dir = "/data"               # default: --data-dir, else $PARTRAIN_DATA_DIR
    precisions = ["fp32", "bf16"]    # train's --precision, an axis of the matrix (default: fp32)
    channels_last = false            # train's --channels-last, for every cell
    compile = false                  # train's --compile, for every cell
    engine = ["torch", "scratch"]    # default "torch"; scratch: the NumPy engine (partrain.scratch)

    # across emulated nodes (issue 18; needs root: partrain.testing.netns), instead of workers:
    nodes = [2, 4]                   # network namespaces joined by a shaped link ...
    workers_per_node = [1, 2]        # ... each running this many workers (default 1)
    # placements = ["2x1", "4x1", "2x2"]   # or: the (nodes x workers per node) pairs themselves
    link_mbit = [100, 1000]          # the link's rate in Mbit/s, each a cell of its own
    profile_max_mb = 4               # largest message of the link's profile --hardware

Every key but ``models`` is optional; a list key also takes a single value. The matrix is
the product of models x datasets x strategies x workers x batch sizes x micro-batches x lrs
x precisions x repeats x engines, with one exception: micro-batches multiply pipeline strategies only (a data
parallel run has no micro-batches, so it is one cell, not one per value).

With ``nodes`` (or ``placements``) the workers axis is the placements x link rates: each
strategy runs under torchrun across that many emulated nodes joined by a link of that rate
(``bench.nodes``), except serial, which has one worker and so no link: it runs once, here,
as the baseline. ``workers`` and ``nodes`` are not given together.

The scratch engine (``engine = "scratch"``, see ``partrain.scratch``) trains the mlp only, with
its own strategies (serial, threads, ddp, hybrid, model-parallel, local-sgd); a suite may list
both engines and the strategies of both, and a cell whose engine lacks its strategy is stored
as skipped. For it ``workers`` counts threads for ``threads`` and processes otherwise;
``hybrid`` runs ``threads`` threads in each process (2 when ``threads`` is 1), and the
``threads`` setting changes nothing else (the engine's BLAS always runs on one thread).

A suite is validated completely when it is read -- unknown keys, wrong types, unknown
models, datasets and strategies are one ``PartrainError`` -- so a bad file never starts a
run or touches the results store. Whether a *cell* can run (serial on 2 workers, more
pipeline stages than blocks, a batch that does not divide) is decided per cell by the
runner, and such a cell is stored as skipped with the reason.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from partrain.bench.cell import Cell, _micro_batched
from partrain.config import PRECISIONS
from partrain.data import dataset_spec
from partrain.distributed.spawn import MAX_PER_CORE
from partrain.errors import PartrainError
from partrain.models import list_models
from partrain.spec import SPECS

# The quick suite: a few minutes on a 2-core laptop. suites/quick.toml is the same suite as a
# file (a test keeps the two equal), the example to copy for your own.
QUICK = {
    "name": "quick",
    "description": "mlp and cnn on MNIST: serial, ddp and the two pipeline schedules on 1-2 workers",
    "models": ["mlp", "cnn"],
    "datasets": ["mnist"],
    "strategies": ["serial", "ddp", "gpipe", "1f1b"],
    "workers": [1, 2],
    "batch_sizes": [64],
    "lrs": [0.01],
    "warmup_steps": 5,
    "steps": 30,
    "threads": 1,
    "timeout": 300,
}

THESIS_MODELS = ["resnet18", "resnet50", "resnet152", "vgg11", "vgg16", "mobilenetv2"]
THESIS_DATASETS = ["mnist", "cifar10", "imagenet", "highres"]  # the last two are generated data
BUILTIN_SUITES = ("quick", "thesis")
ENGINES = ("torch", "scratch")  # PyTorch's modules and strategies; partrain.scratch's NumPy engine


@dataclass(frozen=True)
class Suite:
    """A validated suite: the axes of the matrix and how much of each cell to run."""

    name: str
    models: tuple[str, ...]
    description: str = ""
    datasets: tuple[str, ...] = ("mnist",)
    strategies: tuple[str, ...] = ("serial",)
    workers: tuple[int, ...] = (1,)
    batch_sizes: tuple[int, ...] = (64,)
    microbatches: tuple[int, ...] = ()  # empty: the strategy's default (2 x stages)
    lrs: tuple[float, ...] = (0.01,)
    repeats: int = 1
    rerun_over: float = 0.0  # a cell whose repeats lie further apart runs again (``runner.far_apart``); 0: never
    warmup_steps: int = 5
    steps: int | None = 20
    min_seconds: float = 0.0
    epochs: int | None = None
    synthetic: bool = False
    limit: int | None = None
    eval_limit: int | None = None
    threads: int = 1
    seed: int = 0
    timeout: float = 600.0
    data_dir: str | None = None
    precisions: tuple[str, ...] = ("fp32",)
    channels_last: bool = False
    compile: bool = False
    engine: tuple[str, ...] = ("torch",)
    nodes: tuple[int, ...] = ()  # emulated nodes; empty: every cell on this machine
    workers_per_node: tuple[int, ...] = ()  # empty: 1
    placements: tuple[str, ...] = ()  # "NxW" pairs, instead of nodes x workers_per_node
    link_mbit: tuple[float, ...] = ()
    profile_max_mb: float = 4.0

    def places(self) -> list[tuple[int, int]]:
        """The (nodes, workers per node) pairs the suite runs across; empty: none."""
        if self.placements:
            return [tuple(int(n) for n in p.split("x")) for p in self.placements]
        return [(n, w) for n in self.nodes for w in self.workers_per_node or (1,)]

    def _where(self, strategy: str) -> list[tuple[int, int | None, int | None, float | None]]:
        """(workers, nodes, workers per node, link) of one strategy's cells."""
        if not self.places():
            return [(w, None, None, None) for w in self.workers]
        if SPECS[strategy].family == "serial":  # one worker has no link: the baseline, here
            return [(1, None, None, None)]
        return [(n * w, n, w, float(link)) for n, w in self.places() for link in self.link_mbit]

    def cells(self) -> list[Cell]:
        """The matrix, in a stable order (the order the runner measures it): the whole matrix
        once, then again for each further repeat, so that a cell's repeats run minutes apart
        (different moments of a shared machine) and an interrupted suite has whole passes."""
        cells = []
        axes = itertools.product(self.models, self.datasets, self.engine, self.batch_sizes, self.lrs, self.precisions,
                                 self.strategies)
        for model, dataset, engine, batch, lr, precision, strategy in axes:
            for workers, nodes, per_node, link in self._where(strategy):
                for mb in (self.microbatches or (None,)) if _micro_batched(engine, strategy) else (None,):
                    for repeat in range(self.repeats):
                        cells.append(Cell(
                            model, dataset, strategy, workers, batch, mb, lr, repeat,
                            self.synthetic or dataset_spec(dataset).synthetic_only, self.warmup_steps, self.steps,
                            self.epochs, self.limit, self.eval_limit, self.threads, self.seed, precision,
                            self.channels_last, self.compile, engine, nodes, per_node, link, self.min_seconds,
                        ))
        return sorted(cells, key=lambda c: c.repeat)  # stable: the matrix order within a pass

    def replace(self, **changes) -> Suite:
        """A copy with some settings changed and validated again (tests shrink suites this way)."""
        fields = {**dataclasses.asdict(self), **changes}
        for given, other in (("epochs", "steps"), ("steps", "epochs")):
            if given in changes and other not in changes:
                fields[other] = None
        if (fields["nodes"] or fields["placements"]) and "workers" not in changes:
            fields["workers"] = None  # across nodes the placements are the workers
        if fields["profile_max_mb"] == 4.0 and "profile_max_mb" not in changes:
            fields["profile_max_mb"] = None  # the default, given only with nodes
        return suite_from_dict({k: v for k, v in fields.items() if v not in (None, ())}, f"suite {self.name!r}")


# key -> (type of the value or of each element, a list?, check, what the check requires)
_POSITIVE = (lambda v: v >= 1, "at least 1")
_SCHEMA: dict[str, tuple[type | tuple, bool, tuple | None]] = {
    "name": (str, False, None),
    "description": (str, False, None),
    "models": (str, True, None),
    "datasets": (str, True, None),
    "strategies": (str, True, None),
    "workers": (int, True, _POSITIVE),
    "batch_sizes": (int, True, _POSITIVE),
    "microbatches": (int, True, _POSITIVE),
    "lrs": ((int, float), True, (lambda v: math.isfinite(v) and v > 0, "a finite number > 0")),
    "repeats": (int, False, _POSITIVE),
    "rerun_over": ((int, float), False, (lambda v: math.isfinite(v) and 0 <= v <= 10, "in 0..10 (0.15: 15% apart)")),
    "warmup_steps": (int, False, (lambda v: v >= 0, "0 or more")),
    "steps": (int, False, _POSITIVE),
    "min_seconds": ((int, float), False, (lambda v: math.isfinite(v) and 0 <= v <= 3600, "in 0..3600")),
    "epochs": (int, False, _POSITIVE),
    "synthetic": (bool, False, None),
    "limit": (int, False, _POSITIVE),
    "eval_limit": (int, False, _POSITIVE),
    "threads": (int, False, _POSITIVE),
    "seed": (int, False, (lambda v: 0 <= v < 2**32, "in 0..2**32-1")),
    "timeout": ((int, float), False, (lambda v: math.isfinite(v) and v > 0, "a finite number > 0")),
    "data_dir": (str, False, None),
    "precisions": (str, True, (lambda v: v in PRECISIONS, f"one of {', '.join(PRECISIONS)}")),
    "channels_last": (bool, False, None),
    "compile": (bool, False, None),
    "nodes": (int, True, (lambda v: 2 <= v <= 64, "2..64 (one node is this machine: use workers)")),
    "workers_per_node": (int, True, _POSITIVE),
    "placements": (str, True, (lambda v: re.fullmatch(r"([2-9]|[1-5][0-9]|6[0-4])x[1-9][0-9]*", v) is not None,
                               "NODESxWORKERS with 2..64 nodes, e.g. \"2x1\"")),
    "link_mbit": ((int, float), True, (lambda v: math.isfinite(v) and v > 0, "a finite number > 0")),
    "profile_max_mb": ((int, float), False, (lambda v: math.isfinite(v) and 0 < v <= 1024, "in (0, 1024]")),
    "engine": (str, True, (lambda v: v in ENGINES, f"one of {', '.join(ENGINES)}")),
}


def _check_value(source: str, key: str, value, kind, check) -> None:
    # bool is an int to Python; a worker count of `true` is a typo, not 1
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise PartrainError(f"{source}: {key} takes {names} values, got {value!r}")
    if check is not None and not check[0](value):
        raise PartrainError(f"{source}: {key} must be {check[1]}, got {value!r}")


def suite_from_dict(raw: dict, source: str) -> Suite:
    """Validate a parsed suite; ``source`` names it in the error message."""
    unknown = sorted(set(raw) - set(_SCHEMA))
    if unknown:
        raise PartrainError(f"{source}: unknown key {unknown[0]!r}; the keys are: {', '.join(_SCHEMA)}")
    if "models" not in raw:
        raise PartrainError(f"{source}: no models; add for example models = [\"mlp\"]")
    fields = {}
    for key, value in raw.items():
        kind, is_list, check = _SCHEMA[key]
        if is_list:
            value = list(value) if isinstance(value, (list, tuple)) else [value]
            if not value:
                raise PartrainError(f"{source}: {key} is empty; give at least one value")
        for item in value if is_list else [value]:
            _check_value(source, key, item, kind, check)
        if is_list and (twice := next((v for i, v in enumerate(value) if v in value[:i]), None)) is not None:
            # the same cell built twice over, measured twice under one key: `repeats` measures again
            raise PartrainError(f"{source}: {key} lists {twice!r} twice; to measure cells more than once, set repeats")
        fields[key] = tuple(value) if is_list else value
    if "steps" in fields and "epochs" in fields:
        raise PartrainError(f"{source}: give steps (measured steps after warm-up) or epochs, not both")
    if "epochs" in fields:
        fields["steps"] = None
    if fields.get("rerun_over") and fields.get("repeats", 1) < 2:
        raise PartrainError(f"{source}: rerun_over compares a cell's repeats with each other: set repeats to 2 or more")
    if fields.get("min_seconds") and ("epochs" in fields or "scratch" in fields.get("engine", ())):
        raise PartrainError(f"{source}: min_seconds lengthens the torch engine's runs of steps: "
                            + ("give steps, not epochs" if "epochs" in fields else "leave out the scratch engine"))
    _check_nodes(source, fields)
    fields.setdefault("name", Path(source).stem)
    _check_names(source, fields)
    return Suite(**fields)


def _check_nodes(source: str, fields: dict) -> None:
    """The emulated-node keys come together, and instead of ``workers``."""
    across = "nodes" in fields or "placements" in fields
    if "nodes" in fields and "placements" in fields:
        raise PartrainError(f"{source}: give nodes (with workers_per_node) or placements, not both")
    if "workers_per_node" in fields and "nodes" not in fields:
        raise PartrainError(f"{source}: workers_per_node needs nodes; add for example nodes = [2]")
    if across and "workers" in fields:
        raise PartrainError(f"{source}: give workers (this machine) or nodes (emulated nodes), not both; "
                            "across nodes serial runs here as the baseline")
    if across != ("link_mbit" in fields):
        raise PartrainError(f"{source}: nodes and link_mbit come together: " + (
            "add for example link_mbit = [1000]" if across else "add for example nodes = [2]"))
    if "profile_max_mb" in fields and not across:
        raise PartrainError(f"{source}: profile_max_mb sizes the link's profile across nodes: add nodes, or remove it")


def _check_names(source: str, fields: dict) -> None:
    for model in fields["models"]:
        module, colon, factory = model.partition(":")
        if model not in list_models() and not (colon and module and factory):
            raise PartrainError(
                f"{source}: unknown model {model!r}; choose from {', '.join(list_models())} or give package.module:factory"
            )
    threads, most = fields.get("threads", 1), MAX_PER_CORE * (os.cpu_count() or 1)
    if threads > most:  # every cell would be refused and stored as skipped
        raise PartrainError(f"{source}: threads = {threads} on a machine with {os.cpu_count()} cores: at most {most}")
    for dataset in fields.get("datasets", ()):
        try:
            dataset_spec(dataset)
        except PartrainError as err:
            raise PartrainError(f"{source}: {err}") from None
    known = dict.fromkeys(SPECS)
    if "scratch" in fields.get("engine", ()):
        from partrain.scratch import STRATEGIES as SCRATCH_STRATEGIES

        known.update(dict.fromkeys(SCRATCH_STRATEGIES))
    for strategy in fields.get("strategies", ()):
        if strategy not in known:
            raise PartrainError(f"{source}: unknown strategy {strategy!r}; choose from {', '.join(known)}")
    for dataset in fields.get("datasets", ("mnist",)):
        rows = min(dataset_spec(dataset).train_size, fields.get("limit") or math.inf)
        too_big = [b for b in fields.get("batch_sizes", ()) if b > rows]
        if too_big:
            raise PartrainError(f"{source}: batch size {too_big[0]} exceeds the {rows} training samples of {dataset}; "
                                "choose smaller batch_sizes")


def load_suite(path: str | Path) -> Suite:
    """Read and validate a suite file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PartrainError(f"suite file {path} not found; pass a TOML file, or --suite {'|'.join(BUILTIN_SUITES)}") from None
    except OSError as err:
        raise PartrainError(f"cannot read suite file {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise PartrainError(f"suite file {path} is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise PartrainError(f"suite file {path} is not valid TOML: {err}") from None
    return suite_from_dict(raw, str(path))


def builtin_suite(name: str, hardware) -> Suite:
    """A built-in suite; ``thesis`` is sized to ``hardware`` (a ``Hardware`` fingerprint)."""
    if name == "quick":
        return suite_from_dict(QUICK, "built-in suite 'quick'")
    if name == "thesis":
        return thesis_suite(hardware)
    raise PartrainError(f"unknown built-in suite {name!r}; choose {' or '.join(BUILTIN_SUITES)}, or pass a TOML file")


def thesis_suite(hardware) -> Suite:
    """The thesis matrix, sized to the hardware it runs on.

    Workers are the powers of two up to the devices (GPUs, else cores). On GPUs: batch 64,
    5 warm-up and 20 measured steps. On CPU, where one ResNet-152 step on a 512x512 batch
    takes minutes: batch 8, 1 + 3 steps and an hour per cell, and one thread per worker so
    that W workers use W cores. A cell that runs out of memory is stored as failed.
    """
    gpu = hardware.gpu_count > 0
    devices = hardware.gpu_count if gpu else hardware.cpu_cores
    raw = {
        "name": "thesis",
        "description": f"the thesis matrix, sized to {devices} {'GPUs' if gpu else 'cores'}",
        "models": THESIS_MODELS,
        "datasets": THESIS_DATASETS,
        "strategies": ["serial", "ddp", "gpipe", "1f1b"],
        "workers": [w for w in (1, 2, 4, 8) if w <= max(1, devices)],
        "batch_sizes": [64 if gpu else 8],
        "warmup_steps": 5 if gpu else 1,
        "steps": 20 if gpu else 3,
        "threads": max(1, hardware.cpu_cores // devices) if gpu else 1,
        "timeout": 900 if gpu else 3600,
    }
    return suite_from_dict(raw, "built-in suite 'thesis'")
