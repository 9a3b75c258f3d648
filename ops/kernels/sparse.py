"""The local (no network) kernels the transpiler emits: `split_byref`, `split`,
`split_selected_rows`, `split_ids`, `merge_ids`, `lookup_sparse_table`, `fake_init`."""

from __future__ import annotations

import numpy as np

from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register
from ops.tensor import LoDTensor, SelectedRows
from transpiler.ir.types import VarKind


@register("split_byref", defaults={"axis": 0})  # Paddle 2.x's; 1.8 splits along dim 0 only
def split_byref(ctx: OpContext) -> None:
    """Split X along dim 0 into blocks of `sections` rows (or `num` equal blocks); the
    blocks are views of X, not copies."""
    x = ctx.input("X")
    outs = ctx.output_names("Out")
    if int(ctx.attr("axis")) != 0:
        raise KernelError("split_byref splits along dim 0 only")
    sections = [int(s) for s in ctx.attr("sections")]
    if not sections:
        num = int(ctx.attr("num")) or len(outs)
        if x.shape[0] % num:
            raise KernelError(f"split_byref: {x.shape[0]} rows do not split into {num} equal blocks")
        sections = [x.shape[0] // num] * num
    if len(sections) != len(outs):
        raise KernelError(f"split_byref: {len(sections)} sections for {len(outs)} outputs")
    if sum(sections) != x.shape[0]:
        raise KernelError(f"split_byref: sections {sections} do not add up to {x.shape[0]} rows")
    bounds = np.cumsum(sections)[:-1]
    ctx.set_outputs("Out", np.split(x, bounds, axis=0))


@register("split")
def split(ctx: OpContext) -> None:
    """Split X along `axis` into pieces of `sections` (or `num` equal pieces); the pieces
    are views of X (the trainer's column cut of a grad into 2-D partitions)."""
    x = ctx.input("X")
    outs = ctx.output_names("Out")
    axis = int(ctx.attr("axis"))
    axis = axis + x.ndim if axis < 0 else axis
    if not 0 <= axis < x.ndim:
        raise KernelError(f"split: axis {ctx.attr('axis')} out of range for rank {x.ndim}")
    sections = [int(s) for s in ctx.attr("sections")]
    if not sections:
        num = int(ctx.attr("num")) or len(outs)
        if x.shape[axis] % num:
            raise KernelError(f"split: dim {axis} of {x.shape[axis]} does not split into {num} equal pieces")
        sections = [x.shape[axis] // num] * num
    if len(sections) != len(outs):
        raise KernelError(f"split: {len(sections)} sections for {len(outs)} outputs")
    if -1 in sections:
        known = sum(s for s in sections if s != -1)
        sections[sections.index(-1)] = x.shape[axis] - known
    if sum(sections) != x.shape[axis]:
        raise KernelError(f"split: sections {sections} do not add up to {x.shape[axis]} (dim {axis})")
    bounds = np.cumsum(sections)[:-1]
    ctx.set_outputs("Out", np.split(x, bounds, axis=axis))


@register("split_selected_rows")
def split_selected_rows(ctx: OpContext) -> None:
    """Split a SelectedRows by row ranges of `height_sections`; each output's rows are
    re-based to its block (row r in block k becomes r - start_k)."""
    x = ctx.value("X")
    if not isinstance(x, SelectedRows):
        raise KernelError("split_selected_rows needs a SelectedRows input")
    heights = np.asarray([int(h) for h in ctx.attr("height_sections")], dtype=np.int64)
    names = ctx.output_names("Out")
    if heights.size != len(names):
        raise KernelError(f"split_selected_rows: {heights.size} height_sections for {len(names)} outputs")
    starts = np.concatenate(([0], np.cumsum(heights)[:-1]))
    # Paddle's FindOutIdx: the last block whose start is <= row.
    block = np.searchsorted(starts[1:], x.rows, side="right")
    value = x.active_value()
    for k in range(heights.size):
        pick = block == k
        ctx.set_output("Out", SelectedRows(x.rows[pick] - starts[k], value[pick], int(heights[k])), i=k)


@register("split_selected_rows_by_columns")
def split_selected_rows_by_columns(ctx: OpContext) -> None:
    """Cut a SelectedRows by column ranges of its value (widths `sections`): every piece
    has the same rows and height, and its columns of each row (a sparse grad cut for 2-D
    partitions)."""
    x = ctx.value("X")
    if not isinstance(x, SelectedRows):
        raise KernelError("split_selected_rows_by_columns needs a SelectedRows input")
    sections = [int(s) for s in ctx.attr("sections")]
    names = ctx.output_names("Out")
    if len(sections) != len(names):
        raise KernelError(f"split_selected_rows_by_columns: {len(sections)} sections for {len(names)} outputs")
    value = x.active_value()
    flat = value.reshape(value.shape[0], -1)
    if sum(sections) != flat.shape[1]:
        raise KernelError(f"split_selected_rows_by_columns: sections {sections} do not add up to {flat.shape[1]} columns")
    start = 0
    for k, width in enumerate(sections):
        ctx.set_output("Out", SelectedRows(x.rows.copy(), flat[:, start : start + width], x.height), i=k)
        start += width


@register("split_ids")
def split_ids(ctx: OpContext) -> None:
    """Shard ids by `id % n` (n = number of outputs). Dense Ids (one or more tensors)
    are deduplicated and sorted first, as Paddle's std::set does; a SelectedRows (a
    table's grad) is merged (duplicate rows summed) and split with its values."""
    values = ctx.values("Ids")
    n = len(ctx.output_names("Out"))
    if n == 0:
        raise KernelError("split_ids needs at least one output")
    if isinstance(values[0], SelectedRows):
        if len(values) != 1:
            raise KernelError("split_ids takes one SelectedRows input")
        grad = values[0].merged()
        _check_non_negative(grad.rows)
        shard = grad.rows % n
        for k in range(n):
            pick = shard == k
            ctx.set_output("Out", SelectedRows(grad.rows[pick], grad.value[pick], grad.height), i=k)
        return
    ids = np.unique(np.concatenate([a.reshape(-1) for a in ctx.inputs("Ids")]).astype(np.int64))
    _check_non_negative(ids)
    shard = ids % n
    for k in range(n):
        ctx.set_output("Out", ids[shard == k].reshape(-1, 1), i=k)


def _check_non_negative(ids: np.ndarray) -> None:
    if ids.size and ids.min() < 0:
        raise KernelError(f"split_ids: negative id {int(ids.min())}")


@register("merge_ids")
def merge_ids(ctx: OpContext) -> None:
    """For each `Ids[i]`, gather its rows from the shards' answers: shard k sent back
    `X[k][j]` for id `Rows[k][j]`. `Out[i]` has one row per id and `Ids[i]`'s LoD."""
    rows = ctx.inputs("Rows")
    xs = ctx.inputs("X")
    if len(rows) != len(xs):
        raise KernelError(f"merge_ids: {len(rows)} Rows for {len(xs)} X")
    all_rows = np.concatenate([r.reshape(-1) for r in rows]).astype(np.int64)
    # an empty shard may answer with a bare (0,) array: take the width from a real answer
    width = next((x.shape[1:] for x in xs if x.ndim >= 2 and x.shape[0]), xs[0].shape[1:])
    all_x = np.concatenate([x.reshape(-1, *width) for x in xs])
    if all_rows.size != all_x.shape[0]:
        raise KernelError(f"merge_ids: {all_rows.size} row ids for {all_x.shape[0]} rows of X")
    order = np.argsort(all_rows, kind="stable")
    sorted_rows = all_rows[order]
    if sorted_rows.size > 1 and (np.diff(sorted_rows) == 0).any():
        raise KernelError("merge_ids: an id appears in more than one shard's Rows")
    for i, name in enumerate(ctx.output_names("Out")):
        ids = ctx.input("Ids", i).reshape(-1).astype(np.int64)
        pos = np.minimum(np.searchsorted(sorted_rows, ids), max(sorted_rows.size - 1, 0))
        if sorted_rows.size == 0 or not np.array_equal(sorted_rows[pos], ids):
            missing = ids if sorted_rows.size == 0 else ids[sorted_rows[pos] != ids]
            raise KernelError(f"merge_ids: id {int(missing[0])} of {name!r} is in no shard's Rows")
        ctx.set_output("Out", _lookup_shaped(ctx, name, ctx.input("Ids", i).shape, all_x[order[pos]]),
                       lod=ctx.lod("Ids", i), i=i)


def _lookup_shaped(ctx: OpContext, name: str, ids_shape: tuple[int, ...], out: np.ndarray) -> np.ndarray:
    """`out` ([numel(Ids), width]) in the shape of the lookup it replaces when that is declared
    with more than 2 dims: `Ids.shape[:-1] + width` (`lookup_table`, Ids ending in 1) or
    `Ids.shape + width` (`lookup_table_v2`)."""
    var = ctx.decl(name)
    if var is None or var.shape is None or len(var.shape) <= 2:
        return out
    width = out.shape[1:]
    for lead in (tuple(ids_shape), tuple(ids_shape[:-1])):
        if len(lead) + len(width) == len(var.shape):
            return out.reshape(*lead, *width)
    raise KernelError(f"merge_ids: {name!r} is declared {list(var.shape)}, not a lookup of Ids {list(ids_shape)}")


@register("lookup_sparse_table")
def lookup_sparse_table(ctx: OpContext) -> None:
    """Rows of an auto-grown table for `Ids` (`Out` is [numel(Ids), width]). An unseen
    id gets the table's next preallocated row (or a fresh one from its initializer);
    with `is_test` unknown ids read as zeros and the table is left alone."""
    table = ctx.value("W")
    if not isinstance(table, SelectedRows):
        raise KernelError("lookup_sparse_table needs W to be a SelectedRows table (declare it SELECTED_ROWS)")
    ids = ctx.input("Ids").reshape(-1).astype(np.int64, copy=False)
    is_test = bool(ctx.attr("is_test"))
    grow = bool(ctx.attr("auto_grown_table")) and not is_test
    with table.lock:
        slots = table.lookup_index(ids, grow=grow)
        if not is_test and (slots < 0).any():
            raise KernelError(f"lookup_sparse_table: id {int(ids[slots < 0][0])} is not in the table")
        if table.capacity:
            out = table.value[np.maximum(slots, 0)]
        else:
            out = np.zeros((ids.size, *table.row_shape), table.dtype)
    zero = slots < 0
    pad = int(ctx.attr("padding_idx"))
    if pad != -1:
        zero |= ids == pad
    if zero.any():
        out[zero] = 0
    ctx.set_output("Out", out, lod=ctx.lod("Ids"))


@register("fake_init")
def fake_init(ctx: OpContext) -> None:
    """Create the var with its shape but no data (a read-only zero-stride view of one
    zero), so ops that only need the shape — a sparse lookup grad on a trainer whose
    table lives on the pservers — run without allocating the table."""
    shape = tuple(int(d) for d in ctx.attr("shape"))
    var = ctx.output_decl("Out")
    dtype = var.dtype.to_numpy() if var is not None and var.dtype is not None else np.dtype(np.float32)
    placeholder = np.broadcast_to(np.zeros((), dtype=dtype), shape)
    if var is not None and var.kind == VarKind.SELECTED_ROWS:
        ctx.set_output("Out", SelectedRows(np.zeros(0, np.int64), placeholder, shape[0] if shape else 0))
    else:
        ctx.set_output("Out", LoDTensor(placeholder))
