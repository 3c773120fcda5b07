"""The profile cache: one service every command asks for a model or hardware profile.

Profiles are JSON files in the profile directory (``--profile-dir``, else
``$PARTRAIN_PROFILE_DIR``, else ``~/.partrain/profiles``), named by everything that keys them
and by the hardware fingerprint, so that a profile taken on other hardware is never reused
by mistake. A missing one is measured (``profile.model``, ``profile.hardware``) and saved.

A model profile's key also holds the device and numerics it was taken with (``RunOptions``):
a GPU profile, a bf16 one, a channels-last or compiled one each have a file of their own.
The CPU fp32 eager profile keeps the name it always had, so existing caches stay valid.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from partrain.errors import PartrainError
from partrain.predict.machine import fingerprint as machine
from partrain.predict.profiles import HardwareProfile, ModelProfile

PROFILE_DIR_ENV = "PARTRAIN_PROFILE_DIR"
# A profile taken while other processes kept more than this share of the machine's cores busy
# is measured again, and never cached: on this 2-core VM one taken at about half the CPU taken
# came out 6.6x slower than quiet (cnn 110.9 ms against 16.9 ms a step).
BUSY_SHARE = 0.25
# The share of the CPU other processes took while a profile was measured from which it is
# flagged, and measured once more (``load_or_profile``): at 11% (a `partrain predict` run beside
# it) the 4-worker sync after computing read 4.2 ms, against 3.0 quietly before and after
# (issue 18's run56)
NOTICEABLE_LOAD = 0.1
BUSY_ATTEMPTS = 2  # ... and from NOTICEABLE_LOAD it is measured once more, the quieter kept
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


def hardware_path(directory: Path, workers: int, nodes: int = 1, backend: str | None = None,
                  link_mbit: float | None = None) -> Path:
    """Where the profile of ``workers`` workers is cached: over several nodes a file of its own
    (the same machine's local profile of as many workers measured no link between nodes), one
    of its own for gloo on a GPU machine (CPU workers there: ``--device cpu``), and one per
    rate of an emulated link between nodes (``bench.nodes``)."""
    across = f"-n{nodes}" if nodes > 1 else ""
    other = f"-{backend}" if backend not in (None, machine().backend) else ""
    link = f"-l{link_mbit:g}mbit" if link_mbit else ""
    return directory / f"hardware-w{workers}{across}{other}{link}-{fingerprint()}.json"


def hardware_across(workers: int, nodes: int, link_mbit: float, directory=None) -> HardwareProfile | None:
    """The hardware profile measured across ``nodes`` emulated nodes joined by a ``link_mbit``
    link (``bench`` keeps one per placement and rate); None when none was measured."""
    path = hardware_path(profile_dir(directory), workers, nodes, link_mbit=link_mbit)
    profile = HardwareProfile.load(path) if path.is_file() else None
    return None if profile is None or profile.stale else profile


# a cached profile whose ``stale`` is true (measured by an earlier MEASUREMENT or MODEL_MEASUREMENT)
EARLIER_METHOD = "was measured by an earlier partrain, whose figures mean something else: measuring it again"


def _problem(err: PartrainError) -> str:
    """What is wrong with a cached profile, without the fix the cache is about to apply."""
    return str(err).removesuffix(": delete it or profile again")


@dataclass(frozen=True)
class RunOptions:
    """The device and numerics a model profile is taken with, as the run will train: ``device``
    "cpu" or "cuda" (None: the GPU when there is one, as ``train`` picks it)."""

    device: str | None = None
    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False

    @property
    def device_kind(self) -> str:
        return self.device or ("cuda" if machine().gpu_count else "cpu")

    def suffix(self) -> str:
        """The part of a profile's file name they add: nothing for CPU, fp32, eager."""
        parts = ["cuda"] if self.device_kind == "cuda" else []
        parts += [self.precision] if self.precision != "fp32" else []
        parts += ["cl"] if self.channels_last else []
        parts += ["compile"] if self.compile else []
        return "".join(f"-{p}" for p in parts)

    def matches(self, profile: ModelProfile) -> bool:
        return (profile.on_gpu == (self.device_kind == "cuda") and profile.precision == self.precision
                and profile.channels_last == self.channels_last and profile.compile == self.compile)

    @classmethod
    def from_args(cls, args) -> RunOptions:
        """From a command's parsed ``--device``, ``--precision``, ``--channels-last``, ``--compile``."""
        return cls(getattr(args, "device", None), getattr(args, "precision", "fp32"),
                   bool(getattr(args, "channels_last", False)), bool(getattr(args, "compile", False)))


def local_hardware(device: str | None = None) -> HardwareProfile:
    """This machine without collective timings: enough for one worker, which communicates
    nothing. Training on the GPU, a worker's memory is the GPU's, not the host's RAM."""
    here = machine()
    cuda = RunOptions(device).device_kind == "cuda"
    if cuda and not here.gpu_count:
        raise PartrainError("--device cuda, but torch sees no GPU here: use --device cpu, or run on the GPU machine")
    memory = here.gpu_memory_bytes if cuda else here.memory_gib * 2**30
    return HardwareProfile(here.hash, here.describe(), "nccl" if cuda else "gloo", 1, 1, here.cpu_cores,
                           memory, shared_memory=not cuda, source="local, no collectives measured")


def hardware_for(workers: int, directory=None, refresh: bool = False,
                 device: str | None = None) -> tuple[HardwareProfile, Path | None, bool]:
    """This machine's hardware profile for ``workers`` local workers: (profile, path, reused).

    One worker needs none. Otherwise the cached profile measured with ``workers`` workers,
    or a new measurement, saved: with as many processes sharing the cores as the job will
    have, collectives cost what they will cost in it. On GPUs (NCCL) one worker per GPU:
    more workers than GPUs are a cluster file's to describe.
    """
    if workers <= 1:
        return local_hardware(device), None, True
    gpus = machine().gpu_count
    if RunOptions(device).device_kind == "cuda" and workers > gpus:
        raise PartrainError(f"{workers} GPU workers, but this machine has {gpus} GPU{'s' * (gpus != 1)}: describe the "
                            "GPUs you will train on with --cluster (e.g. examples/cluster-8xh100.toml), or predict for "
                            "CPU workers with --device cpu")
    backend = "gloo" if RunOptions(device).device_kind == "cpu" else None  # None: NCCL on GPUs, else gloo
    path = hardware_path(profile_dir(directory), workers, backend=backend)
    if path.is_file() and not refresh:
        try:
            kept = HardwareProfile.load(path)
            if not kept.stale:
                return kept, path, True
            print(f"partrain: {path} {EARLIER_METHOD}", file=sys.stderr)
        except PartrainError as err:  # edited, or written by another partrain: measured again
            print(f"partrain: {_problem(err)}: measuring it again", file=sys.stderr)
    from partrain.profile.hardware import profile_hardware

    profile, quiet = _measure_quietly(lambda: profile_hardware(workers, backend=backend), "the collectives were timed")
    return profile, profile.save(path) if quiet else None, False


def profile_path(directory: Path, model: str, dataset: str, batch_sizes: list[int], threads: int,
                 synthetic: bool = False, options: dict | None = None, run: RunOptions = RunOptions()) -> Path:
    """The cache file of a profile: every part of the key is in the name (the device and
    numerics only when they are not CPU, fp32, eager: such files kept their old names). A user
    factory's name keeps its colon apart (``pkg.mod:build_x`` and ``pkg.mod_build:x`` were one
    file) and adds a hash of its module's source (``models.registry.source_digest``)."""
    from partrain.models.registry import source_digest

    slug = re.sub(r"[^A-Za-z0-9_.+-]+", "_", model.replace(":", "+"))
    slug += f"-src{digest}" if (digest := source_digest(model)) else ""
    extra = "".join(f"-{k}={v}" for k, v in sorted((options or {}).items()))
    data = f"{dataset}-synthetic" if synthetic else dataset
    sizes = "_".join(map(str, sorted(set(batch_sizes))))
    return directory / f"model-{slug}{extra}-{data}-b{sizes}-t{threads}{run.suffix()}-{fingerprint()}.json"


def load_or_profile(model: str, dataset: str, batch_sizes: list[int], threads: int = 1, directory=None, data_dir=None,
                    synthetic: bool = False, options: dict | None = None, refresh: bool = False,
                    run: RunOptions = RunOptions()) -> tuple[ModelProfile, Path, bool]:
    """The cached profile for this key, or a new one saved there. Returns (profile, path, reused)."""
    from partrain.data import dataset_spec

    rows = dataset_spec(dataset).train_size  # nominal: a partial copy is found short when it is read
    if max(batch_sizes) > rows:  # refused before anything is measured, naming the batch asked for
        raise PartrainError(f"batch size {max(batch_sizes)} exceeds the {rows} training samples of {dataset}: "
                            "choose a smaller batch")
    path = profile_path(profile_dir(directory), model, dataset, batch_sizes, threads, synthetic, options, run)
    if path.is_file() and not refresh:
        try:
            profile = ModelProfile.load(path)
            if profile.stale:
                print(f"partrain: {path} {EARLIER_METHOD}", file=sys.stderr)
            elif run.matches(profile):  # at the machine's pace since, where bench sampled it (profile.pace)
                from partrain.profile.pace import at_later_pace

                return at_later_pace(profile), path, True
            else:
                print(f"partrain: {path} was taken on {profile.device} at {profile.precision}, not as asked: "
                      "measuring it again", file=sys.stderr)
        except PartrainError as err:  # edited, failing validation, or written by another partrain version
            print(f"partrain: {_problem(err)}: measuring it again", file=sys.stderr)
    from partrain.profile.model import profile_model

    try:
        profile, quiet = _measure_quietly(
            lambda: profile_model(model, dataset, batch_sizes, threads, data_dir, synthetic, options, device=run.device_kind,
                                  precision=run.precision, channels_last=run.channels_last, compile=run.compile),
            f"{model} was profiled")
    except Exception as err:  # noqa: BLE001 - a user's model that raises is one line; anything else raised as it is
        from partrain.models.registry import raised_by_model

        if "can't allocate memory" in str(err) or type(err).__name__ == "OutOfMemoryError":  # not the model's fault
            where = "GPU" if run.device_kind == "cuda" else "machine"
            raise PartrainError(
                f"{model}, profiled at batches up to {max(batch_sizes)}, does not fit in this {where}'s memory, and partrain "
                "profiles a model by training it on the machine that predicts: profile and predict on one where it "
                "fits (--cluster describes the machines that will train it), or use smaller batches") from err
        if (line := raised_by_model(err, model, "being profiled")) is None:
            raise
        raise line from err
    if quiet:
        profile.save(path)
    return profile, path, False


def _measure_quietly(measure, what: str):
    """``measure()`` (a model or hardware profile), again while other processes took
    ``NOTICEABLE_LOAD`` or more of the CPU, at most ``BUSY_ATTEMPTS`` times: (the quietest profile,
    whether it is quiet enough to keep: under ``BUSY_SHARE``). A contended one is good enough
    for this command's answer, never kept to spoil the next one. ``what`` says what was
    measured, in the messages."""
    profiles = []
    for attempt in range(BUSY_ATTEMPTS):
        profiles.append(measure())
        if profiles[-1].other_load < NOTICEABLE_LOAD:
            break
        if attempt + 1 < BUSY_ATTEMPTS:
            print(f"partrain: other processes used {profiles[-1].other_load:.0%} of the CPU while {what}; measuring again",
                  file=sys.stderr)
    profile = min(profiles, key=lambda p: p.other_load)
    if profile.other_load < BUSY_SHARE:
        return profile, True
    print(f"partrain: the machine stayed busy ({profile.other_load:.0%} of the CPU taken by other processes): "
          "this profile is used once and not cached; profile again when the machine is quiet", file=sys.stderr)
    return profile, False


def busy_warning(profile: ModelProfile, threshold: float = NOTICEABLE_LOAD) -> str | None:
    """One line when other processes competed with the profiler for the CPU, else None."""
    if profile.other_load < threshold:
        return None
    return (f"warning: other processes used {profile.other_load:.0%} of the CPU while {profile.model} was profiled; "
            "its times may be inflated: profile again with --refresh when the machine is quiet")
