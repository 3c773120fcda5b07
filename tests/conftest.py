"""Shared fixtures: the real offline datasets live in ../shared/data, next to the repository."""

import os
from pathlib import Path

import pytest

# $PARTRAIN_DATA_DIR first (a worktree's checkout is not beside shared/), else ../shared/data
DATA_DIR = Path(os.environ.get("PARTRAIN_DATA_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data")


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The real-data directory (MNIST, CIFAR-10 sample, OCR letters); skips the test if absent."""
    if not DATA_DIR.is_dir():
        pytest.skip(f"real data not found at {DATA_DIR}")
    return DATA_DIR


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped, with the reason, where torch sees no GPU."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
