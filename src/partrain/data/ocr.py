"""Reader for the OCR handwritten-letters CSV files of CMU 10-601 (Fall 2019).

The data is B. Taskar's OCR letters set (Taskar, Guestrin and Koller, "Max-Margin Markov
Networks", NIPS 2003), a 10-letter subset. Format: plain CSV, no header, one sample per line
of 129 integers: the label (0-9 for a e g i l n o r t u), then the 16x8 binary image (1 is
ink), row-major.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from partrain.data.files import check_labels, corrupt, read_bytes

ROWS, COLS = 16, 8
COLUMNS = 1 + ROWS * COLS


def read_ocr_csv(path: Path, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Images ``[n, 1, 16, 8]`` (0 or 1) and labels ``[n]`` from one CSV file."""
    try:
        lines = read_bytes(path).decode("ascii").rstrip().splitlines()
    except UnicodeDecodeError as err:
        raise corrupt(path, f"not an ASCII CSV file (byte {err.start})") from None
    if not lines:
        raise corrupt(path, "no rows")
    table = np.empty((len(lines), COLUMNS), np.int64)
    for i, line in enumerate(lines):
        fields = line.split(",")
        if len(fields) != COLUMNS:
            raise corrupt(path, f"line {i + 1} has {len(fields)} columns, expected {COLUMNS} "
                                f"(a label and {ROWS}x{COLS} pixels)")
        try:
            table[i] = [int(field) for field in fields]
        except (ValueError, OverflowError):  # not a number, or one beyond 64 bits
            col, field = next((c, f) for c, f in enumerate(fields, 1) if not _is_int(f))
            raise corrupt(path, f"line {i + 1}, column {col}: {field!r} is not a 64-bit integer") from None
    check_labels(table[:, 0], 0, num_classes - 1, path, "line", first=1)
    bad = np.argwhere((table[:, 1:] < 0) | (table[:, 1:] > 1))
    if bad.size:
        row, col = bad[0]
        raise corrupt(path, f"line {row + 1}, column {col + 2}: pixel {table[row, col + 1]} is not 0 or 1")
    return table[:, 1:].astype(np.uint8).reshape(-1, 1, ROWS, COLS), table[:, 0]


def _is_int(field: str) -> bool:
    """A number that a 64-bit table holds."""
    try:
        return -2**63 <= int(field) < 2**63
    except ValueError:
        return False
