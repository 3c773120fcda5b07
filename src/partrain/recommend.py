"""The recommender: enumerate plans, drop what cannot run or fit, rank, explain.

Given a model profile and a hardware profile (measured, or a cluster described in TOML),
every candidate plan — strategy x worker count (1, 2, 4, ... up to N: fewer workers can
win) x (pp, dp) split x micro-batches x schedule x batch — is predicted by
``partrain.predict``. Plans that cannot run (invalid split, too few blocks, a batch that
does not divide) or do not fit the memory limit are kept with their reason; the rest are
ranked by predicted seconds per epoch (or by memory). The explanation compares the
winner with the best plan of every other strategy and re-ranks under changed conditions
(a faster or slower link, more memory) to say what would change the answer.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

from partrain.config import RunConfig
from partrain.errors import PartrainError
from partrain.predict.comm import with_link_bytes_scaled
from partrain.predict.pipeline import pinned_cut
from partrain.predict.plan import (
    Plan,
    candidate_plans,
    enumerate_plans,
    local_workers,
    threads_for,
)
from partrain.predict.prediction import Prediction
from partrain.predict.predictor import predict_plan
from partrain.predict.profiles import HardwareProfile, ModelProfile
from partrain.spec import SPECS

FREE_BATCH_PER_WORKER = (32, 64, 128)  # per-worker batches tried when the global batch is free
# strategies that do not reproduce serial training -> why, in words (ranked only with --async)
ASYNCHRONOUS = {name: spec.asynchronous_because for name, spec in SPECS.items() if not spec.synchronous}
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """``"2GB"``, ``"512 MiB"``, ``"1.5g"`` or a plain number of bytes (units are powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise PartrainError(f"cannot read {text!r} as a memory size: write e.g. 2GB, 512MB or 1073741824")
    size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size < 1:
        raise PartrainError(f"a memory size must be more than 0 bytes, got {text!r}")
    return size


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def worker_counts(n: int) -> list[int]:
    """1, 2, 4, ... below ``n``, and ``n`` itself."""
    counts = [1]
    while counts[-1] * 2 < n:
        counts.append(counts[-1] * 2)
    return sorted({*counts, n})


def batch_choices(workers: int, batch_size: int | None) -> list[int]:
    return [batch_size] if batch_size else [b * workers for b in FREE_BATCH_PER_WORKER]


def needed_batch_sizes(max_workers: int, batch_size: int | None) -> list[float]:
    """Every per-worker and micro-batch size the candidates will be predicted at."""
    return sorted({size for w in worker_counts(max_workers) for b in batch_choices(w, batch_size)
                   for plan in candidate_plans(w, b) for size in plan.batch_sizes()})


@dataclass
class Recommendation:
    model: str
    dataset: str
    hardware: HardwareProfile
    objective: str  # "time" | "memory"
    ranked: list[Prediction]  # plans that run and fit, best first
    rejected: list[tuple[Plan, str]]  # plans that cannot run or do not fit, with why
    memory_limit: int | None  # per worker, as given; None: the hardware's own
    profile_seconds: float = 0.0
    profile_reused: bool = True
    data_dir: str | None = None
    what_if: list[str] = field(default_factory=list)
    synthetic: bool = False  # the data and options the model was profiled with, which its command keeps
    model_options: dict = field(default_factory=dict)

    @property
    def winner(self) -> Prediction:
        return self.ranked[0]

    def serial_for(self, batch_size: int) -> Prediction | None:
        """Serial training at the same global batch: what speedups are measured against."""
        return next((p for p in self.ranked if p.plan.strategy == "serial" and p.plan.batch_size == batch_size), None)

    def best_by_strategy(self) -> list[Prediction]:
        seen, best = set(), []
        for p in self.ranked:
            if p.plan.strategy not in seen:
                seen.add(p.plan.strategy)
                best.append(p)
        return best

    def config(self, **extra) -> RunConfig:
        """The winner as the run that trains it: the model as profiled (its options, generated
        data or not), on the winner's plan."""
        return self.winner.plan.to_config(self.model, self.dataset, data_dir=self.data_dir, synthetic=self.synthetic,
                                          model_options=self.model_options, **extra)

    def train_args(self) -> list[str]:
        """The winner's ``partrain train`` arguments (``config.to_argv``, as ``bench`` runs cells)."""
        return self.config().to_argv()

    def local_command(self) -> str:
        return shlex.join(["partrain", "train", *self.train_args()])

    def torchrun_command(self) -> str:
        """The winner as one ``torchrun`` line to run on each of the hardware's nodes."""
        plan = self.winner.plan
        nodes = max(1, math.ceil(plan.workers / self.hardware.workers_per_node)) if self.hardware.nodes > 1 else 1
        per_node = math.ceil(plan.workers / nodes)
        args = self.train_args()
        i = args.index("--workers")
        del args[i : i + 2]  # under a launcher the world size comes from it
        head = ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(per_node)]
        if nodes > 1:
            head += ["--node-rank", "$NODE_RANK", "--master-addr", "$MASTER_ADDR", "--master-port", "29500"]
        return " ".join(head) + " -m " + shlex.join(["partrain", "train", *args])

    def explanation(self) -> str:
        """One paragraph in plain words: why the winner wins, and what would change that."""
        w = self.winner
        serial = self.serial_for(w.plan.batch_size)
        parts = [f"{w.plan.label()} on {w.plan.workers} worker{'s' * (w.plan.workers > 1)} is predicted fastest at "
                 f"{w.seconds_per_epoch:.1f} s per epoch ({w.seconds_per_step * 1e3:.1f} ms per step: "
                 f"{_shares(w)})."]
        if w.plan.strategy == "serial":
            runner_up = next((p for p in self.ranked if p.plan.strategy != "serial"), None)
            if runner_up is not None:
                parts.append(f"No parallel plan beats serial here: the best, {runner_up.plan.label()} on "
                             f"{runner_up.plan.workers} workers, is {_slower(runner_up, w)} slower, because "
                             f"{_why_slow(runner_up)}; so the recommendation is serial, on one worker.")
        else:
            if serial is not None:
                speedup = serial.seconds_per_epoch / w.seconds_per_epoch
                parts.append(f"That is {speedup:.2f}x serial ({speedup / w.plan.workers:.0%} parallel efficiency).")
            others = [p for p in self.best_by_strategy() if p is not w][:2]
            if others:
                parts.append("The next best: " + "; ".join(f"{p.plan.label()} ({_versus(p, w)})" for p in others) + ".")
            if w.plan.strategy in ASYNCHRONOUS:
                parts.append(f"Note that {w.plan.strategy} does not reproduce serial training (its updates are "
                             f"{ASYNCHRONOUS[w.plan.strategy]}): check that it reaches your target accuracy, or take the "
                             "best synchronous plan in the table.")
        parts += self.what_if
        return " ".join(parts)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "dataset": self.dataset, "objective": self.objective,
            "hardware": {k: v for k, v in self.hardware.to_dict().items() if k != "points"},
            "memory_limit_bytes": self.memory_limit,
            "winner": self.winner.to_dict(),
            "ranked": [p.to_dict() for p in self.ranked],
            "rejected": [{"plan": p.label(), "cli_args": p.cli_args(), "reason": r} for p, r in self.rejected],
            "explanation": self.explanation(),
            "command": self.local_command(), "torchrun_command": self.torchrun_command(),
            "profile_seconds": self.profile_seconds, "profile_reused": self.profile_reused,
        }


