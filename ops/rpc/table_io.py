"""Sparse table shards on disk: the `save` kernel a pserver's checkpoint block runs,
the shard format, and the merge that rebuilds one table from every pserver's shard
(`pstranspile merge-table`).

A shard file (what `save` writes for a SelectedRows var) is a numpy `.npz` archive
(zip, no pickled objects) with:

| key | what |
|---|---|
| `format` | the string `ps-transpiler-table-shard/1` |
| `rows` | int64 `[n]`: the global id of each saved row (a distributed table is not re-based: pserver `i` holds the ids with `id % M == i`) |
| `value` | `[n, width...]`: row `k` is the value of id `rows[k]` (first-touch order) |
| `height` | int64 scalar: the table var's height on that pserver (its preallocated rows, not the whole table's) |

The path is `file_path`, or when that is `"none"` (the transpiler's checkpoint block)
the string bound to `kLookupTablePath` (what the checkpoint notice carried; Paddle's
`checkpoint_notify` sends pserver `i` the path `DIR/<table>_<i>`). A dense tensor is
written as a `.npy` array. Every write goes to a temp file in the target directory,
fsynced, then renamed over the target: a reader never sees half a shard, and a failed
save leaves the previous one in place.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register
from ops.tensor import LoDTensor, SelectedRows
from transpiler.errors import PsTranspilerError
from transpiler.fileio import write_atomic
from transpiler.naming import LOOKUP_TABLE_PATH

SHARD_FORMAT = "ps-transpiler-table-shard/1"


class TableFileError(PsTranspilerError):
    """A file that is not a table shard, or shards that do not make one table."""


def _write_durable(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """A checkpoint write: the folder made if need be, the file fsynced before the rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, write, durable=True)


def write_shard(path: Path, rows: np.ndarray, value: np.ndarray, height: int) -> None:
    """Write one table shard atomically (see the module docstring for the format)."""
    rows = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
    if value.shape[0] != rows.size:
        raise ValueError(f"a shard needs one value row per id: {rows.size} ids, {value.shape[0]} rows")
    arrays = {"format": np.array(SHARD_FORMAT), "rows": rows, "value": np.ascontiguousarray(value),
              "height": np.array(int(height), np.int64)}
    _write_durable(path, lambda out: np.savez(out, **arrays))


@dataclass(frozen=True)
class Shard:
    path: Path
    rows: np.ndarray
    value: np.ndarray
    height: int


def read_shard(path: Path) -> Shard:
    """Load a shard file; `TableFileError` when it is not one."""
    try:
        with open(path, "rb") as head:
            magic = head.read(6)
        if not magic.startswith(b"PK\x03\x04") and magic != b"\x93NUMPY":
            raise TableFileError(f"{path}: not a table shard (not a numpy .npz archive)")
        saved = np.load(path, allow_pickle=False)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        raise TableFileError(f"cannot read {path}: {exc.strerror}") from None
    except (OSError, ValueError, EOFError) as exc:
        raise TableFileError(f"{path}: not a table shard ({exc})") from None
    if not isinstance(saved, np.lib.npyio.NpzFile):
        raise TableFileError(f"{path}: not a table shard (a bare numpy array, not a {SHARD_FORMAT} archive)")
    with saved:
        try:
            if "format" not in saved.files or str(saved["format"]) != SHARD_FORMAT:
                raise TableFileError(f"{path}: not a table shard (no `format: {SHARD_FORMAT}` entry)")
            rows, value, height = saved["rows"], saved["value"], int(saved["height"])
        except (KeyError, ValueError, OSError, EOFError) as exc:
            raise TableFileError(f"{path}: malformed table shard ({exc})") from None
    if rows.dtype != np.int64 or rows.ndim != 1 or value.ndim < 1 or value.shape[0] != rows.size:
        raise TableFileError(f"{path}: malformed shard ({rows.size} ids, value of shape {list(value.shape)})")
    return Shard(path, rows, value, height)


@dataclass(frozen=True)
class MergedTable:
    table: np.ndarray
    from_shards: int  # rows whose value came from a shard
    per_shard: tuple[int, ...]


def merge_shards(shards: Sequence[Shard], *, height: int | None = None, fill: float = 0.0) -> MergedTable:
    """One dense `[height, width...]` table from every shard's rows. Rows no shard holds
    (never touched, so their initial value was never drawn) are `fill`. `height`
    defaults to the largest id + 1."""
    if not shards:
        raise TableFileError("no shards to merge")
    first = shards[0]
    for shard in shards[1:]:
        if shard.value.shape[1:] != first.value.shape[1:] or shard.value.dtype != first.value.dtype:
            raise TableFileError(
                f"{shard.path}: rows of {shard.value.dtype}{list(shard.value.shape[1:])} do not match "
                f"{first.path}'s {first.value.dtype}{list(first.value.shape[1:])}"
            )
    rows = np.concatenate([s.rows for s in shards])
    if rows.size and int(rows.min()) < 0:
        bad = next(s for s in shards if s.rows.size and int(s.rows.min()) < 0)
        raise TableFileError(f"{bad.path}: negative id {int(bad.rows.min())}")
    top = int(rows.max()) + 1 if rows.size else 0
    if height is None:
        height = top
    elif top > height:
        bad = next(s for s in shards if s.rows.size and int(s.rows.max()) >= height)
        raise TableFileError(f"{bad.path}: id {int(bad.rows.max())} does not fit a table of height {height}")
    owner = np.repeat(np.arange(len(shards)), [s.rows.size for s in shards])
    order = np.argsort(rows, kind="stable")
    dup = np.flatnonzero(rows[order][1:] == rows[order][:-1])
    if dup.size:
        k = order[dup[0]]
        other = order[dup[0] + 1]
        raise TableFileError(
            f"id {int(rows[k])} is in two shards: {shards[owner[k]].path} and {shards[owner[other]].path}"
        )
    table = np.full((height, *first.value.shape[1:]), fill, dtype=first.value.dtype)
    for shard in shards:
        table[shard.rows] = shard.value
    return MergedTable(table, int(rows.size), tuple(int(s.rows.size) for s in shards))


def write_table(path: Path, table: np.ndarray) -> None:
    """`np.save` the merged table atomically."""
    _write_durable(path, lambda out: np.save(out, table))


# ------------------------------------------------------------------ the kernel


@register("save")
def save(ctx: OpContext) -> None:
    """Write X to `file_path` (or, when that is `"none"` or empty, the path bound to
    `kLookupTablePath`): a SelectedRows table as a shard, a tensor as `.npy`."""
    value = ctx.value("X")
    path = str(ctx.attr("file_path"))
    if path in ("", "none"):
        bound = ctx.scope.find_var(LOOKUP_TABLE_PATH)
        if not isinstance(bound, str) or not bound:
            raise KernelError(f"save: file_path is {path!r} and no path is bound to {LOOKUP_TABLE_PATH}")
        path = bound
    target = Path(path)
    if target.exists() and not bool(ctx.attr("overwrite")):
        raise KernelError(f"save: {target} exists and overwrite is false")
    fp16 = bool(ctx.attr("save_as_fp16"))
    if isinstance(value, SelectedRows):
        with value.lock:  # a snapshot: the table may grow or update right after
            rows = value.rows.copy()
            data = value.active_value().copy()
            height = value.height
        write_shard(target, rows, data.astype(np.float16) if fp16 else data, height)
        return
    array = value.array if isinstance(value, LoDTensor) else np.asarray(value)
    array = array.astype(np.float16) if fp16 else array
    buffer = io.BytesIO()
    np.save(buffer, array)
    _write_durable(target, lambda out: out.write(buffer.getbuffer()))
