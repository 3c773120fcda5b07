"""Progress on rank 0: one rich bar over the steps, with loss and throughput; ``phase``
lines for long work that has phases rather than steps (profiling). All on stderr.

Workers other than rank 0, ``--json`` and ``--quiet`` get a no-op bar. A rich update
costs about a millisecond, more than a whole MLP step, so the bar is updated at most
every ``REFRESH_S`` seconds; the loss tensor is read (a device sync on GPU) only then.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

console = Console(stderr=True)
REFRESH_S = 0.25
_started = time.perf_counter()


def phase(what: str, text: str) -> None:
    """One line on stderr: ``what: text``, with the seconds since this process started.

    ``sys.stderr`` directly, not rich: a rich status spinner around the work (``recommend``)
    captures and prints it above itself, and a log file gets plain lines in order.
    """
    import sys

    print(f"[{time.perf_counter() - _started:6.1f} s] {what}: {text}", file=sys.stderr, flush=True)


class StepProgress:
    def __init__(self, enabled: bool, total: int, completed: int = 0, label: str = "train"):
        self.enabled = enabled
        self.total, self.completed, self.label = total, completed, label
        self.samples, self.start = 0, time.perf_counter()
        self.pending, self.last_draw = 0, 0.0
        if enabled:
            self.bar = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
                TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False,
            )
            self.task = self.bar.add_task(label, total=total, completed=completed, loss="-", rate="-")

    def __enter__(self):
        if self.enabled:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.update(self.task, advance=self.pending)
            self.bar.stop()

    def extend(self, steps: int) -> None:
        """``steps`` more than announced (train's --min-seconds)."""
        self.total += steps
        if self.enabled:
            self.bar.update(self.task, total=self.total)

    def advance(self, loss, batch: int) -> None:
        if not self.enabled:
            return
        self.samples += batch
        self.pending += 1
        now = time.perf_counter()
        if now - self.last_draw < REFRESH_S:
            return
        fields = {"rate": f"{self.samples / (now - self.start):,.0f}"}
        if loss is not None:
            fields["loss"] = f"{float(loss):.4f}"
        self.bar.update(self.task, advance=self.pending, **fields)
        self.pending, self.last_draw = 0, now

    def epoch_done(self, ep) -> None:
        if not self.enabled:
            return
        acc = f", test accuracy {ep.test_accuracy:.2%} (loss {ep.test_loss:.4f})" if ep.test_accuracy is not None else ""
        self.bar.console.print(
            f"epoch {ep.epoch}: train loss {ep.train_loss:.4f}, {ep.seconds:.1f} s, {ep.samples_per_s:,.0f} samples/s{acc}"
        )
