"""Shared fixtures: the real offline datasets live in ../shared/data, next to the repository."""

import os
from pathlib import Path

import pytest

# workers forked from a server that imported torch once, not spawned fresh (``distributed.spawn``):
# ~1-2 s less for each of the suite's hundreds of worker starts; the tests that start workers
# the default way (spawn) say so. Set here, before any test, so the CLI's subprocesses inherit it
os.environ.setdefault("PARTRAIN_START_METHOD", "forkserver")

# $PARTRAIN_DATA_DIR first (a worktree's checkout is not beside shared/), else ../shared/data
DATA_DIR = Path(os.environ.get("PARTRAIN_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data")


@pytest.fixture(scope="session", autouse=True)
def own_profile_dir(tmp_path_factory):
    """Profiles cached where this session alone reads and writes them, not in the user's
    ~/.partrain (a test that names no --profile-dir would read that machine's hardware
    profile), nor where another pytest-xdist worker of the same run writes."""
    os.environ["PARTRAIN_PROFILE_DIR"] = str(tmp_path_factory.mktemp("profiles"))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The real-data directory (MNIST, CIFAR-10 sample, OCR letters); skips the test if absent."""
    if not DATA_DIR.is_dir():
        pytest.skip(f"real data not found at {DATA_DIR}")
    return DATA_DIR


@pytest.fixture(scope="session")
def measured_hardware(tmp_path_factory):
    """One real ``profile --hardware --quick`` of 3 workers on this machine, every probe (2 and 3
    workers side by side, beyond the cores on 2; the pair's and the whole world's pipelines) with
    a third of its rounds, messages of 64 B to 1 MiB: about a minute on 2 cores (the full
    profile's two), taken once for the tests that need one. Returns (the profile, the directory
    it is cached in, where predict and recommend look it up)."""
    from partrain.profile.cache import hardware_path
    from partrain.profile.hardware import profile_hardware

    directory = tmp_path_factory.mktemp("hardware")
    hw = profile_hardware(3, sizes=[64, 4096, 2**18, 2**20], quick=True)
    hw.save(hardware_path(directory, 3))
    return hw, directory


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped, with the reason, where torch sees no GPU."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
