"""Reading dataset files, and the one error shape for a file that is not what it claims.

Every problem with a data file becomes a ``PartrainError`` that names the file and what is
wrong with it, so a user can tell a truncated download from a wrong ``--data-dir``.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

from partrain.errors import PartrainError


def corrupt(path: Path, problem: str) -> PartrainError:
    return PartrainError(f"corrupt dataset file {path}: {problem}")


def read_bytes(path: Path) -> bytes:
    """The contents of ``path``, gunzipped when its name ends in ``.gz``."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise PartrainError(f"cannot read dataset file {path}: {err.strerror}") from None
    if path.suffix != ".gz":
        return raw
    try:
        return gzip.decompress(raw)
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise corrupt(path, f"not a valid gzip file ({err})") from None


def check_labels(labels: np.ndarray, low: int, high: int, path: Path, unit: str, first: int = 0) -> None:
    """Raise unless every label is in ``low..high``; the error names the first bad one.

    ``unit`` and ``first`` say how a position reads to the user ("record" from 0, "line" from 1).
    """
    bad = np.flatnonzero((labels < low) | (labels > high))
    if bad.size:
        i = int(bad[0])
        raise corrupt(path, f"label {int(labels[i])} at {unit} {i + first} is outside {low}..{high}")
