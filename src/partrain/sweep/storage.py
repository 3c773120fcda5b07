"""Where a sweep's Optuna study lives, and which sweep it is: the storage (an SQLite file, or any
SQLAlchemy URL that lets slots on many machines share it), the sampler and pruner, and the
identity a resume must match -- the search space, the model and dataset, and the fixed options
that decide what a trial computes. ``study`` runs the trials in it.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import TYPE_CHECKING

from partrain.config import RunConfig, flag_of
from partrain.errors import PartrainError
from partrain.sweep.space import Dimension

if TYPE_CHECKING:
    from partrain.sweep.study import SweepSettings

HEARTBEAT_S = 10  # each running trial writes a heartbeat this often (one small UPDATE)
GRACE_S = 30  # a trial of another host whose heartbeat is older than this is stale


def storage_url(storage: str | None, study: str) -> str:
    """A database URL; a plain path is an SQLite file; none is ``<study>.sqlite3`` here. An
    SQLite file that another program wrote is refused: Optuna would add its tables beside theirs."""
    if not storage:
        storage = f"{study}.sqlite3"
    if "://" in storage:
        return storage
    if tables := _foreign_tables(storage):
        raise PartrainError(f"--storage {storage} is not an Optuna study storage (it holds tables such as "
                            f"{tables[0]!r}): pass another --storage")
    return f"sqlite:///{os.path.abspath(storage)}"


def _foreign_tables(path: str) -> list[str]:
    """The tables of an existing SQLite file at ``path`` when it holds no Optuna study (none
    otherwise; a file that is not SQLite is left to the storage to refuse)."""
    import sqlite3

    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return []
    try:
        with contextlib.closing(sqlite3.connect(f"file:{os.path.abspath(path)}?mode=ro", uri=True)) as db:
            tables = [row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
    except sqlite3.DatabaseError:
        return []
    return [] if not tables or "studies" in tables else tables


def _storage(url: str):
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    # SQLite: wait up to 60 s for another slot's write lock instead of failing at once
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        try:
            return RDBStorage(url, engine_kwargs=engine, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                              heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback())
        except Exception as err:  # noqa: BLE001 - a bad URL, a missing driver, a server that is down: one line
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise PartrainError(f"cannot open the study storage {url} ({reason}): give --storage a file name "
                                "or a database URL whose driver is installed, e.g. postgresql://host/db") from None


def sampler_for(settings: SweepSettings):
    import optuna

    # grid: the points are queued in the study (enqueue_grid), so its sampler draws none
    if settings.sampler in ("grid", "random"):
        return optuna.samplers.RandomSampler(seed=settings.sampler_seed)
    if settings.sampler == "tpe":
        # constant_liar: trials running in other slots count as bad guesses, so slots spread out
        return optuna.samplers.TPESampler(seed=settings.sampler_seed, constant_liar=True, n_startup_trials=4)
    raise PartrainError(f"unknown --sampler {settings.sampler!r}: choose grid, random or tpe")


def pruner_for(settings: SweepSettings):
    """Median rule (Golovin et al. 2017, Google Vizier): stop a trial whose accuracy after an
    epoch is below the median of earlier trials' at that epoch; never before 4 trials finished."""
    import optuna

    if not settings.prune:
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=0)


def open_study(settings: SweepSettings, create: bool = False):
    import optuna

    # errors only: Optuna logs every failed trial with its traceback at WARNING, where the
    # trial table already says why it failed
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = _storage(settings.storage)
    kwargs = dict(study_name=settings.study, storage=storage, sampler=sampler_for(settings), pruner=pruner_for(settings))
    if create:
        study = optuna.create_study(direction="maximize", load_if_exists=True, **kwargs)
        _check_same_sweep(study, settings)
        return study
    return optuna.load_study(**kwargs)


def _space_key(settings: SweepSettings) -> str:
    return ";".join(f"{d.name}={d.spec()}" for d in settings.dims) + f"|{settings.base.model}/{settings.base.dataset}"


# what a resume may change: where the data is, the threads of each worker (a study shared by
# machines of other core counts), and the machinery around a run. Everything else in the base
# config changes what a trial computes. The slots side by side (--workers) are not in it at all.
NOT_FIXED = frozenset({"data_dir", "threads", "timeout_s", "checkpoint", "resume", "events", "save_model"})
# flags for the names fixed_options gives that are no flag of `partrain train` or name it otherwise
_FLAGS = {"hidden": "--hidden", "activation": "--activation", "workers": "--per-trial", "evaluate": "--no-eval"}


def fixed_options(base: RunConfig, dims: list[Dimension]) -> dict:
    """The base config's values that fix a trial's result besides its searched ones, JSON-ready
    (as the study stores them): model options flattened in, the searched ones left out (each
    trial has its own), and the strategy left out (--per-trial, as ``workers``, decides it)."""
    import json

    values = {k: v for k, v in base.to_dict().items() if k not in NOT_FIXED | {"strategy"}}
    values.update(values.pop("model_options"))
    searched = {d.name for d in dims}
    for name in searched & set(values):
        del values[name]
    if {"width", "depth"} <= searched:  # both searched: the trial's own hidden widths replace --hidden
        values.pop("hidden", None)
    return json.loads(json.dumps(values))  # tuples as lists, as they come back from the storage


def _show(name: str, value) -> str:
    """One stored or given option as its flag says it: ``--limit 512``, ``no --hidden``."""
    flag = _FLAGS.get(name) or flag_of(name)
    if name == "evaluate":
        value = not value  # the flag is --no-eval
    if value is None or value is False:
        return f"no {flag}"
    if value is True:
        return flag
    return f"{flag} {','.join(map(str, value)) if isinstance(value, list) else value}"


def _check_same_sweep(study, settings: SweepSettings) -> None:
    """A study resumed with another space, model or fixed option would pool incomparable
    trials (counted toward --trials and ranked together): refuse. A study made before the
    fixed options were stored takes this run's from now on."""
    key = _space_key(settings)
    saved = study.user_attrs.get("partrain_space")
    if saved is None:
        study.set_user_attr("partrain_space", key)
    elif saved != key:
        raise PartrainError(f"study {settings.study!r} in {settings.storage} searches {saved}, not {key}: "
                            "resume it with the same --space, --model and --dataset, or name a new --study")
    given = fixed_options(settings.base, settings.dims)
    stored = study.user_attrs.get("partrain_fixed")
    if stored is None:
        study.set_user_attr("partrain_fixed", given)
        return
    # a name one side lacks (a RunConfig field added since, a model option not given) is its default
    default = fixed_options(RunConfig(), settings.dims)
    names = sorted(stored.keys() | given.keys())
    was, now = ([side.get(k, default.get(k)) for k in names] for side in (stored, given))
    if differ := [i for i, name in enumerate(names) if was[i] != now[i]]:
        was = ", ".join(_show(names[i], was[i]) for i in differ)
        now = ", ".join(_show(names[i], now[i]) for i in differ)
        raise PartrainError(f"study {settings.study!r} in {settings.storage} ran its trials with {was}, not {now}: "
                            "resume it with the stored options, or name a new --study")
