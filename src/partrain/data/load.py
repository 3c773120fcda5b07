"""Finding a dataset's files and loading them, or generating data of the same shape.

Data directory lookup order (``resolve_data_dir``):

1. the ``data_dir`` argument (the CLI's ``--data-dir``);
2. the environment variable ``PARTRAIN_DATA_DIR`` (``DATA_DIR_ENV``), when set and non-empty;
3. ``~/.partrain/data`` (``DEFAULT_DATA_DIR``).

Layout under the data directory (each IDX file gzipped, ``NAME.gz``, or plain, ``NAME``)::

    mnist/          train-images-idx3-ubyte  train-labels-idx1-ubyte  (test: t10k-...)
    fashion-mnist/  the same names as mnist/
    emnist/         emnist-letters-{train,test}-{images-idx3,labels-idx1}-ubyte, or mnist/'s names
    cifar10/ or cifar-10-batches-bin/ or cifar10_sample/
                    train: every data_batch_*.bin (sorted); test: test_batch*.bin
    ocr_letters_cmu/  train: largeTrain.csv; test: largeValidation.csv

A missing dataset is an error, never silently replaced by generated data: ``synthetic=True``
asks for that explicitly.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from partrain.data.cifar import read_cifar_batches
from partrain.data.dataset import ArrayDataset, BaseDataset
from partrain.data.files import check_labels
from partrain.data.idx import read_idx_pair
from partrain.data.ocr import read_ocr_csv
from partrain.data.spec import DatasetSpec, dataset_spec
from partrain.data.synthetic import SyntheticDataset
from partrain.data.tokens import is_token_dataset, load_tokens
from partrain.errors import PartrainError

DATA_DIR_ENV = "PARTRAIN_DATA_DIR"
DEFAULT_DATA_DIR = Path("~/.partrain/data")

_FIX = "use --data-dir DIR or set PARTRAIN_DATA_DIR, or pass --synthetic for generated data of the same shape"

# Per-channel (mean, std) of pixels / 255 over the train split, the usual published values.
# EMNIST uses MNIST's: the same kind of ink on the same background.
_STATS = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "emnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}
_IDX_FOLDERS = {"mnist": "mnist", "fashion-mnist": "fashion-mnist", "emnist": "emnist"}
_CIFAR_FOLDERS = ("cifar10", "cifar-10-batches-bin", "cifar10_sample")
_OCR_FILES = {"train": "largeTrain.csv", "test": "largeValidation.csv"}

_reused: dict | None = None  # inside ``reused_splits``: the splits read from files so far


@contextmanager
def reused_splits() -> Iterator[None]:
    """Inside, a split read from files once is not read again: loading it again gives a dataset of
    its own over the same tensors (nothing writes into them). The memory probe of a model profile
    runs the training loop 15 times on a world of one, and each run loads its data: MNIST's
    train split gunzips 47 MB each time, 0.14 s on the 2-vCPU VM, 2.1 s of a 9 s profile. Only
    inside: elsewhere a split nobody holds is freed, and a file changed since is read as it is."""
    global _reused
    outer, _reused = _reused, {} if _reused is None else _reused
    try:
        yield
    finally:
        _reused = outer


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path:
    chosen = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR
    return Path(chosen).expanduser().absolute()


def load_dataset(name: str, split: str = "train", *, data_dir: str | os.PathLike | None = None,
                 synthetic: bool = False, seed: int = 0, limit: int | None = None,
                 size: int | None = None) -> BaseDataset:
    """Dataset ``name``'s ``split``: read from the data directory, or generated.

    ``synthetic`` (implied for ``synthetic_only`` datasets) generates ``size`` samples
    (default: the spec's split size) from ``seed``; ``limit`` keeps the first ``limit`` samples.
    """
    if split not in ("train", "test"):
        raise PartrainError(f"unknown split {split!r}; use 'train' or 'test'")
    if is_token_dataset(name):  # generated walks or a text file's bytes: tokens.py
        return load_tokens(name, split, seed=seed, limit=limit)
    spec = dataset_spec(name)
    for arg, value in (("limit", limit), ("size", size)):
        if value is not None and value < 1:
            raise PartrainError(f"{arg} must be at least 1, got {value}")
    if synthetic or spec.synthetic_only:
        size = spec.split_size(split) if size is None else size
        return SyntheticDataset(spec, split, size if limit is None else min(size, limit), seed=seed)
    if size is not None:
        raise PartrainError(f"size applies to generated data only; to use part of {name}, pass limit")

    root = resolve_data_dir(data_dir)
    key = (spec.name, split, str(root), limit)
    if _reused is not None and key in _reused:
        return copy.copy(_reused[key])
    if spec.name == "cifar10":
        images, labels = read_cifar_batches(_cifar_files(root, split))
    elif spec.name == "ocr-letters":
        path = root / "ocr_letters_cmu" / _OCR_FILES[split]
        if not _is_file(path):
            raise _missing(spec, split, [path])
        images, labels = read_ocr_csv(path, spec.num_classes)
    else:
        images, labels = _read_idx_dataset(spec, root, split)
    if len(labels) == 0:  # a well-formed file of no samples: nothing to train on, or a test accuracy of 0 / 0
        raise PartrainError(f"{name}'s {split} split in {root} holds no samples: restore its files")
    pixels = torch.from_numpy(np.array(images[:limit], order="C"))  # a writable copy, only of what is kept
    labels = torch.from_numpy(labels[:limit].astype(np.int64))
    scale, mean, std = normalization(spec.name)
    dataset = ArrayDataset(spec, split, pixels, labels, scale=scale, mean=mean, std=std)
    if _reused is not None:
        _reused[key] = dataset
    return dataset


def normalization(name: str) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
    """(scale, mean, std) a stored pixel goes through: ``(pixel * scale - mean) / std``."""
    if name == "ocr-letters":  # binary pixels, 21% ink: standardized like the others
        return 1.0, (0.21,), (0.41,)
    return 1 / 255, *_STATS[name]


def _read_idx_dataset(spec: DatasetSpec, root: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    folder = root / _IDX_FOLDERS[spec.name]
    prefix = "train" if split == "train" else "t10k"
    candidates = [(f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte")]
    if spec.name == "emnist":
        candidates.insert(0, (f"emnist-letters-{split}-images-idx3-ubyte", f"emnist-letters-{split}-labels-idx1-ubyte"))
    for names in candidates:
        found = [_plain_or_gz(folder / name) for name in names]
        if all(found):
            break
    else:
        raise _missing(spec, split, [folder / f"{name}[.gz]" for names in candidates for name in names])
    images, labels = read_idx_pair(*found)
    if tuple(images.shape[1:]) != tuple(spec.input_shape[1:]):
        rows, cols = spec.input_shape[1:]
        raise PartrainError(f"corrupt dataset file {found[0]}: images are {images.shape[1]}x{images.shape[2]}, "
                            f"{spec.name} images are {rows}x{cols}; point --data-dir at the original files")
    images = images[:, None]  # add the channel axis: [n, 1, 28, 28]
    if spec.name != "emnist":
        check_labels(labels, 0, spec.num_classes - 1, found[1], "item")
        return images, labels
    # EMNIST stores each image transposed (column-major) relative to MNIST, and letters as 1..26.
    check_labels(labels, 1, spec.num_classes, found[1], "item")
    return images.transpose(0, 1, 3, 2), labels - 1


def _plain_or_gz(path: Path) -> Path | None:
    """``path`` itself (faster: no decompression) or else ``path.gz``, whichever exists."""
    return next((p for p in (path, path.with_name(path.name + ".gz")) if _is_file(p)), None)


def _is_file(path: Path) -> bool:
    """Whether ``path`` is a file; a path the OS cannot even look up (too long) is not."""
    try:
        return path.is_file()
    except OSError:
        return False


def _cifar_files(root: Path, split: str) -> list[Path]:
    pattern = "data_batch_*.bin" if split == "train" else "test_batch*.bin"
    for folder in (root / name for name in _CIFAR_FOLDERS):
        if files := sorted(p for p in folder.glob(pattern) if _is_file(p)):
            return files
    raise _missing(dataset_spec("cifar10"), split, [root / name / pattern for name in _CIFAR_FOLDERS])


def _missing(spec: DatasetSpec, split: str, looked_for: list[Path]) -> PartrainError:
    return PartrainError(f"{spec.name} {split} data not found: looked for {', '.join(map(str, looked_for))}; {_FIX}")
