"""Output paths, checked before any work starts, and written whole.

A command that writes its result after minutes of training or measuring checks where it will
write first, so that a path that cannot take the file is one line, exit status 2, before
anything runs or any file is written, not a traceback at the end. Every check tries the folder
for real: ``os.access`` says yes to root everywhere, /proc and /sys included.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from partrain.errors import PartrainError


def check_file(flag: str, path: str | os.PathLike) -> Path:
    """``path`` can be written as a file: a regular file or nothing yet (never a directory, a
    device such as /dev/null, a pipe: the write replaces the file by rename, and would replace
    those), in a folder that exists and takes new files. A symbolic link is followed: the file
    it names is written, the link stays."""
    if str(path) == "":
        raise PartrainError(f"{flag}: give a file name")
    p = Path(path)
    target = Path(os.path.realpath(p))
    if target.is_dir():
        raise PartrainError(f"{flag} {path}: is a directory; give a file name, e.g. {p / 'out'}")
    if target.exists() and not target.is_file():
        raise PartrainError(f"{flag} {path}: is not a regular file (a device, a pipe or a socket) and would be "
                            "replaced; give a file name")
    folder = target.parent
    if not folder.is_dir():
        blocker = next((a for a in (folder, *folder.parents) if a.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise PartrainError(f"{flag} {path}: {blocker} is a file, not a folder")
        raise PartrainError(f"{flag} {path}: the folder {p.parent} does not exist; create it first")
    if not can_write_in(folder):
        raise PartrainError(f"{flag} {path}: the folder {p.parent} is not writable")
    return p


def check_dir(flag: str, path: str | os.PathLike) -> Path:
    """``path`` is a directory, or can be made one: no file in the way, a writable ancestor."""
    if str(path) == "":
        raise PartrainError(f"{flag}: give a directory")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise PartrainError(f"{flag} {path}: a file is in the way; give a directory")
    existing = next(a for a in (p.absolute(), *p.absolute().parents) if a.exists())
    if not existing.is_dir():
        raise PartrainError(f"{flag} {path}: {existing} is a file, not a folder")
    if not can_write_in(existing):
        raise PartrainError(f"{flag} {path}: {existing} is not writable; choose another place")
    return p


def can_write_in(folder: Path) -> bool:
    """Whether something can be created in ``folder``, tried for real and removed:
    ``--checkpoint /proc/x`` trained to the end of the epoch, then raised, before this."""
    try:
        with tempfile.TemporaryDirectory(dir=folder, prefix=".partrain-check-"):
            return True
    except OSError:
        return False
