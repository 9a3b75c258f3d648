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

A distributed table cut by a partitioner other than `paddle` has no such shards: each
piece (a `[rows, cols]` rectangle of the plan, ids re-based to its first row) is saved in
the job's checkpoints as a Fluid SelectedRows file (`ckpt-<step>/ps<i>/<table>.block<k>`).
`merge_pieces` joins every piece file of one table back into the whole table, the plan
saying which rectangle each piece is.
"""

from __future__ import annotations

import io
import math
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


# ------------------------------------------------------------------ pieces of a partitioned table


@dataclass(frozen=True)
class Piece:
    """A checkpoint's file of one piece of a partitioned distributed table."""

    path: Path
    name: str  # the piece's var (the file's name, unescaped): a block name of the plan
    rows: np.ndarray  # ids re-based to the piece's first row
    value: np.ndarray  # `[n, ...]`: row k is the value of id rows[k]
    height: int


def is_piece_file(path: Path) -> bool:
    """True when `path` starts as a Fluid SelectedRows file (uint32 version 0), which a
    shard (`.npz`) never does."""
    try:
        with open(path, "rb") as head:
            magic = head.read(4)
    except OSError:
        return False  # read_shard says why
    return magic == b"\x00\x00\x00\x00"


def read_piece(path: Path) -> Piece:
    """Load a piece file (Fluid SelectedRows, what a checkpoint holds); `TableFileError`
    when it is not one."""
    from ops.rpc.checkpoint import decode_table, var_of_file_name  # checkpoint's file format, loaded only for pieces
    from ops.rpc.tensor_file import TensorFileError

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TableFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        rows, value, height = decode_table(data, None, str(path))
    except TensorFileError as exc:
        raise TableFileError(f"{path}: not a table piece ({exc})") from None
    if value.shape[0] != rows.size:
        raise TableFileError(f"{path}: malformed table piece ({rows.size} ids, {value.shape[0]} value rows)")
    return Piece(Path(path), var_of_file_name(Path(path).name), rows, value, height)


def plan_of(document: object, where: str) -> dict:
    """The plan of a `plan.json`, or of a checkpoint's `MANIFEST.json` (its `plan`)."""
    if isinstance(document, dict) and isinstance(document.get("plan"), dict) and "parts" in document:
        document = document["plan"]
    if not isinstance(document, dict) or not isinstance(document.get("params", []), list):
        raise TableFileError(f"{where}: not a plan.json (nor a checkpoint's MANIFEST.json)")
    return document


def _check_tiling(param: str, height: int, width: int, blocks: Sequence[dict]) -> None:
    """The plan's rectangles tile `[height, width]` exactly: every elementary row range
    between two piece edges is covered by column ranges that meet end to end."""
    edges = sorted({0, height, *(int(b["row_offset"]) for b in blocks),
                    *(int(b["row_offset"]) + int(b["rows"]) for b in blocks)})
    for r0, r1 in zip(edges, edges[1:], strict=False):
        cols = sorted((int(b["col_offset"]), int(b["col_offset"]) + int(b["cols"])) for b in blocks
                      if int(b["row_offset"]) <= r0 and r1 <= int(b["row_offset"]) + int(b["rows"]))
        end = 0
        for c0, c1 in cols:
            if c0 != end:
                what = "overlap" if c0 < end else "leave a gap"
                raise TableFileError(f"the plan's pieces of {param} {what} at rows [{r0}, {r1}), column {min(c0, end)}")
            end = c1
        if end != width:
            raise TableFileError(f"the plan's pieces of {param} leave rows [{r0}, {r1}) columns [{end}, {width}) uncovered")


def _band_holds(block: dict, row: int) -> bool:
    return int(block["row_offset"]) <= row < int(block["row_offset"]) + int(block["rows"])