def _workers(n: int) -> str:
    return f"{n} worker{'s' * (n != 1)}"


def _shares(p: Prediction) -> str:
    parts = {"compute": p.compute_s, "exposed communication": p.comm_s, "pipeline bubble": p.bubble_s,
             "optimizer": p.optimizer_s, "data loading": p.data_s}
    total = sum(parts.values()) or 1.0
    return ", ".join(f"{name} {v / total:.0%}" for name, v in parts.items() if v / total >= 0.05)


def _versus(p: Prediction, winner: Prediction) -> str:
    if p.seconds_per_epoch <= 1.02 * winner.seconds_per_epoch:
        return "practically tied"
    return f"{_slower(p, winner)} slower: {_why_slow(p)}"


def _slower(p: Prediction, than: Prediction) -> str:
    return f"{p.seconds_per_epoch / than.seconds_per_epoch - 1:.0%}"


def _why_slow(p: Prediction) -> str:
    """The biggest overhead of a plan, in words."""
    overheads = {"its exposed communication": p.comm_s, "its pipeline bubble": p.bubble_s}
    name, value = max(overheads.items(), key=lambda kv: kv[1])
    if value < 0.1 * p.seconds_per_step:
        return "its workers compete for the same cores" if p.plan.workers > 1 else "it computes everything on one worker"
    return f"{name} takes {value / p.seconds_per_step:.0%} of a step"


def _limit_for(plan: Plan, hardware: HardwareProfile, memory_limit: int | None) -> int:
    if memory_limit is not None:
        return memory_limit
    return hardware.memory_limit_per_worker(local_workers(plan.workers, hardware))


def _rank(preds: list[Prediction], objective: str) -> list[Prediction]:
    if objective == "memory":
        return sorted(preds, key=lambda p: (p.memory_bytes_per_worker, p.seconds_per_epoch))
    return sorted(preds, key=lambda p: p.seconds_per_epoch)


