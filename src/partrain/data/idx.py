"""Reader for the IDX format of MNIST, Fashion-MNIST and EMNIST.

Format (Y. LeCun, C. Cortes and C. J. C. Burges, "The MNIST database of handwritten
digits", http://yann.lecun.com/exdb/mnist/): a 4-byte magic number ``0x00 0x00 <type>
<ndim>``, then ``ndim`` 32-bit big-endian sizes, then the items row-major. The datasets use
type 0x08 (unsigned byte), so image files (count, rows, cols) carry magic 2051 and label
files (count) carry magic 2049. Files may be gzipped (``.gz``, as published) or plain.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np

from partrain.data.files import corrupt, read_bytes

_UBYTE_MAGIC = 0x0800  # + ndim
_KIND = {1: "label", 3: "image"}


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """The unsigned-byte array of ``ndim`` dimensions stored in IDX file ``path`` (read-only)."""
    data = read_bytes(path)
    expected_magic = _UBYTE_MAGIC + ndim
    header = 4 * (1 + ndim)
    if len(data) < header:
        raise corrupt(path, f"truncated: {len(data)} bytes, shorter than the {header}-byte IDX header")
    magic, *dims = struct.unpack(f">{1 + ndim}I", data[:header])
    if magic != expected_magic:
        raise corrupt(path, f"magic number {magic}, expected {expected_magic} (IDX {_KIND[ndim]} file)")
    promised, present = math.prod(dims), len(data) - header
    if present != promised:
        problem = "truncated" if present < promised else "trailing bytes"
        raise corrupt(path, f"{problem}: header promises {' x '.join(map(str, dims))} = {promised} "
                            f"bytes of data, file has {present}")
    return np.frombuffer(data, np.uint8, promised, header).reshape(dims)


def read_idx_pair(images_path: Path, labels_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images ``[n, rows, cols]`` and labels ``[n]`` from matching IDX image and label files."""
    images, labels = read_idx(images_path, 3), read_idx(labels_path, 1)
    if len(images) != len(labels):
        raise corrupt(labels_path, f"{len(labels)} labels, but {images_path} has {len(images)} images")
    return images, labels
