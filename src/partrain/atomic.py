"""Files written whole or not at all: through a temporary name in the same folder and a rename.

A reader never sees half a file, and a process killed mid-write leaves nothing under the
real name (POSIX ``rename`` replaces it in one step). A symbolic link is followed (the file it
names is replaced, the link stays) and anything but a regular file is never replaced: renamed
over, /dev/null would become a file. Stdlib only: the cost model uses it too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO


def write_atomic(path: str | os.PathLike, content: bytes | str | Callable[[IO], object], *, text: bool = False,
                 sync: bool = False) -> Path:
    """Write ``content`` (bytes, a str, or a function that writes into the open file) to ``path``.

    ``text`` opens the file for text (CSV, JSON lines), else for bytes; ``sync`` also flushes it
    to the disk before the rename (a checkpoint must survive a crash of the machine, a cache
    need not). On any failure the temporary file is removed and the error raised.
    """
    given, path = Path(path), Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        raise IsADirectoryError(f"{given} is not a regular file: not replaced") if path.is_dir() else \
            FileExistsError(f"{given} is not a regular file (a device, a pipe or a socket): not replaced")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w" if text else "wb", **({"newline": ""} if text else {})) as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) and not text else content)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return given
