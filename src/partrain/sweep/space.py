"""The search space: which run and model options a sweep varies, and over what.

``--space`` entries are ``NAME`` (the default range below) or ``NAME=SPEC``:

    lr=1e-3..0.3:log     a range (float, or int when both ends are integers), log-uniform with :log
    batch_size=32,64,128 a list of choices (numbers or words)

Names are RunConfig fields (lr, batch_size, momentum, weight_decay, optimizer, epochs) and the
mlp's shape: width (neurons per hidden layer) and depth (hidden layers), which become
``hidden = (width,) * depth``, and activation. Grid search needs finite values: a range is cut
into ``grid_points`` values (log-spaced for :log), so the same ``--space`` works for every sampler.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass

from partrain.config import ALWAYS_IN_ARGV, RunConfig
from partrain.errors import PartrainError

RUN_OPTIONS = ("lr", "batch_size", "momentum", "weight_decay", "optimizer", "epochs")
MODEL_OPTIONS = ("width", "depth", "activation")

DEFAULTS = {
    "lr": "1e-3..0.3:log",
    "batch_size": "32,64,128",
    "momentum": "0.5..0.95",
    "weight_decay": "1e-6..1e-3:log",
    "optimizer": "sgd,adam",
    "epochs": "1..3",
    "width": "64,128,256",
    "depth": "1..3",
    "activation": "relu,sigmoid",
}
# searched when --space is not given (the shape only for the mlp, whose builder takes it)
DEFAULT_SPACE = ("lr", "batch_size", "momentum", "epochs")
DEFAULT_MLP_SPACE = (*DEFAULT_SPACE, "width", "depth")


@dataclass(frozen=True)
class Dimension:
    name: str
    choices: tuple | None = None  # a list of values, or
    low: float | None = None  # a range [low, high]
    high: float | None = None
    log: bool = False
    integer: bool = False

    def spec(self) -> str:
        if self.choices is not None:
            return ",".join(map(str, self.choices))
        return f"{self.low:g}..{self.high:g}{':log' if self.log else ''}"

    def grid(self, points: int) -> list:
        """Finite values for grid search: the choices, or ``points`` values spread over the range."""
        if self.choices is not None:
            return list(self.choices)
        if self.log:
            values = [math.exp(math.log(self.low) + i * (math.log(self.high) - math.log(self.low)) / max(1, points - 1))
                      for i in range(points)]
        else:
            values = [self.low + i * (self.high - self.low) / max(1, points - 1) for i in range(points)]
        if self.integer:
            return sorted({round(v) for v in values})
        return [float(f"{v:.4g}") for v in values]

    def suggest(self, trial):
        """Draw this dimension's value for an Optuna trial."""
        if self.choices is not None:
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.integer:
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, log=self.log)


def _number(text: str):
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def parse_dimension(entry: str) -> Dimension:
    name, _, spec = entry.partition("=")
    name = name.strip().replace("-", "_")
    if name not in DEFAULTS:
        raise PartrainError(f"--space: cannot search {name!r}; searchable: {', '.join(DEFAULTS)}")
    spec = (spec or DEFAULTS[name]).strip()
    if ".." in spec:
        bounds, _, scale = spec.partition(":")
        lo, _, hi = bounds.partition("..")
        low, high = _number(lo.strip()), _number(hi.strip())
        if not all(isinstance(v, int | float) for v in (low, high)) or not low < high or scale not in ("", "log"):
            raise PartrainError(f"--space {entry!r}: write a range as LOW..HIGH with LOW < HIGH, optionally :log")
        if scale == "log" and low <= 0:
            raise PartrainError(f"--space {entry!r}: a :log range needs LOW > 0")
        dim = Dimension(name, low=low, high=high, log=scale == "log", integer=isinstance(low, int) and isinstance(high, int))
    else:
        choices = tuple(dict.fromkeys(_number(v.strip()) for v in spec.split(",") if v.strip()))
        if not choices:
            raise PartrainError(f"--space {entry!r}: give values, e.g. {name}={DEFAULTS[name]}")
        dim = Dimension(name, choices=choices)
    _check_values(dim, entry)
    return dim


