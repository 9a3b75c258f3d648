"""Atomic file writing: a reader never sees a half-written file or a partial set of files.

A leaf module (the standard library only), so every layer can use it: the IR saves
programs, the output layer a transpile result, the passes their dump folders, the RPC
layer table shards. `tempfile` and `shutil` (with `bz2`, `lzma`, `random`, ...) are
imported by the functions that write: most processes never write a file, and what a
process imports stays resident (issue 30).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], object], *, durable: bool = False) -> None:
    """Call `write(file)` on a temp file beside `path`, then rename it over `path`.
    `durable=True` fsyncs first, so a crash leaves the old file or the new, never a torn
    one (checkpoints). The file gets the mode an ordinary write would give it (an existing
    file's mode, else 0666 minus the umask), not `mkstemp`'s private 0600."""
    path = Path(os.path.realpath(path))  # through a symlink: replace what it points at
    if path.exists() and not path.is_file():
        # A FIFO, a device, a terminal: a rename would replace the node itself with a
        # regular file (as root, `-o /dev/full` would replace the device). Write into it.
        with open(path, "wb") as handle:
            write(handle)
        return
    _check_parent(path)
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            os.fchmod(handle.fileno(), _new_file_mode(path))
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """`data` to `path` through a temp file and a rename (see `write_atomic`)."""
    write_atomic(path, lambda handle: handle.write(data))


def write_files(
    files: Mapping[str, bytes],
    out_dir: str | os.PathLike,
    *,
    replace_dir: bool = False,
    stale: str | None = None,
) -> list[Path]:
    """Write `files` into `out_dir` so that a reader never sees a partial set.
    `replace_dir=True` swaps in a folder holding only `files`: whatever else an earlier
    run left in `out_dir` goes (a `--dump-dir` pass folder must not mix two runs).
    `stale` (a glob) names files an earlier run may have left that this set replaces:
    those not in `files` are removed once the new ones are in (and their folder, if
    that leaves it empty). A name may hold one folder level, `folder/file` (`/`-separated)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"{out_dir} is a file, not a directory")
    _check_parent(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    import shutil
    import tempfile

    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".tmp"))
    try:
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp's 0700 would stick to a new out_dir
        for name, data in files.items():
            if "/" in name:  # a file in a folder of its own (Fluid 1.8's `<program>/__model__`)
                (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)  # plain writes: ordinary file modes
        if replace_dir and out_dir.exists():
            shutil.rmtree(out_dir)
        if not out_dir.exists():
            os.replace(staging, out_dir)
        else:
            for name in files:
                if "/" in name:
                    (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
                os.replace(staging / name, out_dir / name)
            shutil.rmtree(staging)
            for old in sorted(out_dir.glob(stale)) if stale else ():
                if old.relative_to(out_dir).as_posix() not in files and old.is_file():
                    old.unlink()
                    if old.parent != out_dir and not any(old.parent.iterdir()):
                        old.parent.rmdir()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [out_dir / name for name in files]


def _check_parent(path: Path) -> None:
    """A clear error where a file stands in the way of `path`'s folders (mkdir would say
    only "File exists")."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(f"{parent} is a file, not a directory")
            return


def _new_file_mode(path: Path) -> int:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
