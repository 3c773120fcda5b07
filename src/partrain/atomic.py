"""Files written whole or not at all: through a temporary name in the same folder and a rename.

A reader never sees half a file, and a process killed mid-write leaves nothing under the
real name (POSIX ``rename`` replaces it in one step). The temporary name is this writer's own
(``.NAME.PID-RANDOM.tmp``, created exclusively): two processes writing one path (``predict``
and ``recommend`` caching the same profile) each rename a whole file of their own, and the
last rename wins; with one shared temporary name the first rename published the other's
half-written file and the second rename failed. A symbolic link is followed (the file it
names is replaced, the link stays) and anything but a regular file is never replaced: renamed
over, /dev/null would become a file. Stdlib only: the cost model uses it too.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO


def write_atomic(path: str | os.PathLike, content: bytes | str | Callable[[IO], object], *, text: bool = False,
                 sync: bool = False) -> Path:
    """Write ``content`` (bytes, a str, or a function that writes into the open file) to ``path``.

    ``text`` opens the file for text (CSV, JSON lines), else for bytes; ``sync`` also flushes it
    to the disk before the rename (a checkpoint must survive a crash of the machine, a cache
    need not; it also flushes the folder after the rename, so the new name survives too). On any
    failure the temporary file is removed and the error raised.
    """
    given, path = Path(path), Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        raise IsADirectoryError(f"{given} is not a regular file: not replaced") if path.is_dir() else \
            FileExistsError(f"{given} is not a regular file (a device, a pipe or a socket): not replaced")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:  # "x": created here or not at all (mode by the umask, as a plain open gives the real name)
        with open(tmp, "x" if text else "xb", **({"newline": ""} if text else {})) as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) and not text else content)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        tmp.replace(path)
        if sync:
            _sync_folder(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return given


def _sync_folder(folder: Path) -> None:
    """Flush ``folder``'s entries to the disk: a rename is durable only once its folder is."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
