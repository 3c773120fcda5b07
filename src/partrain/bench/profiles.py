"""``bench --profile``: the profiles ``validate`` predicts a suite's cells from, taken beside them.

``validate`` profiles each model when it first needs it, and the machine then may not run as it
ran the cells: on this 2-core VM a slow spell of about ten minutes read every step 12-20%
slower, and profiles taken in one read the gallery's serial cells +11% and all 17% off, against
8% from profiles taken again (issue 17). With ``--profile`` the benchmark takes them itself,
fresh, right before the first cell that needs them: a model's profile before its first cell (at
every batch size its cells and the store's earlier cells of it compute at: the one profile
``validate`` looks up), the machine's hardware profile for k local workers before the first
cell of k workers (cells across emulated nodes have their link's, ``bench.nodes``). ``validate``
with the same ``--profile-dir`` finds them in the cache and measures nothing.

Each ``bench --profile`` takes them again: a store filled by several suites keeps the hardware
profile of the last one. A profile taken while other processes held the CPU is not kept
(``profile.cache``), and ``validate`` then takes its own.
"""

from __future__ import annotations

from collections.abc import Callable

from partrain.bench.suite import Cell
from partrain.config import RunConfig
from partrain.errors import PartrainError
from partrain.predict.plan import profile_batch_sizes
from partrain.profile.cache import RunOptions, hardware_for, load_or_profile
from partrain.validate import batch_sizes_by_profile, measured_rows, profile_key, row_config


class ProfilesBeside:
    """Call ``before(cell)`` before each cell runs; it profiles what is due first."""

    def __init__(self, runnable: list[tuple[Cell, RunConfig]], earlier: list[dict], hardware_hash: str,
                 directory: str | None, data_dir: str | None, say: Callable[[str], None] = print):
        """``runnable``: the suite's cells that pass ``check_cell``, with their configuration;
        ``earlier``: the store's rows (those measured on this hardware count, as in ``validate``)."""
        configs = [cfg for _, cfg in runnable] + [row_config(r) for r in measured_rows(earlier, hardware_hash)]
        self.wanted = batch_sizes_by_profile((profile_key(cfg), cfg) for cfg in configs)
        self.config = dict(runnable)
        self.directory, self.data_dir, self.say = directory, data_dir, say
        self.done: set = set()

    def before(self, cell: Cell) -> None:
        cfg = self.config.get(cell)
        if cfg is None:  # refused: it stores its reason and predicts nothing
            return
        key = profile_key(cfg)
        if key not in self.done:
            self.done.add(key)
            sizes = profile_batch_sizes(self.wanted[key])
            self.say(f"profiling {cfg.model} on {cfg.dataset} at batch {', '.join(map(str, sizes))} for validate")
            load_or_profile(cfg.model, cfg.dataset, sizes, cfg.threads, self.directory, self.data_dir, cfg.synthetic,
                            cfg.model_options, refresh=True,
                            run=RunOptions(None, cfg.precision, cfg.channels_last, cfg.compile))
        if not cell.nodes and cfg.workers > 1 and ("hardware", cfg.workers) not in self.done:
            self.done.add(("hardware", cfg.workers))
            self.say(f"profiling this machine's collectives with {cfg.workers} workers for validate")
            try:
                hardware_for(cfg.workers, self.directory, refresh=True)
            except PartrainError as err:  # more GPU workers than GPUs: validate says the same
                self.say(f"not profiled: {err}")
