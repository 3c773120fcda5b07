"""How much slower this model's own compute runs when k workers share the node.

The hardware profile's sharing probe (``profile.step_probes.measure_compute_sharing``) times
one fixed convolution side by side; a model whose step is mostly small matrix products,
LayerNorm and Python (a token model), or a bigger one that streams more memory, shares the
cores, caches and memory bandwidth differently. Issue 17 measured every 2-worker
data-parallel cell of such a user model over-predicted by 13-28% with the convolution's
factor, while its 1-worker cells were within 4-9%. So the model profile measures the factor
for the model itself:

- ``k - 1`` fresh processes (started as ``profile.probe`` starts its probe: this interpreter,
  the caller's import path) each build the model and a batch of the profile's data, and then
  wait on their stdin, asleep, costing nothing;
- the profiler times the model's forward + backward (what the predictor multiplies by the
  factor) alone, then while the first ``j - 1`` of the others run the same step in a loop, for
  j = 2..k; alone and side by side alternate over a few rounds, each window's median step
  kept;
- factor(j) = CPU time per step side by side / alone, never below 1 (``sharing_factors``):
  SMT siblings, caches and memory bandwidth shared, as this model uses them
  (memory-bandwidth contention is inside it, not modelled apart). Each round's ratio is
  of its own two windows, adjacent in time, and the factor is the median of the rounds'.
  A core of the 2-vCPU VM runs at one of two speeds in spells of seconds (the same step's
  CPU time 1.6 ms in one, 2.5-2.8 ms in the other): a spell that begins between a round's
  two windows spoils that round, not the factor. (The fastest window alone against the
  fastest side by side, as this took it before, read a factor of 1.51 for the gallery's
  traced model in run64u, where fifteen probes of it in a row on a quiet machine read
  0.96-1.03 that way and 0.98-1.03 by rounds: its windows alone had a fast spell, those
  side by side none.)
- a factor over ``SUSPECT`` is measured again after a pause, each k's lowest kept
  (``confirmed``): a spell can also outlast all the rounds.

Cost: the others start beside the memory probe (``start_corunners``), whose own start-up is
not timed, so their start costs no wall time of its own; then ``rounds`` alternations of a
window alone and one per k side by side, each ``window_s`` and at least ``MIN_STEPS`` steps,
and one step per co-runner to start and stop it: about 0.5 s for a model of milliseconds a
step, 1-2 s for one of 30 ms (gpt at batch 32), on 2 workers, twice or thrice that for a
suspect factor. The profiler process itself is
the timed worker, so the one measured ratio is of one process against itself, whatever
differs between processes.
"""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from partrain.errors import PartrainError

MIN_STEPS, WINDOW_S, ROUNDS = 3, 0.04, 6
# a factor over SUSPECT is measured again, up to CONFIRMATIONS times, PAUSE_S apart (``confirmed``)
SUSPECT, CONFIRMATIONS, PAUSE_S = 1.2, 2, 1.0
MAX_WORKERS = 8  # co-runners cost a process start each
START_TIMEOUT_S = 120.0  # importing torch and building the model, on a loaded machine
BUSY, IDLE, QUIT = b"b", b"i", b"q"  # one-byte commands on a co-runner's stdin


def training_step(net: torch.nn.Module, x, y) -> Callable[[], None]:
    """The model's forward and backward on one batch: the compute the predictor scales.

    The loss is a sliver of a step (the profile times it apart); a log-sum-exp over the
    logits stands in for the cross-entropy, so that a co-runner need not import the training
    machinery (``strategies`` brings torch.distributed's pipelining and DTensor: a second
    of start-up per process). ``y`` is unused for that reason."""

    def step() -> None:
        net.zero_grad(set_to_none=True)
        net(x).logsumexp(-1).mean().backward()

    return step


