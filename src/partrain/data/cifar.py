"""Reader for the CIFAR-10 binary version.

Format (A. Krizhevsky, "Learning Multiple Layers of Features from Tiny Images", University
of Toronto, 2009; https://www.cs.toronto.edu/~kriz/cifar.html): no header, a sequence of
3073-byte records, each one label byte (0-9) followed by a 32x32 RGB image as the 1024 red,
1024 green and 1024 blue values, each plane row-major. So a record is already ``(C, H, W)``
and a file of any number of whole records (a truncated prefix, say) is valid.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from partrain.data.files import check_labels, corrupt, read_bytes

RECORD_BYTES = 1 + 3 * 32 * 32


def read_cifar_batches(paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """Images ``[n, 3, 32, 32]`` and labels ``[n]`` of the records of ``paths``, in order."""
    images, labels = [], []
    for path in paths:
        data = read_bytes(path)
        if not data or len(data) % RECORD_BYTES:
            raise corrupt(path, f"size {len(data)} bytes is not a positive multiple of the "
                                f"{RECORD_BYTES}-byte CIFAR-10 record (truncated or not a batch file)")
        records = np.frombuffer(data, np.uint8).reshape(-1, RECORD_BYTES)
        check_labels(records[:, 0], 0, 9, path, "record")
        labels.append(records[:, 0])
        images.append(records[:, 1:].reshape(-1, 3, 32, 32))
    return np.concatenate(images), np.concatenate(labels)