def join_pieces(pieces: Sequence[tuple[np.ndarray, np.ndarray, int, int]], width: int, dtype: np.dtype,
                fill: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows of a partitioned table's pieces, joined: each piece is (its global ids,
    its `[n, c1 - c0]` values, c0, c1). Returns (every id any piece holds, ascending; their
    `[n, width]` values, `fill` where no piece gave one; which of those cells a piece gave)."""
    ids = np.unique(np.concatenate([gids for gids, _, _, _ in pieces]))
    values = np.full((ids.size, width), fill, dtype)
    held = np.zeros((ids.size, width), bool)
    for gids, value, c0, c1 in pieces:
        at = np.searchsorted(ids, gids)
        values[at, c0:c1] = value
        held[at, c0:c1] = True
    return ids, values, held


def merge_pieces(paths: Sequence[Path], plan: dict, *, fill: float = 0.0) -> tuple[str, MergedTable]:
    """One dense table from every piece file of a partitioned distributed table: (its
    name, the table). The plan says which rectangle each piece is; every piece of the
    table must be given once, and every row a piece holds must be held by every column
    piece of its row band (as a sync checkpoint always has it). The files' names are
    checked against the plan before any is read."""
    from ops.rpc.checkpoint import var_of_file_name

    if not paths:
        raise TableFileError("no pieces to merge")
    owners: dict[str, tuple[dict, dict]] = {}
    dense: dict[str, str] = {}  # a block of a param that is not a partitioned table -> the param
    for param in plan.get("params", []):
        if not isinstance(param, dict) or not isinstance(param.get("blocks"), list):
            raise TableFileError("the plan's params are malformed (each a dict with `blocks`)")
        for blk in param["blocks"]:
            if isinstance(blk, dict):
                if param.get("distributed"):
                    owners[blk.get("name")] = (param, blk)
                else:
                    dense[blk.get("name")] = param.get("param")
    seen: dict[str, Path] = {}
    for path in map(Path, paths):
        name = var_of_file_name(path.name)
        if name in dense:
            raise TableFileError(f"{path}: {name} is a block of {dense[name]}, not a piece of a partitioned table")
        if name not in owners:
            known = sorted(owners)
            hint = (f" (its pieces are named like {known[0]})" if known
                    else " (it has no distributed table cut by a partitioner)")
            raise TableFileError(f"{path}: {name} is not a piece of a partitioned table in the plan{hint}")
        if name in seen:
            raise TableFileError(f"{seen[name]} and {path} are the same piece {name}")
        seen[name] = path
    pieces = [read_piece(path) for path in seen.values()]
    given = {piece.name: piece for piece in pieces}
    param = owners[pieces[0].name][0]
    fields = ("row_offset", "rows", "col_offset", "cols")
    shape_ok = isinstance(param.get("shape"), list) and all(isinstance(d, int) and d > 0 for d in param["shape"])
    if not shape_ok or not all(isinstance(b, dict) and all(isinstance(b.get(k), int) and b[k] >= 0 for k in fields)
                               for b in param["blocks"]):
        raise TableFileError(f"the plan's entry of {param.get('param')} is malformed (a shape, and each block's "
                             f"{', '.join(fields)})")
    other = next((p for p in pieces if owners[p.name][0] is not param), None)
    if other is not None:
        raise TableFileError(f"{pieces[0].path} is a piece of {param['param']}, {other.path} of "
                             f"{owners[other.name][0]['param']}: merge one table at a time")
    shape = tuple(int(d) for d in param["shape"])
    height, width = shape[0], math.prod(shape[1:]) if len(shape) >= 2 else 1
    blocks = param["blocks"]
    missing = [blk for blk in blocks if blk["name"] not in given]
    if missing:
        blk = missing[0]
        raise TableFileError(
            f"{len(missing)} of {param['param']}'s {len(blocks)} pieces missing, e.g. {blk['name']} (rows "
            f"[{blk['row_offset']}, {int(blk['row_offset']) + int(blk['rows'])}), columns [{blk['col_offset']}, "
            f"{int(blk['col_offset']) + int(blk['cols'])}), on {blk['endpoint']}): pass every piece file"
        )
    _check_tiling(param["param"], height, width, blocks)
    first = pieces[0]
    flat: list[tuple[Piece, np.ndarray, np.ndarray, int, int]] = []  # piece, global ids, [n, cols] values, c0, c1
    for piece in pieces:
        blk = owners[piece.name][1]
        r0, rows, c0, cols = (int(blk[k]) for k in ("row_offset", "rows", "col_offset", "cols"))
        if piece.value.dtype != first.value.dtype:
            raise TableFileError(f"{piece.path}: rows of {piece.value.dtype}, {first.path}'s are {first.value.dtype}")
        if piece.height != rows or math.prod(piece.value.shape[1:]) != cols:
            raise TableFileError(
                f"{piece.path}: a piece of {piece.height} rows x {math.prod(piece.value.shape[1:])} columns, the plan's "
                f"{piece.name} is {rows} x {cols} (a checkpoint of another plan?)")
        if piece.rows.size and (int(piece.rows.min()) < 0 or int(piece.rows.max()) >= rows):
            bad = int(piece.rows.min()) if int(piece.rows.min()) < 0 else int(piece.rows.max())
            raise TableFileError(f"{piece.path}: row {bad} is outside the piece's {rows} rows")
        if np.unique(piece.rows).size != piece.rows.size:
            raise TableFileError(f"{piece.path}: holds a row twice")
        flat.append((piece, piece.rows + r0, piece.value.reshape(piece.rows.size, cols), c0, c0 + cols))
    ids, values, held = join_pieces([(g, v, c0, c1) for _, g, v, c0, c1 in flat], width, first.value.dtype, fill)
    if not held.all():
        k = int(np.flatnonzero(~held.all(axis=1))[0])
        row, column = int(ids[k]), int(np.flatnonzero(~held[k])[0])
        lacking = next(p for p, _, _, c0, c1 in flat if c0 <= column < c1 and _band_holds(owners[p.name][1], row))
        raise TableFileError(f"row {row} of {param['param']} is in some of its column pieces but not in "
                             f"{lacking.path} (a checkpoint taken mid-update?)")
    table = np.full((height, width), fill, first.value.dtype)
    table[ids] = values
    return param["param"], MergedTable(table.reshape(shape), int(ids.size), tuple(int(p.rows.size) for p in pieces))


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