def corunner() -> None:
    """Entry point of a co-runner: build the model and a batch, then on ``BUSY`` run training
    steps until the next command arrives, on ``IDLE`` wait, on ``QUIT`` (or a closed stdin) exit."""
    args = json.loads(sys.argv[1])
    from partrain.data import load_dataset
    from partrain.distributed.launch import keep_freed_memory
    from partrain.distributed.spawn import leave_at_once
    from partrain.models import build_model

    keep_freed_memory()  # as a training worker does
    torch.set_num_threads(args["threads"])
    train_set = load_dataset(args["dataset"], "train", data_dir=args["data_dir"], synthetic=args["synthetic"])
    torch.manual_seed(args["seed"])
    net = build_model(args["model"], tuple(args["input_shape"]), args["num_classes"], **args["options"])
    step = training_step(net, *train_set.get(torch.arange(args["batch"]) % len(train_set)))
    step()  # warm: the allocator's pages and the thread pool exist before any timing
    _say("ready")
    while (command := os.read(0, 1)) and command != QUIT:
        if command == BUSY:
            step()
            _say("busy")  # running: the profiler starts its window only now
            while not select.select([0], [], [], 0)[0]:
                step()
        else:
            _say("idle")
    leave_at_once()  # the profiler waits on this process's exit (``CoRunners.close``): not on its teardown


def _say(word: str) -> None:
    sys.stdout.write(word + "\n")
    sys.stdout.flush()


