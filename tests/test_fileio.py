"""transpiler.fileio: atomic for regular files, written through for anything else."""

from __future__ import annotations

import os

import pytest

from transpiler.fileio import write_bytes_atomic, write_files


def test_a_regular_file_is_replaced_atomically_keeping_its_mode(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    path.chmod(0o640)
    write_bytes_atomic(path, b"new")
    assert path.read_bytes() == b"new" and (path.stat().st_mode & 0o777) == 0o640
    assert os.listdir(tmp_path) == ["f"]  # no temp file left


def test_a_symlink_is_written_through_not_replaced(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"old")
    link = tmp_path / "link"
    link.symlink_to(target)
    write_bytes_atomic(link, b"new")
    assert link.is_symlink() and target.read_bytes() == b"new"


def test_a_fifo_is_written_into_not_replaced(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so opening for write does not block
    try:
        write_bytes_atomic(fifo, b"through")
        assert os.read(reader, 100) == b"through"
    finally:
        os.close(reader)
    assert not fifo.is_file() and fifo.exists()


def test_a_device_stays_a_device():
    write_bytes_atomic("/dev/null", b"gone")
    assert not os.path.isfile("/dev/null")


def test_a_file_in_the_way_of_the_folder_is_named(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    with pytest.raises(NotADirectoryError, match="afile is a file, not a directory"):
        write_files({"x": b""}, blocker / "sub")
    with pytest.raises(NotADirectoryError, match="afile is a file, not a directory"):
        write_files({"x": b""}, blocker)
    with pytest.raises(NotADirectoryError, match="afile is a file, not a directory"):
        write_bytes_atomic(blocker / "sub" / "f", b"")


def test_stale_files_of_an_earlier_set_go(tmp_path):
    write_files({"pserver_a.pb": b"1", "pserver_b.pb": b"1", "keep.txt": b"mine"}, tmp_path / "o")
    write_files({"pserver_a.pb": b"2", "plan.json": b"{}"}, tmp_path / "o", stale="pserver_*.pb")
    assert sorted(os.listdir(tmp_path / "o")) == ["keep.txt", "plan.json", "pserver_a.pb"]
