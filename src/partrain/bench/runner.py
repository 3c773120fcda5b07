"""Running benchmark cells for real: each in fresh worker processes, under a timeout.

A cell runs as ``python -m partrain train ... --json --quiet``, so every cell starts from
cold processes: nothing one cell allocated, compiled or cached skews the next, and a crash
or an out-of-memory kill takes down only that cell. How those processes are started in
their own session, killed as a group on timeout or when the runner dies, and their failure
told in one line is ``bench.processes``.

The price is a process start per cell (about 2 s to import torch, and the elastic launcher
and data loading per worker), which is why step times are taken from the training loop's
own per-step clock after warm-up, never from the process's wall time.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from partrain.bench import nodes
from partrain.bench.processes import run_process, run_processes
from partrain.bench.profiles import ProfilesBeside
from partrain.bench.store import Outcome, Store
from partrain.bench.suite import Cell, Suite
from partrain.config import RunConfig
from partrain.data import dataset_spec
from partrain.distributed.spawn import child_env, python_command
from partrain.errors import PartrainError
from partrain.predict.machine import fingerprint, git_commit
from partrain.runner import preflight


# how many times more, at most, a cell whose repeats lie far apart runs (a suite's ``rerun_over``)
RERUNS = 2


def run_suite(suite: Suite, store: Store, *, force: bool = False, data_dir: str | None = None,
              show_progress: bool = True, profile_dir: str | None = None, profile: bool = False) -> list[str]:
    """Measure every cell of ``suite`` into ``store``; returns the cells' keys in suite order,
    then those of the cells run again (``far_apart``, where the suite sets ``rerun_over``)."""
    return run_cells(suite.cells(), store, suite_name=suite.name, data_dir=data_dir or suite.data_dir,
                     timeout=suite.timeout, force=force, show_progress=show_progress,
                     link_profile_mb=suite.profile_max_mb, profile_dir=profile_dir, profile=profile,
                     rerun_over=suite.rerun_over)


def run_cells(cells: list[Cell], store: Store, *, suite_name: str, data_dir: str | None, timeout: float,
              force: bool = False, show_progress: bool = True, link_profile_mb: float = 4.0,
              profile_dir: str | None = None, profile: bool = False, rerun_over: float = 0.0) -> list[str]:
    """Measure ``cells`` one after the other, storing each as soon as it finished.

    A cell already measured (status ok) on this hardware is not run again unless ``force``;
    a cell that cannot run is stored as skipped, one that crashes or times out as failed or
    timeout, and the next cell goes on. Returns the cells' keys, in order. Cells across
    emulated nodes are refused, before any runs, where no namespaces can be made; before
    the first of each placement and link runs, that link is profiled (``bench.nodes``).
    ``profile``: the model and hardware profiles ``validate`` needs are taken into
    ``profile_dir`` right before the first cell that needs them (``bench.profiles``).
    ``rerun_over``: then, up to ``RERUNS`` times, one more repeat of each cell whose runs are
    not settled within that (``far_apart``), beside the same profiles; their keys follow.
    """
    if reason := nodes.refusal(cells):
        raise PartrainError(reason)
    hardware, commit = fingerprint(), git_commit()
    keys = []
    with CellProgress(len(cells), show_progress) as progress:
        beside = ProfilesBeside(_runnable(cells, data_dir, timeout), store.rows(), hardware.hash, profile_dir, data_dir,
                                progress.console.print if show_progress else lambda text: None) if profile else None

        def run(cell: Cell) -> None:
            key = cell.key(hardware.hash)
            keys.append(key)
            if not force and store.measured(key):
                progress.end(cell, None)
                return
            progress.begin(cell)
            if cell.nodes and (failed := nodes.ensure_link_profile(cell, run_processes, link_profile_mb, timeout,
                                                                   profile_dir, progress.refresh)):
                progress.console.print(f"partrain: {failed}; its cells run, validate cannot predict them")
            if beside:
                beside.before(cell)
            started = time.perf_counter()
            outcome = measure(cell, data_dir, timeout, progress.refresh)
            store.record(cell, hardware, outcome, suite_name, commit)
            progress.end(cell, outcome, time.perf_counter() - started)

        for cell in cells:
            run(cell)
        for _ in range(RERUNS if rerun_over else 0):  # after every cell: minutes from its other repeats
            again = far_apart(cells, {row["cell_key"]: row for row in store.rows(keys)}, hardware.hash, rerun_over)
            if not again:
                break
            progress.more(len(again))
            cells = cells + again
            for cell in again:
                run(cell)
    return keys


def far_apart(cells: list[Cell], rows: dict[str, dict], hardware_hash: str, over: float) -> list[Cell]:
    """One more repeat of each cell of ``cells`` whose repeats all ran (``rows`` by cell key,
    status ok) and whose median is not yet held by two runs that agree (``settled``).
    ``validate`` holds a cell at the median of its repeats, and with two that is their mean: on
    the 2-vCPU VM a core runs at one of two speeds in spells of seconds to minutes, and the mlp's
    2-stage 1F1B over 2 emulated nodes at 10 Gbit/s read 7.08 and 5.14 ms in its two repeats
    (issue 18, run86n); a third puts the median on the two that agree."""
    repeats: dict[Cell, list[Cell]] = {}
    for cell in cells:  # a cell's repeats differ in their repeat index alone
        repeats.setdefault(dataclasses.replace(cell, repeat=0), []).append(cell)
    more = []
    for runs in repeats.values():
        found = [rows.get(cell.key(hardware_hash)) for cell in runs]
        if len(found) < 2 or any(row is None or row["status"] != "ok" for row in found):
            continue
        if not settled([row["step_seconds_median"] for row in found], over):
            more.append(dataclasses.replace(runs[0], repeat=max(cell.repeat for cell in runs) + 1))
    return more


def settled(times: list[float], over: float) -> bool:
    """Whether the runs the median rests on agree within ``over`` (the slower over the faster,
    less 1): the middle two of an even number, the middle one and its nearer neighbour of an odd
    one. Not the slowest against the fastest: that pair only grows apart with more runs (issue
    17's run90u ran every cell it ran again twice: 7.08, 5.14 and 5.30 ms are settled)."""
    t, m = sorted(times), len(times) // 2
    if len(t) < 2:
        return True
    pair = (t[m - 1], t[m]) if len(t) % 2 == 0 else min((t[m - 1], t[m]), (t[m], t[m + 1]), key=lambda p: p[1] / p[0])
    return pair[1] <= (1 + over) * pair[0]


def _runnable(cells: list[Cell], data_dir: str | None, timeout: float) -> list[tuple[Cell, RunConfig]]:
    """The cells of the PyTorch engine that pass ``check_cell``, with their configuration."""
    out = []
    for cell in cells:
        if cell.engine == "scratch":
            continue
        try:
            out.append((cell, check_cell(cell, data_dir, timeout)))
        except Exception:  # noqa: BLE001  (refused, or a factory that raises: the cell stores why when it runs)
            continue
    return out


def measure(cell: Cell, data_dir: str | None, timeout: float, tick: Callable[[], None] = lambda: None) -> Outcome:
    """Check the cell, run it in fresh processes, and turn what it reported into figures."""
    started = _now()
    if cell.engine == "scratch":
        return measure_scratch(cell, data_dir, timeout, tick)
    try:
        cfg = check_cell(cell, data_dir, timeout)
    except PartrainError as err:
        return Outcome("skipped", str(err), started_at=started, finished_at=_now())
    except Exception as err:  # a user's model factory that raises: the cell fails, the suite goes on
        return Outcome("failed", f"{type(err).__name__}: {err}", started_at=started, finished_at=_now())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    if cell.nodes:  # one torchrun per emulated node; the namespaces go when the cell ends
        with nodes.emulated(cell) as emulated:
            status, reason, result = run_processes(nodes.train_across(emulated, cell, cfg.to_argv()), timeout, tick,
                                                   emulated.env(child_env()))
    else:
        status, reason, result = run_process(train_command(cfg), timeout, tick)
    # the defaults the run resolved (pipeline stages, replicas, micro-batches, stage cut) are stored with it
    resolved = {"pp": cfg.dims.pp, "dp": cfg.dims.dp, "microbatches": cfg.num_microbatches if cfg.pipeline_schedule else None}
    outcome = Outcome(status, reason, config={**cfg.to_dict(), "resolved": resolved}, started_at=started,
                      finished_at=_now(), wall_seconds=time.perf_counter() - t0, load_average=load)
    if result is not None:
        outcome.figures = figures(cell, result)
        resolved["split_points"] = result.get("split_points")  # the cut the run chose, for validate
    return outcome


def measure_scratch(cell: Cell, data_dir: str | None, timeout: float, tick: Callable[[], None]) -> Outcome:
    """``measure`` for a cell of the scratch engine: the same process, timeout and figures."""
    from partrain.scratch.bench import argv, scratch_config, stored_config

    started = _now()
    try:
        cfg = scratch_config(cell, data_dir, timeout)
    except PartrainError as err:
        return Outcome("skipped", str(err), started_at=started, finished_at=_now())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    status, reason, result = run_process([*python_command(), "-m", "partrain", "train", *argv(cfg), "--json", "--quiet"],
                                         timeout, tick)
    outcome = Outcome(status, reason, config=stored_config(cfg), started_at=started, finished_at=_now(),
                      wall_seconds=time.perf_counter() - t0, load_average=load)
    if result is not None:
        outcome.figures = figures(cell, result)
    return outcome


def check_cell(cell: Cell, data_dir: str | None, timeout: float) -> RunConfig:
    """The cell's ``RunConfig`` if it can run here; else ``PartrainError`` with the reason.

    The same checks as ``partrain train``: ``RunConfig`` validation (workers, batch
    divisibility, micro-batches) and the launcher's preflight (data present, pipeline
    stages <= model blocks). One check more: a pipeline on one worker is serial training
    through the pipeline machinery, measured already by the serial cell.
    """
    cfg = cell.run_config(data_dir, timeout)
    if cfg.kind == "pipeline" and cfg.workers == 1:
        raise PartrainError(f"a {cfg.strategy} pipeline needs 2 or more workers; on one worker it is serial")
    if cell.nodes:
        nodes.check_across(cell, cfg)
    preflight(cfg)
    return cfg


def train_command(cfg: RunConfig) -> list[str]:
    """``python -P -m partrain train`` with ``cfg``'s settings (``RunConfig.to_argv``, the
    command line ``recommend`` prints)."""
    return [*python_command(), "-m", "partrain", "train", *cfg.to_argv(), "--json", "--quiet"]


def figures(cell: Cell, result: dict) -> dict:
    """The stored figures of a finished run (``RunResult.to_dict()``).

    Step times drop the first ``warmup_steps`` (allocation, first-touch, the pipeline's
    shape inference). Seconds per epoch are measured when the cell ran whole epochs; in
    steps mode they are extrapolated, the thesis's method: median step time times the steps
    in one epoch of the complete dataset (or of ``limit`` samples).
    """
    seconds = result["step_seconds"]
    steady = seconds[cell.warmup_steps:] or seconds
    median = statistics.median(steady)
    p10, p90 = (statistics.quantiles(steady, n=10, method="inclusive")[i] for i in (0, 8)) if len(steady) > 1 else (median, median)
    if cell.steps is None:
        epochs = result["epochs"]
        per_epoch = statistics.fmean(e["seconds"] for e in epochs)
        epoch_samples = epochs[0]["steps"] * cell.batch_size
        accuracy = epochs[-1]["test_accuracy"]
    else:
        samples = min(dataset_spec(cell.dataset).train_size, cell.limit or sys.maxsize)
        epoch_samples = samples // cell.batch_size * cell.batch_size
        per_epoch = median * (samples // cell.batch_size)
        accuracy = None
    per_worker = result.get("peak_memory_per_worker") or [result["peak_memory_bytes"]]
    return {
        "steps_run": len(result["step_losses"]),
        "measured_steps": len(steady),
        "step_seconds_median": median,
        "step_seconds_p10": p10,
        "step_seconds_p90": p90,
        "seconds_per_epoch": per_epoch,
        "epoch_extrapolated": int(cell.steps is not None),
        "epoch_samples": epoch_samples,
        "samples_per_s": cell.batch_size / median,
        "peak_memory_bytes": max(per_worker),
        "peak_memory_per_worker": per_worker,
        "test_accuracy": accuracy,
        "final_loss": result["step_losses"][-1] if result["step_losses"] else None,
        "partition": result.get("partition"),
        "device": run_device(result),
    }


def run_device(result: dict) -> str:
    """What a finished run trained on: the GPU's name when its backend was NCCL (train puts
    every worker on a GPU then), else "cpu"."""
    gpu = fingerprint().gpu
    return gpu if result.get("backend") == "nccl" and gpu else "cpu"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class CellProgress:
    """One bar over the cells, with an ETA and the current cell, on stderr; a line per cell.

    The ETA is the cells' own mean seconds (``end``'s) times the cells left: the profiles a
    model's or a link's first cell waits for are taken once, not once a cell. Reckoned from
    the time elapsed, issue 18's ``suites/nodes.toml`` (184 cells, a link profiled across the
    emulated nodes before each of its first seven that run on nodes) read an ETA of 38,464 s
    with eight cells done, and took 72 minutes in all (run116n).

    Redrawn by hand (``refresh``, from the runner's poll loop) rather than by rich's
    refresh thread: the runner forks cell processes, and forking while another thread
    holds a lock is how a child deadlocks.
    """

    _STYLE = {"ok": "green", "skipped": "yellow", "failed": "red", "timeout": "red", "measured": "dim"}

    def __init__(self, total: int, enabled: bool):
        self.enabled = enabled
        self.counts: dict[str, int] = {}
        self.console = Console(stderr=True, highlight=False, soft_wrap=True)
        self.bar = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("({task.remaining:.0f} left)"),
            TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"), console=self.console, auto_refresh=False,
        )
        self.task = self.bar.add_task("cells", total=total, eta="-")
        self.ran, self.ran_s = 0, 0.0  # the cells run so far and their seconds

    def __enter__(self) -> CellProgress:
        if self.enabled:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        self.bar.stop()
        summary = ", ".join(f"{n} {status}" for status, n in self.counts.items())
        self.console.print(f"{sum(self.counts.values())} cells: {summary}")

    def begin(self, cell: Cell) -> None:
        if not self.enabled:
            return
        self.bar.update(self.task, description=cell.label)
        self.bar.refresh()
        if not self.console.is_terminal:  # a log gets no live bar: one line per cell instead
            task = self.bar.tasks[0]
            done, left = int(task.completed), int(task.total - task.completed)
            eta = f", ETA {self._eta(left)}" if self.ran else ""
            self.console.print(f"[{done + 1}/{task.total:.0f}, {left - 1} left after it{eta}] {cell.label}")

    def _eta(self, left: int) -> str:
        """The cells ``left`` at the mean seconds of those run so far (at least one)."""
        return f"{self.ran_s / self.ran * left:.0f} s"

    def refresh(self) -> None:
        if self.enabled:
            self.bar.refresh()

    def more(self, n: int) -> None:
        """``n`` more cells to run than counted at the start (cells run again)."""
        self.bar.update(self.task, total=self.bar.tasks[0].total + n)

    def end(self, cell: Cell, outcome: Outcome | None, seconds: float = 0.0) -> None:
        """``outcome`` None: the cell was measured before and not run again; else it ran for
        ``seconds`` (its process, its profiles apart)."""
        status = outcome.status if outcome else "measured"
        self.counts[status] = self.counts.get(status, 0) + 1
        if outcome is not None:
            self.ran, self.ran_s = self.ran + 1, self.ran_s + seconds
        if not self.enabled:
            return
        if outcome is None:
            detail = "measured before (--force runs it again)"
        elif outcome.status == "ok":
            f = outcome.figures
            mark = " (extrapolated)" if f["epoch_extrapolated"] else ""
            detail = f"{f['step_seconds_median'] * 1e3:.2f} ms/step, {f['seconds_per_epoch']:.1f} s/epoch{mark}"
        else:
            detail = outcome.reason or ""
        self.console.print(Text.assemble((f"{status:<8}", self._STYLE[status]), f" {cell.label}: {detail}"))
        if outcome is None:  # nothing to run: out of the count the ETA is reckoned over (it read 0 s on a resume)
            self.bar.update(self.task, total=self.bar.tasks[0].total - 1)
        else:
            left = self.bar.tasks[0].total - self.bar.tasks[0].completed - 1
            self.bar.update(self.task, advance=1, eta=self._eta(left))
        self.bar.refresh()