class CoRunners:
    """``n`` co-runner processes; ``busy(j)`` sets the first ``j`` running, ``idle()`` stops them.

    They start at once and are waited for at the first command: the profiler starts them
    before its memory probe, whose own start-up (importing torch, loading the data) is not
    timed, so that theirs costs no wall time of its own; they are asleep on their stdin,
    built and warm, long before the probe times anything."""

    def __init__(self, n: int, args: dict, timeout_s: float = START_TIMEOUT_S):
        from partrain.distributed.spawn import child_env, python_command

        self.timeout_s, self.running, self.started = timeout_s, 0, False
        self.errors = [tempfile.TemporaryFile() for _ in range(n)]
        code = "from partrain.profile.sharing import corunner; corunner()"
        self.procs = [subprocess.Popen([*python_command(), "-c", code, json.dumps(args)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=err, env=child_env()) for err in self.errors]

    @property
    def n(self) -> int:
        return len(self.procs)

    def wait_ready(self) -> None:
        """Wait until every co-runner has built its model and taken a warm-up step."""
        if not self.started:
            for i in range(self.n):
                self._expect(i, "ready")
            self.started = True

    def busy(self, j: int) -> None:
        for i in range(j):
            self._send(i, BUSY)
        for i in range(j):
            self._expect(i, "busy")
        self.running = j

    def idle(self) -> None:
        for i in range(self.running):
            self._send(i, IDLE)
        for i in range(self.running):
            self._expect(i, "idle")
        self.running = 0

    def _send(self, i: int, command: bytes) -> None:
        self.procs[i].stdin.write(command)
        self.procs[i].stdin.flush()

    def _expect(self, i: int, word: str) -> None:
        """Read one line of co-runner ``i`` within the timeout; one clear error if it died or hung."""
        proc = self.procs[i]
        ready = select.select([proc.stdout], [], [], self.timeout_s)[0]
        line = proc.stdout.readline().decode().strip() if ready else None
        if line != word:
            self.errors[i].seek(0)
            last = (self.errors[i].read().decode(errors="replace").strip().splitlines() or ["no output"])[-1]
            why = "timed out" if line is None else f"exited ({last})"
            raise PartrainError(f"measuring the model's compute side by side failed: a co-runner {why}")

    def close(self) -> None:
        for proc in self.procs:
            try:
                proc.stdin.write(QUIT)
                proc.stdin.close()
            except OSError:  # already gone
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for err in self.errors:
            err.close()

    def __enter__(self) -> CoRunners:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _window(step: Callable[[], None], window_s: float) -> tuple[float, float]:
    """(median wall seconds, median CPU seconds of this process) of ``step`` over at least
    ``MIN_STEPS`` calls and about ``window_s``."""
    walls, cpus, start = [], [], time.perf_counter()
    while len(walls) < MIN_STEPS or time.perf_counter() - start < window_s:
        t, c = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def measure_sharing(step: Callable[[], None], others: CoRunners, window_s: float = WINDOW_S,
                    rounds: int = ROUNDS) -> dict[int, dict[str, float]]:
    """k -> {"alone_s", "together_s", "alone_cpu_s", "together_cpu_s", "cpu_ratio"}: ``step``
    (this process's own model step) timed alone and while k - 1 of ``others`` run the same
    step, for k = 2..others.n + 1; wall and CPU seconds, each the fastest round's window
    median, and the median over the rounds of each round's CPU seconds side by side / alone."""
    others.wait_ready()
    alone: list[tuple[float, float]] = []
    together: dict[int, list[tuple[float, float]]] = {k: [] for k in range(2, others.n + 2)}
    step()
    for _ in range(rounds):  # alternated: a passing slowdown of the machine spoils one round, not the minimum
        alone.append(_window(step, window_s))
        for k in together:
            others.busy(k - 1)
            together[k].append(_window(step, window_s))
            others.idle()
    wall, cpu = min(w for w, _ in alone), min(c for _, c in alone)
    return {k: {"alone_s": wall, "together_s": min(w for w, _ in t), "alone_cpu_s": cpu, "together_cpu_s": min(c for _, c in t),
                "cpu_ratio": statistics.median(c / a for (_, a), (_, c) in zip(alone, t))}
            for k, t in together.items()}


def sharing_factors(raw: dict[int, dict[str, float]]) -> dict[int, float]:
    """k -> slowdown of the model's compute with k workers side by side, never below 1: the
    ratio of CPU seconds per step (what sharing caches, SMT siblings and memory bandwidth
    costs; processor sharing of the cores, k over the cores, is the predictor's own floor),
    each round's own, their median (``measure_sharing``).
    Unlike wall time, CPU time does not count the waits for a core that other processes on
    the machine cause: on the loaded 2-core VM the wall ratio of one model ranged 1.02-2.2x
    between repeats while its CPU ratio stayed within 1.0-1.2x."""
    return {int(k): max(1.0, t["cpu_ratio"]) for k, t in raw.items()}


def sharing_workers() -> int:
    """Co-located workers the model profile measures, 2 up to this machine's cores (at most
    ``MAX_WORKERS``): beyond the cores processor sharing decides (``predict.compute.contention``),
    with the hardware probe's factor where it measured more."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(2, min(MAX_WORKERS, cores))


def start_corunners(job: dict, batch: int) -> CoRunners:
    """The co-runners of ``profile_sharing``, started now: ``sharing_workers() - 1`` fresh
    processes building the model of ``job`` (model, dataset, input_shape, num_classes,
    threads, data_dir, synthetic, options, seed) with ``batch`` rows of its data."""
    return CoRunners(sharing_workers() - 1, {**job, "batch": batch})


def confirmed(measure: Callable[[], dict[int, float]], pause: Callable[[float], None] = time.sleep) -> dict[int, float]:
    """``measure()``'s factors; while one is over ``SUSPECT``, measured again ``PAUSE_S`` later
    (at most ``CONFIRMATIONS`` times), each k's lowest kept.

    A spell of the host can hold through a whole measurement: in issue 17's run69u the gallery's
    tuple_out model read 2.00 at k = 2 (every round of six), where fifteen measurements of it
    in a row afterwards read 0.90-1.33, and its 2-worker data-parallel cells, predicted with the
    2.00, came out 24-48% over. Such a spell only ever slows the side-by-side windows (a model
    cannot compute faster beside another), so the lowest of the measurements is the model's;
    a factor the model truly has reads high every time and stays. Cost: nothing for a factor
    under ``SUSPECT``; otherwise up to two more measurements (0.5 s for a model of
    milliseconds a step, 2 s for one of 60 ms) and their pauses."""
    factors = measure()
    for _ in range(CONFIRMATIONS):
        if max(factors.values(), default=1.0) <= SUSPECT:
            break
        pause(PAUSE_S)
        again = measure()
        factors = {k: min(v, again[k]) for k, v in factors.items()}
    return factors


def profile_sharing(net: torch.nn.Module, train_set, batch: int, others: CoRunners) -> dict[int, float]:
    """k -> this model's compute sharing factor at ``batch`` rows, for k = 2..others.n + 1."""
    x, y = train_set.get(torch.arange(batch) % len(train_set))
    step = training_step(net, x, y)
    return confirmed(lambda: sharing_factors(measure_sharing(step, others)))