def recommend(profile_for: Callable[[int], ModelProfile], hardware: HardwareProfile, workers: int,
              batch_size: int | None = None, memory_limit: int | None = None, objective: str = "time",
              threads: int | None = None, include_async: bool = False) -> Recommendation:
    """Rank every candidate plan with up to ``workers`` workers on ``hardware``.

    ``profile_for(threads)`` gives the model profile measured with that many intra-op
    threads: on CPU, serial gets every core and N workers get cores / N each, so each
    plan is predicted from the profile of the threads it will really run with.

    Only strategies that reproduce serial training compete unless ``include_async``:
    local SGD and Hogwild train a different model per step, so their time per epoch is
    not comparable without also comparing accuracy.
    """
    if objective not in ("time", "memory"):
        raise PartrainError(f"unknown objective {objective!r}: choose time or memory")
    fits, rejected, too_big, profiles = [], [], [], {}
    for w in worker_counts(workers):
        profile = profiles[w] = profile_for(threads_for(w, hardware, threads))
        for batch in batch_choices(w, batch_size):
            for plan, reason in enumerate_plans(profile, w, batch, threads=threads, with_invalid=True, hardware=hardware):
                if plan.strategy in ASYNCHRONOUS and not include_async:
                    continue
                if reason is not None:
                    rejected.append((plan, reason))
                    continue
                plan = pinned_cut(profile, plan)  # a pipeline's command runs the cut it is predicted with
                pred = predict_plan(profile, hardware, plan)
                limit = _limit_for(plan, hardware, memory_limit)
                if pred.fits(limit):
                    fits.append(pred)
                else:
                    too_big.append(pred)
                    rejected.append((plan, f"out of memory: needs {gib(pred.memory_bytes_per_worker)} per worker, "
                                           f"the limit is {gib(limit)}"))
    if not fits:
        closest = min(too_big, key=lambda p: p.memory_bytes_per_worker, default=None)
        hint = f" (the smallest, {closest.plan.label()}, needs {gib(closest.memory_bytes_per_worker)} per worker)" if closest else ""
        raise PartrainError(f"no plan for {profile.model} on {profile.dataset} fits the memory limit{hint}: "
                            "allow more memory (--memory-limit), more workers, or a smaller --batch-size")
    ranked = _rank(fits, objective)
    rec = Recommendation(profile.model, profile.dataset, hardware, objective, ranked, rejected, memory_limit,
                         synthetic=profile.synthetic, model_options=dict(profile.options))
    on = lambda hw: [predict_plan(profiles[p.plan.workers], hw, p.plan) for p in fits]  # noqa: E731
    rec.what_if = _what_if(rec, on, too_big, objective)
    return rec


def _what_if(rec: Recommendation, on: Callable[[HardwareProfile], list[Prediction]], too_big: list[Prediction],
             objective: str) -> list[str]:
    """Predict the plans that fit again under changed conditions (``on(hardware)``); say which
    would change the winner. A link 10x faster or slower moves the bytes on its wire 10x
    faster or slower (``comm.with_link_bytes_scaled``); its latencies, the CPU's copies and the
    pipelining runtime's waits stay as measured. (Scaling each plan's whole communication time
    instead said "with a 10x slower link, serial would win" for the cnn at 10 Gbit/s on three
    placements of issue 18's emulated nodes, where at 1 Gbit/s local SGD was measured fastest,
    and the recommender picked it.)"""
    notes, winner = [], rec.winner
    for scale, words in ((0.1, "a 10x faster link"), (10.0, "a 10x slower link")):
        alt = _rank(on(with_link_bytes_scaled(rec.hardware, scale)), objective)[0]
        if alt.plan != winner.plan:
            notes.append(f"With {words}, {alt.plan.label()} on {_workers(alt.plan.workers)} would win.")
    if not any(n.startswith("With a 10x") for n in notes):
        notes.append("A 10x faster or slower link would not change the choice.")
    faster_if_bigger = [p for p in too_big if p.seconds_per_epoch < winner.seconds_per_epoch]
    if faster_if_bigger and objective == "time":
        best = min(faster_if_bigger, key=lambda p: p.seconds_per_epoch)
        notes.append(f"With {gib(best.memory_bytes_per_worker)} of memory per worker, {best.plan.label()} on "
                     f"{_workers(best.plan.workers)} would be {winner.seconds_per_epoch / best.seconds_per_epoch - 1:.0%} faster.")
    return notes


def recommendation_table(rec: Recommendation, top: int = 8):
    """The best ``top`` plans with their breakdown, as a rich table."""
    from rich.table import Table

    table = Table(title=f"{rec.model} on {rec.dataset}: best plans by {'memory' if rec.objective == 'memory' else 'time per epoch'}"
                        f" ({rec.hardware.description})")
    for name in ("#", "plan", "workers", "batch", "s/epoch", "ms/step", "compute", "comm", "bubble", "memory/worker", "vs serial"):
        table.add_column(name, justify="left" if name == "plan" else "right")
    for i, p in enumerate(rec.ranked[:top], 1):
        table.add_row(
            str(i), p.plan.label(), str(p.plan.workers), str(p.plan.batch_size), f"{p.seconds_per_epoch:.2f}",
            f"{p.seconds_per_step * 1e3:.2f}", f"{p.compute_s * 1e3:.2f}", f"{p.comm_s * 1e3:.2f}", f"{p.bubble_s * 1e3:.2f}",
            gib(p.memory_bytes_per_worker),
            f"{serial.seconds_per_epoch / p.seconds_per_epoch:.2f}x"
            if (serial := rec.serial_for(p.plan.batch_size)) and p.seconds_per_epoch > 0 else "-",
        )
    return table
