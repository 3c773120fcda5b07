"""The profile cache: one service every command asks for a model or hardware profile.

Profiles are JSON files in the profile directory (``--profile-dir``, else
``$PARTRAIN_PROFILE_DIR``, else ``~/.partrain/profiles``), named by everything that keys them
and by the hardware fingerprint, so that a profile taken on other hardware is never reused
by mistake. A missing one is measured (``profile.model``, ``profile.hardware``) and saved.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from partrain.errors import PartrainError
from partrain.predict.machine import fingerprint as machine
from partrain.predict.profiles import HardwareProfile, ModelProfile

PROFILE_DIR_ENV = "PARTRAIN_PROFILE_DIR"
# A profile taken while other processes kept more than this share of the machine's cores busy
# is measured again, and never cached: on this 2-core VM one taken at about half the CPU taken
# came out 6.6x slower than quiet (cnn 110.9 ms against 16.9 ms a step).
BUSY_SHARE = 0.25
BUSY_ATTEMPTS = 2
DEFAULT_PROFILE_DIR = Path("~/.partrain/profiles")


def profile_dir(path: str | os.PathLike | None = None) -> Path:
    """Where profiles are cached: ``path``, else $PARTRAIN_PROFILE_DIR, else ~/.partrain/profiles."""
    chosen = Path(path if path is not None else os.environ.get(PROFILE_DIR_ENV) or DEFAULT_PROFILE_DIR).expanduser()
    if chosen.exists() and not chosen.is_dir():  # found now, not after minutes of profiling
        raise PartrainError(f"--profile-dir {chosen}: a file is in the way; give a directory")
    return chosen.absolute()


def fingerprint() -> str:
    """This machine's hardware hash, the one the results store keys its measurements by."""
    return machine().hash


def profile_threads(threads: int) -> int:
    """The threads to profile a plan's worker with: its own, at most this machine's cores (a
    cluster file's cores are not here; a profile with more threads than cores measures contention)."""
    return min(threads, os.cpu_count() or 1)


def hardware_path(directory: Path, workers: int, nodes: int = 1, link_mbit: float | None = None) -> Path:
    """Where the profile of ``workers`` workers is cached: over several nodes a file of its own
    (the same machine's local profile of as many workers measured no link between nodes), and
    one per rate of an emulated link between them (``bench.nodes``)."""
    across = f"-n{nodes}" if nodes > 1 else ""
    link = f"-l{link_mbit:g}mbit" if link_mbit else ""
    return directory / f"hardware-w{workers}{across}{link}-{fingerprint()}.json"


def hardware_across(workers: int, nodes: int, link_mbit: float, directory=None) -> HardwareProfile | None:
    """The hardware profile measured across ``nodes`` emulated nodes joined by a ``link_mbit``
    link (``bench`` keeps one per placement and rate); None when none was measured."""
    path = hardware_path(profile_dir(directory), workers, nodes, link_mbit)
    return HardwareProfile.load(path) if path.is_file() else None


def _problem(err: PartrainError) -> str:
    """What is wrong with a cached profile, without the fix the cache is about to apply."""
    return str(err).removesuffix(": delete it or profile again")


def local_hardware() -> HardwareProfile:
    """This machine without collective timings: enough for one worker, which communicates nothing."""
    here = machine()
    cuda = here.gpu_count > 0
    return HardwareProfile(here.hash, here.describe(), here.backend, 1, 1, here.cpu_cores,
                           here.memory_gib * 2**30, shared_memory=not cuda, source="local, no collectives measured")


def hardware_for(workers: int, directory=None, refresh: bool = False) -> tuple[HardwareProfile, Path | None, bool]:
    """This machine's hardware profile for ``workers`` local workers: (profile, path, reused).

    One worker needs none. Otherwise the cached profile measured with ``workers`` workers,
    or a new measurement, saved: with as many processes sharing the cores as the job will
    have, collectives cost what they will cost in it.
    """
    if workers <= 1:
        return local_hardware(), None, True
    path = hardware_path(profile_dir(directory), workers)
    if path.is_file() and not refresh:
        try:
            return HardwareProfile.load(path), path, True
        except PartrainError as err:  # edited, or written by another partrain: measured again
            print(f"partrain: {_problem(err)}: measuring it again", file=sys.stderr)
    from partrain.profile.hardware import profile_hardware

    profile = profile_hardware(workers)
    return profile, profile.save(path), False


def profile_path(directory: Path, model: str, dataset: str, batch_sizes: list[int], threads: int,
                 synthetic: bool = False, options: dict | None = None) -> Path:
    """The cache file of a profile: every part of the key is in the name."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", model)
    extra = "".join(f"-{k}={v}" for k, v in sorted((options or {}).items()))
    data = f"{dataset}-synthetic" if synthetic else dataset
    sizes = "_".join(map(str, sorted(set(batch_sizes))))
    return directory / f"model-{slug}{extra}-{data}-b{sizes}-t{threads}-{fingerprint()}.json"


def load_or_profile(model: str, dataset: str, batch_sizes: list[int], threads: int = 1, directory=None, data_dir=None,
                    synthetic: bool = False, options: dict | None = None, refresh: bool = False) -> tuple[ModelProfile, Path, bool]:
    """The cached profile for this key, or a new one saved there. Returns (profile, path, reused)."""
    path = profile_path(profile_dir(directory), model, dataset, batch_sizes, threads, synthetic, options)
    if path.is_file() and not refresh:
        try:
            return ModelProfile.load(path), path, True
        except PartrainError as err:  # edited, failing validation, or written by another partrain version
            print(f"partrain: {_problem(err)}: measuring it again", file=sys.stderr)
    from partrain.profile.model import profile_model

    for attempt in range(BUSY_ATTEMPTS):
        profile = profile_model(model, dataset, batch_sizes, threads, data_dir, synthetic, options)
        if profile.other_load < BUSY_SHARE:
            profile.save(path)
            return profile, path, False
        if attempt + 1 < BUSY_ATTEMPTS:
            print(f"partrain: other processes used {profile.other_load:.0%} of the CPU while {model} was profiled; "
                  "measuring again", file=sys.stderr)
    # still contended: good enough for this command's answer, never kept to spoil the next one
    print(f"partrain: the machine stayed busy ({profile.other_load:.0%} of the CPU taken by other processes): "
          f"this profile is used once and not cached; profile again when the machine is quiet", file=sys.stderr)
    return profile, path, False
