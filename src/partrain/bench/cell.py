"""One benchmark cell: the configuration one run measures, its identity in the results store
(``key``), the serial runs it is compared against (``baseline_key``) and the ``RunConfig`` it
trains with. ``bench.suite`` expands a suite's matrix into cells.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from partrain.config import RunConfig
from partrain.spec import SPECS


@dataclass(frozen=True)
class Cell:
    """One configuration of the matrix: what one benchmark run measures.

    Normalized where the suite can tell: micro-batches are None except on pipelines (None
    there is the strategy's default, which the store records resolved once the cell ran),
    and ``synthetic`` is true for the generated-only datasets.
    """

    model: str
    dataset: str
    strategy: str
    workers: int
    batch_size: int
    microbatches: int | None
    lr: float
    repeat: int = 0
    synthetic: bool = False
    warmup_steps: int = 5
    steps: int | None = 20  # measured steps after warm-up; None: whole epochs
    epochs: int | None = None
    limit: int | None = None
    eval_limit: int | None = None
    threads: int = 1
    seed: int = 0
    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False
    engine: str = "torch"  # or "scratch": partrain.scratch's NumPy engine
    # across emulated nodes (None: on this machine); workers = nodes x workers_per_node
    nodes: int | None = None
    workers_per_node: int | None = None
    link_mbit: float | None = None
    min_seconds: float = 0.0  # train's --min-seconds: the measured window at least this long

    @property
    def label(self) -> str:
        parts = [f"{self.model}/{self.dataset}", f"{self.strategy} x{self.workers}", f"b{self.batch_size}"]
        if self.engine != "torch":  # e.g. "scratch mlp/mnist threads x2 b64 lr0.01"
            parts.insert(0, self.engine)
        if self.microbatches:
            parts.append(f"mb{self.microbatches}")
        parts.append(f"lr{self.lr:g}")
        parts += [self.precision] if self.precision != "fp32" else []
        parts += ["channels-last"] * self.channels_last + ["compiled"] * self.compile
        if self.nodes:
            parts.append(f"on {self.placement}")
        if self.repeat:
            parts.append(f"#{self.repeat}")
        return " ".join(parts)

    @property
    def placement(self) -> str | None:
        """Where the cell runs across emulated nodes, in words (None: on this machine)."""
        if not self.nodes:
            return None
        return f"{self.nodes}x{self.workers_per_node} nodes at {self.link_mbit:g} Mbit/s"

    def identity(self) -> dict:
        """Everything that makes a measurement differ, without the repeat index. The numerics
        count only when not the default (fp32, eager, contiguous), and the link fields only
        across nodes: a cell stored before they existed keeps its key, and is found again
        instead of measured twice."""
        fields = dataclasses.asdict(self)
        del fields["repeat"]
        for name, default in _RUN_OPTION_DEFAULTS.items():
            if fields[name] == default:
                del fields[name]
        if self.nodes is None:
            for name in _NODE_FIELDS:
                del fields[name]
        return fields

    def key(self, hardware_hash: str) -> str:
        """The cell's identity in the store: its configuration, this hardware, the repeat index."""
        return _digest({**self.identity(), "repeat": self.repeat, "hardware": hardware_hash})

    def baseline_key(self, hardware_hash: str) -> str:
        """Shared by this cell and the serial runs it is compared against: the same job, minus
        how it is parallelized (strategy, workers, micro-batches), on the same hardware and
        engine (a scratch cell's speedup is over scratch serial, never over torch serial)."""
        fields = self.identity()
        for name in ("strategy", "workers", "microbatches", *_NODE_FIELDS):
            fields.pop(name, None)  # across nodes too: the serial baseline ran here, on one worker
        return _digest({**fields, "hardware": hardware_hash})

    def run_config(self, data_dir: str | None, timeout: float) -> RunConfig:
        """The ``RunConfig`` the cell trains with; raises ``PartrainError`` if it cannot run.

        In steps mode ``epochs`` is only an upper bound (every epoch has at least one step),
        so ``steps`` alone decides how long the run is, whatever the dataset's length; the
        test split is not evaluated, as accuracy after part of an epoch is not comparable.
        """
        total = None if self.steps is None else self.warmup_steps + self.steps
        return RunConfig(
            model=self.model, dataset=self.dataset, data_dir=data_dir, synthetic=self.synthetic,
            epochs=self.epochs or total, steps=total, limit=self.limit, eval_limit=self.eval_limit,
            evaluate=self.steps is None, batch_size=self.batch_size, lr=self.lr, seed=self.seed,
            strategy=self.strategy, workers=self.workers, microbatches=self.microbatches,
            threads=self.threads, timeout_s=min(timeout, 300.0), precision=self.precision,
            channels_last=self.channels_last, compile=self.compile, min_seconds=self.min_seconds,
        )


# the keys of the cells stored before these existed stay the same
_RUN_OPTION_DEFAULTS = {"precision": "fp32", "channels_last": False, "compile": False, "engine": "torch",
                        "min_seconds": 0.0}
_NODE_FIELDS = ("nodes", "workers_per_node", "link_mbit")


def _micro_batched(engine: str, strategy: str) -> bool:
    """Whether ``strategy`` cuts a batch into micro-batches on ``engine`` (False where the
    engine lacks it: that cell is one, stored as skipped)."""
    if engine == "scratch":
        from partrain.scratch import MICRO_BATCHED

        return strategy in MICRO_BATCHED
    return strategy in SPECS and SPECS[strategy].micro_batched


def _digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]
