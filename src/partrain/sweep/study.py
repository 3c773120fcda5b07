"""The loop one slot runs in the sweep's Optuna study: ask, train, tell, until N are finished.

The study lives in Optuna's database storage (``storage``: where, and which sweep it is). A slot is one process that
runs trials one after another, each trial ``k``-way data parallel; ``W / k`` slots run side by side.

"N trials" counts trials that reached a verdict: COMPLETE, PRUNED, or FAIL because the
training itself raised (its error is kept). A trial interrupted by a kill never reaches one:
it stays RUNNING in the storage. It is reclaimed -- marked FAIL and queued again with the
same parameters (Optuna's RetryHeartbeatStaleTrialCallback) -- at once when its slot ran on
this host and that process is gone, else when its heartbeat is older than the grace period,
or when it never named its slot within that period (killed just after Optuna created it).
So a killed sweep, run again, reruns what was interrupted, keeps what finished, and counts
nothing twice.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import warnings
from dataclasses import dataclass

from partrain.config import RunConfig
from partrain.distributed.spawn import alive, die_with_parent, leave_at_once
from partrain.errors import PartrainError
from partrain.sweep.space import Dimension, train_command, trial_config
from partrain.sweep.storage import GRACE_S, open_study

POLL_S = 2.0  # how often a slot with nothing to start checks on trials in flight elsewhere


@dataclass
class SweepSettings:
    """Everything a slot needs, picklable: it is handed to spawned slot processes."""

    storage: str
    study: str
    trials: int
    dims: list[Dimension]
    base: RunConfig
    sampler: str = "tpe"
    seed: int = 0
    prune: bool = True
    grid_points: int = 3
    quiet: bool = True
    slot: int = 0
    trials_before: int = 0  # trials in the study when this run started: a resumed sweep draws anew

    @property
    def sampler_seed(self) -> int:
        """Fixed by --seed for a fresh sweep; different per slot (else slots draw alike) and per
        resume (else a rerun slot draws the same values again)."""
        return (self.seed * 1_000_003 + self.trials_before * 1009 + self.slot) % 2**31


def grid_points(settings: SweepSettings) -> list[dict]:
    """Every point of the grid, in an order shuffled by --seed (so N < all visits a random subset)."""
    import itertools
    import random

    names = [d.name for d in settings.dims]
    points = [dict(zip(names, values)) for values in itertools.product(*(d.grid(settings.grid_points) for d in settings.dims))]
    random.Random(settings.seed).shuffle(points)
    return points


def enqueue_grid(study, settings: SweepSettings) -> int:
    """Queue the grid points the study has not got yet as WAITING trials. A slot's ``ask``
    takes a waiting trial atomically, so slots side by side never draw the same point
    (Optuna's GridSampler can, when two ask at once). Returns how many were queued."""
    from optuna.trial import TrialState

    def key(params: dict) -> tuple:
        return tuple(sorted(params.items()))

    have = {key(t.system_attrs.get("fixed_params") or t.params) for t in study.get_trials(deepcopy=False)
            if t.state != TrialState.FAIL or "error" in t.user_attrs}
    todo = [p for p in grid_points(settings) if key(p) not in have]
    for point in todo:
        study.enqueue_trial(point, skip_if_exists=False)
    return len(todo)


# ---- counting and reclaiming ------------------------------------------------------------------


def has_verdict(t) -> bool:
    from optuna.trial import TrialState

    return t.state in (TrialState.COMPLETE, TrialState.PRUNED) or (t.state == TrialState.FAIL and "error" in t.user_attrs)


def counts(study) -> tuple[int, int]:
    """(trials with a verdict, trials running now)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    return sum(map(has_verdict, trials)), sum(t.state == TrialState.RUNNING for t in trials)


def _slot_gone(t, host: str) -> bool:
    """The trial ran in a slot on this host and that process is gone."""
    return t.user_attrs.get("host") == host and "pid" in t.user_attrs and not alive(t.user_attrs["pid"])


def _orphan(t) -> bool:
    """The trial says neither where it runs nor that it is alive: its slot was killed between
    Optuna's ask and the objective's first line, before the heartbeat thread's first beat.
    Optuna's stale check never sees a trial without a heartbeat, so, unclaimed, it would stay
    RUNNING for ever and the slots would wait on it. A live slot names itself within
    milliseconds of the ask; after the grace period nobody will."""
    from datetime import datetime

    return "pid" not in t.user_attrs and t.datetime_start is not None \
        and (datetime.now() - t.datetime_start).total_seconds() > GRACE_S


def reclaim_interrupted(study, failed_too: bool = False) -> int:
    """Fail and requeue this host's RUNNING trials whose slot process is gone, and every
    trial whose heartbeat went stale (Optuna's own check, for other hosts). With
    ``failed_too`` (the sweep's start, one process) also requeue trials that failed without
    a verdict and were never run again: a Ctrl-C marks its trials FAIL. Returns how many."""
    import optuna
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.storages import RetryHeartbeatStaleTrialCallback
    from optuna.trial import TrialState

    storage, host, n = study._storage, socket.gethostname(), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = RetryHeartbeatStaleTrialCallback()
    trials = study.get_trials(deepcopy=False)
    for t in trials:
        if t.state == TrialState.RUNNING and (_slot_gone(t, host) or _orphan(t)):
            try:  # atomic: of several slots reclaiming at once, one succeeds
                storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
            except UpdateFinishedTrialError:
                continue
            retry(study, storage.get_trial(t._trial_id))
            n += 1
    if failed_too:
        retried = {number for t in trials for number in t.system_attrs.get("retry_history", [])}
        for t in trials:
            if t.state == TrialState.FAIL and not {"error", "surplus"} & t.user_attrs.keys() and t.number not in retried:
                retry(study, t)
                n += 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    return n


def _is_surplus(study, number: int, wanted: int) -> bool:
    """True when ``wanted`` earlier trials are finished or running: two slots asked at once
    for the last trial, and this one came second."""
    from optuna.trial import TrialState

    earlier = [t for t in study.get_trials(deepcopy=False) if t.number < number]
    return sum(has_verdict(t) or t.state == TrialState.RUNNING for t in earlier) >= wanted


# ---- one trial --------------------------------------------------------------------------------


class EpochReporter:
    """The training loop's ``on_epoch`` hook: report the epoch's test accuracy to the trial and
    answer whether the pruner stops it. Picklable: a k-way trial's rank 0 is another process,
    which opens the storage itself."""

    def __init__(self, settings: SweepSettings, trial_id: int, trial=None, epochs: int | None = None):
        self.settings, self.trial_id, self._trial, self.epochs = settings, trial_id, trial, epochs

    def __getstate__(self):
        return {**self.__dict__, "_trial": None}

    def __call__(self, ep) -> bool:
        import optuna

        if self._trial is None:
            self._trial = optuna.Trial(open_study(self.settings), self.trial_id)
        accuracy = ep.test_accuracy if ep.test_accuracy is not None else -ep.train_loss
        self._trial.report(accuracy, ep.epoch)
        if self.epochs is not None and ep.epoch >= self.epochs:
            return False  # the trial's last epoch: it is complete, not pruned
        return bool(self._trial.should_prune())


class TrialError(Exception):
    """A trial whose training raised a PartrainError: recorded as FAIL with its reason."""


class Surplus(Exception):
    """A trial asked for after N were already under way."""


def objective(settings: SweepSettings, study):
    import optuna

    from partrain.runner import run_training

    def run(trial) -> float:
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", os.getpid())
        params = {d.name: d.suggest(trial) for d in settings.dims}
        if _is_surplus(study, trial.number, settings.trials):
            trial.set_user_attr("surplus", True)
            if settings.sampler == "grid":
                study.enqueue_trial(params)  # the point goes back in the queue, not lost
            study.stop()
            raise Surplus()
        try:
            cfg = trial_config(settings.base, params)
            # the command this trial runs, kept with it: "reproduce it" prints the best trial's own
            trial.set_user_attr("command", train_command(cfg))
            start = time.perf_counter()
            result = run_training(cfg, show_progress=False, on_epoch=EpochReporter(settings, trial._trial_id, trial, cfg.epochs))
        except PartrainError as err:
            trial.set_user_attr("error", str(err))
            raise TrialError(str(err)) from None
        trial.set_user_attr("seconds", time.perf_counter() - start)
        trial.set_user_attr("steps", len(result.step_losses))
        trial.set_user_attr("seconds_per_step", result.summary()["seconds_per_step"])  # median, rank 0
        if result.stopped_early:
            raise optuna.TrialPruned()
        return result.test_accuracy if result.test_accuracy is not None else -result.step_losses[-1]

    return run


def run_slot(settings: SweepSettings) -> int:
    """One slot's loop: trials one after another until the study has ``settings.trials``
    verdicts; waits while the last ones run elsewhere. Returns the trials this slot ran."""
    from optuna.exceptions import UpdateFinishedTrialError

    study = open_study(settings)
    ran = 0
    while True:
        if _stopping:  # told to stop, and the KeyboardInterrupt was lost (raised where it is ignored)
            raise KeyboardInterrupt
        reclaim_interrupted(study)
        done, running = counts(study)
        if done >= settings.trials:
            return ran
        if done + running >= settings.trials:  # the rest are under way in other slots
            time.sleep(POLL_S)
            continue
        try:
            study.optimize(objective(settings, study), n_trials=1, catch=(TrialError, Surplus))
        except (UpdateFinishedTrialError, ValueError) as err:
            # another slot finished this trial while it ran here: two slots popped the same queued
            # trial at once (SQLite takes no row lock), or one reclaimed it. Its verdict is the
            # other's, so this slot goes on. Seen twice in clean-clone CI runs on 2 loaded cores,
            # as "Trial#1 has already finished" and "Cannot tell a COMPLETE trial."
            if isinstance(err, ValueError) and not str(err).startswith("Cannot tell a"):
                raise
        ran += 1


_stopping = False


def _interrupt(signum, frame):
    """A slot's first SIGTERM or Ctrl-C ends its trial as Ctrl-C ends `partrain train`; any
    later one is ignored, or it would cut short the cleanup the first started (a Ctrl-C at the
    terminal reaches the slot, and then the sweep's SIGTERM does too). A flag, not SIG_IGN:
    spawn puts back the SIGINT handler it found once its workers have started."""
    global _stopping
    if _stopping:
        return
    _stopping = True
    raise KeyboardInterrupt


def slot_main(settings: SweepSettings) -> int:
    """Entry point of a spawned slot: die with the sweep that started it (Linux), so a killed
    sweep leaves no slot behind to race the next one. Asked to stop (SIGTERM, Ctrl-C), it
    stops its trial's workers, removes their temporary folder and exits 130, quietly."""
    die_with_parent(signal.SIGKILL)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        if settings.base.threads:
            import torch

            torch.set_num_threads(settings.base.threads)
        return run_slot(settings)
    except KeyboardInterrupt:
        # the sweep says it was interrupted; a traceback per slot would say nothing more. Its trial
        # is told and its workers' folder removed: leaving skips the interpreter's shutdown, which
        # with torch loaded took 4 s on 2 busy cores, near the sweep's grace before it kills the slot
        leave_at_once(130)
