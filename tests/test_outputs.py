"""Output paths: checked before work (``partrain.outputs``) and written whole (``partrain.atomic``)."""

from __future__ import annotations

import os

import pytest

from partrain.atomic import write_atomic
from partrain.errors import PartrainError
from partrain.outputs import check_dir, check_file


def test_a_symbolic_link_is_written_through_and_stays_a_link(tmp_path):
    (tmp_path / "real").mkdir()
    link = tmp_path / "model.pt"
    link.symlink_to(tmp_path / "real" / "model.pt")
    check_file("--save-model", link)
    assert write_atomic(link, b"weights") == link
    assert link.is_symlink() and (tmp_path / "real" / "model.pt").read_bytes() == b"weights"
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["model.pt"]  # no temporary left


def test_a_pipe_or_a_device_is_never_replaced(tmp_path):
    fifo = tmp_path / "out.pt"
    os.mkfifo(fifo)
    with pytest.raises(PartrainError, match="not a regular file"):
        check_file("--save-model", fifo)
    with pytest.raises(FileExistsError, match="not a regular file"):
        write_atomic(fifo, b"x")
    assert fifo.is_fifo()
    with pytest.raises(PartrainError, match="--save-model /dev/null: is not a regular file"):
        check_file("--save-model", "/dev/null")


def test_two_writers_of_one_path_each_publish_a_whole_file(tmp_path):
    """The second writer starts while the first is mid-write (its half-file on disk): with a
    shared temporary name the first rename published the second's half-file, and the second
    rename then failed with FileNotFoundError."""
    target = tmp_path / "profile.json"
    seen = []

    def first(f):
        f.write("A" * 100)
        f.flush()
        write_atomic(target, lambda g: g.write("B" * 100), text=True)  # the other process, meanwhile
        seen.append(target.read_text())
        f.write("A" * 100)

    write_atomic(target, first, text=True, sync=True)
    assert seen == ["B" * 100]  # the second writer's file, whole
    assert target.read_text() == "A" * 200  # then the first's, whole: the last rename wins
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]  # no temporary left
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # the umask's mode, as open() gives


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("where, words", [
    ("{tmp}", "is a directory"),
    ("{tmp}/f.txt/x.csv", "is a file, not a folder"),
    ("{tmp}/no/such/x.csv", "the folder {tmp}/no/such does not exist"),
    ("/proc/x.csv", "is not writable"),
    ("", "give a file name"),
])
def test_a_file_that_cannot_be_written_is_named_with_the_reason(tmp_path, where, words):
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(PartrainError, match="^--output") as err:
        check_file("--output", where.replace("{tmp}", str(tmp_path)))
    assert words.replace("{tmp}", str(tmp_path)) in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]  # the check leaves nothing behind


def test_a_directory_that_cannot_be_made_is_named_with_the_reason(tmp_path):
    (tmp_path / "f.txt").write_text("x")
    assert check_dir("--events", tmp_path / "new" / "ev") == tmp_path / "new" / "ev"
    with pytest.raises(PartrainError, match="a file is in the way"):
        check_dir("--events", tmp_path / "f.txt")
    with pytest.raises(PartrainError, match="is a file, not a folder"):
        check_dir("--events", tmp_path / "f.txt" / "ev")
    assert not (tmp_path / "new").exists()