def _check_values(dim: Dimension, entry: str) -> None:
    """Refuse values no trial could run with, before any trial starts."""
    values = dim.choices if dim.choices is not None else (dim.low, dim.high)
    integer = dim.name in ("batch_size", "epochs", "width", "depth")
    words = {"optimizer": ("sgd", "adam"), "activation": ("relu", "sigmoid")}.get(dim.name)
    for v in values:
        if words and v not in words:
            raise PartrainError(f"--space {entry!r}: {v!r} is not one of {', '.join(words)}")
        if not words and not (isinstance(v, int | float) and math.isfinite(v)):
            raise PartrainError(f"--space {entry!r}: {v!r} is not a finite number")
        if integer and (not isinstance(v, int) or v < 1):
            raise PartrainError(f"--space {entry!r}: {dim.name} takes positive integers, got {v!r}")
        if dim.name == "momentum" and not 0 <= v < 1:
            raise PartrainError(f"--space {entry!r}: momentum must lie in [0, 1)")
        if dim.name in ("lr", "weight_decay") and v < 0:
            raise PartrainError(f"--space {entry!r}: {dim.name} cannot be negative")
        if dim.name == "lr" and v == 0 and dim.choices is not None:  # a range from 0 draws above it
            raise PartrainError(f"--space {entry!r}: a learning rate of 0 trains nothing")


def parse_space(entries: list[str] | None, model: str) -> list[Dimension]:
    """The dimensions ``--space`` names (comma-free entries may also be joined by spaces)."""
    if not entries:
        entries = list(DEFAULT_MLP_SPACE if model == "mlp" else DEFAULT_SPACE)
    dims = [parse_dimension(e) for e in entries]
    names = [d.name for d in dims]
    if len(set(names)) != len(names):
        raise PartrainError(f"--space names {', '.join(n for n in names if names.count(n) > 1)} more than once")
    if model != "mlp" and any(n in MODEL_OPTIONS for n in names):
        raise PartrainError(f"--space: width, depth and activation shape the mlp; model {model!r} does not take them")
    return dims


def check_divisible(dims: list[Dimension], base: RunConfig, k: int) -> None:
    """Every batch a trial can draw must split over its k data-parallel workers."""
    batch = next((d for d in dims if d.name == "batch_size"), None)
    values = (batch.choices if batch.choices is not None else (batch.low, batch.high)) if batch else (base.batch_size,)
    if batch is not None and batch.choices is None and k > 1:
        raise PartrainError("--space batch_size: with --per-trial > 1 list the batch sizes (e.g. batch_size=32,64,128), "
                            "each a multiple of --per-trial")
    bad = [v for v in values if v % k]
    if bad:
        raise PartrainError(f"batch size {bad[0]} does not split over --per-trial {k} workers: use multiples of {k}")


def trial_config(base: RunConfig, params: dict) -> RunConfig:
    """``base`` with a trial's values put in (model shape into ``model_options``)."""
    run = {k: v for k, v in params.items() if k in RUN_OPTIONS}
    options = dict(base.model_options)
    if "width" in params or "depth" in params:
        hidden = options.get("hidden", (256, 128))
        width = params.get("width", hidden[0])
        depth = params.get("depth", len(hidden))
        options["hidden"] = [width] * depth
    if "activation" in params:
        options["activation"] = params["activation"]
    return base.replace(**run, model_options=options)


def train_command(cfg: RunConfig, defaults: RunConfig | None = None) -> str:
    """The ``partrain train`` command that runs ``cfg`` (``RunConfig.to_argv``: options left at
    their defaults are left out; the epochs, batch and learning rate always shown)."""
    return shlex.join(["partrain", "train", *cfg.to_argv(always=(*ALWAYS_IN_ARGV, "epochs", "lr"))])
