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

A profile is seconds of the machine; its cells span an hour, and this VM runs in spells of
minutes. So before a cell a CPU model profile predicts, once at least ``PACE_EVERY_S`` have
passed since the last, the benchmark times a window of the profile's own pace step
(``profile.pace``: the bare serial step at its smallest batch, in this process, with nothing
else running) and adds it to the profile (``ModelProfile.later_pace_s``): ``validate`` reads
the profile's times at the mean pace of all (``pace.later_pace``), and counts the seconds with the profile's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from partrain.bench.suite import Cell
from partrain.config import RunConfig
from partrain.errors import PartrainError
from partrain.predict.plan import profile_batch_sizes
from partrain.predict.profiles import ModelProfile
from partrain.profile.cache import RunOptions, hardware_for, load_or_profile
from partrain.validate import batch_sizes_by_profile, measured_rows, profile_key, row_config

# a window of the pace step (about 30 ms, or one step of resnet18's 0.19 s) before a cell, at
# most one every PACE_EVERY_S: the spells it follows last minutes. Three windows before every
# cell (issue 17's run74u: 252 a model, 7.6 s) took the profile cost from 4.3% to 7.4% of the
# cells' time; one every 30 s took 4.7% in run75u. Each window follows ``pace.WAKE_S`` of
# untimed steps (one step until session 94): the first window after a cell read 1-4% slower than
# the next in run74u (gpt 4.4%), one window a cell alone put every profile's factor 1-3% over in
# run75u, and a process that waited runs its first tenths of a second slow (``pace.WAKE_S``).
# Every 45 s since session 100: each window costs about 0.14 s, 79 of them 11 s of run121u's 50 s
# of profiles (5.0% of the cells' time at 30 s); every other one of them kept (as if 60 s apart),
# each half read the pass 10.6% where all read 10.5%, the profiles' factors within 6% of all's.
PACE_EVERY_S = 45.0


class ProfilesBeside:
    """Call ``before(cell)`` before each cell runs: it profiles what is due first, then times the
    machine's pace for the cell's model profile."""

    def __init__(self, runnable: list[tuple[Cell, RunConfig]], earlier: list[dict], hardware_hash: str,
                 directory: str | None, data_dir: str | None, say: Callable[[str], None] = print):
        """``runnable``: the suite's cells that pass ``check_cell``, with their configuration;
        ``earlier``: the store's rows (those measured on this hardware count, as in ``validate``)."""
        configs = [cfg for _, cfg in runnable] + [row_config(r) for r in measured_rows(earlier, hardware_hash)]
        self.wanted = batch_sizes_by_profile((profile_key(cfg), cfg) for cfg in configs)
        self.config = {replace(cell, repeat=0): cfg for cell, cfg in runnable}  # a cell's repeats run as one
        self.directory, self.data_dir, self.say = directory, data_dir, say
        self.done: set = set()
        self.paces: dict = {}  # profile key -> (its pace step, where the profile is), CPU profiles kept
        self.sampled: dict = {}  # profile key -> when its last pace window was timed (perf_counter)

    def before(self, cell: Cell) -> None:
        cfg = self.config.get(replace(cell, repeat=0))
        if cfg is None:  # refused: it stores its reason and predicts nothing
            return
        key, setup_s = profile_key(cfg), 0.0
        if key not in self.done:
            self.done.add(key)
            sizes = profile_batch_sizes(self.wanted[key])
            self.say(f"profiling {cfg.model} on {cfg.dataset} at batch {', '.join(map(str, sizes))} for validate")
            profile, path, _ = load_or_profile(cfg.model, cfg.dataset, sizes, cfg.threads, self.directory, self.data_dir,
                                               cfg.synthetic, cfg.model_options, refresh=True,
                                               run=RunOptions(None, cfg.precision, cfg.channels_last, cfg.compile))
            if profile.pace_s and path.is_file() and ModelProfile.load(path).pace_s == profile.pace_s:  # kept: quiet
                start = time.perf_counter()
                self.paces[key] = (pace_step(cfg, profile, self.data_dir), path)
                setup_s = time.perf_counter() - start
        if not cell.nodes and cfg.workers > 1 and ("hardware", cfg.workers) not in self.done:
            self.done.add(("hardware", cfg.workers))
            self.say(f"profiling this machine's collectives with {cfg.workers} workers for validate")
            try:
                hardware_for(cfg.workers, self.directory, refresh=True)
            except PartrainError as err:  # more GPU workers than GPUs: validate says the same
                self.say(f"not profiled: {err}")
        now = time.perf_counter()
        if key in self.paces and now - self.sampled.get(key, -math.inf) >= PACE_EVERY_S:
            self.sampled[key] = now
            sample_pace(*self.paces[key], extra_s=setup_s)


def pace_step(cfg: RunConfig, profile: ModelProfile, data_dir: str | None):
    """The pace step ``profile`` sampled (``profile.pace``), on a model built as it built it."""
    import torch

    from partrain.data import load_dataset
    from partrain.models import build_model
    from partrain.profile.numerics import place
    from partrain.profile.pace import Pace

    with torch_threads(profile.threads):
        train_set = load_dataset(cfg.dataset, "train", data_dir=data_dir, synthetic=cfg.synthetic, seed=0)
        torch.manual_seed(0)
        net = build_model(cfg.model, train_set.spec.input_shape, train_set.spec.num_classes, **cfg.model_options)
        run = dict(device="cpu", precision=cfg.precision, channels_last=cfg.channels_last)
        return Pace.of(place(net, torch.device("cpu"), cfg.channels_last), train_set, min(profile.batch_sizes), run)


@contextmanager
def torch_threads(threads: int):
    """torch's intra-op threads set to ``threads`` inside, as they were after."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def sample_pace(pace, path: Path, windows: int = 1, extra_s: float = 0.0) -> None:
    """``windows`` more windows of ``pace`` (a ``Pace``) added to the profile at ``path``, with
    their seconds and ``extra_s`` (building the step) counted as the profile's."""
    profile, start = ModelProfile.load(path), time.perf_counter()
    with torch_threads(profile.threads):
        pace.windows.clear()
        for i in range(windows):
            pace.sample(warm=i == 0)
    profile.later_pace_s.extend(pace.windows)
    profile.profile_seconds += time.perf_counter() - start + extra_s
    profile.save(path)
