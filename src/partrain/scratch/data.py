"""partrain's own datasets as NumPy arrays: ``x`` ``[n, features]`` and ``y`` ``[n]``.

Read with ``partrain.data.load_dataset`` (the same files, checks and normalization as the
PyTorch engine), then flattened and cast once, so a step only indexes rows.
"""

from __future__ import annotations

import numpy as np
import torch

from partrain.data import dataset_spec, load_dataset
from partrain.train import epoch_order  # noqa: F401  re-exported: the PyTorch engine's order, so both engines see the same batches

ALIASES = {"ocr": "ocr-letters"}


def dataset_name(name: str) -> str:
    return dataset_spec(ALIASES.get(name, name)).name  # raises PartrainError naming the choices


def load_arrays(name: str, split: str, *, data_dir=None, synthetic: bool = False, seed: int = 0,
                limit: int | None = None, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    ds = load_dataset(dataset_name(name), split, data_dir=data_dir, synthetic=synthetic, seed=seed, limit=limit)
    x, y = ds.get(torch.arange(len(ds)))
    return x.reshape(len(ds), -1).numpy().astype(dtype), y.numpy()
