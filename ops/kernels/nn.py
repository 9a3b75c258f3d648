"""Neural-net kernels: `softmax`, embeddings (`lookup_table`, `lookup_table_v2`, with
dense or SelectedRows grads), `sequence_pool` over LoD, `top_k`, `accuracy`."""

from __future__ import annotations

import numpy as np

from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register
from ops.tensor import SelectedRows, scatter_add_rows

# Paddle's SoftmaxFunctor clips shifted logits at -64 so exp() never goes denormal.
SOFTMAX_CLIP = -64.0


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = np.maximum(x - x.max(axis=axis, keepdims=True), np.asarray(SOFTMAX_CLIP, dtype=x.dtype))
    e = np.exp(shifted)
    return e / e.sum(axis=axis, keepdims=True)


@register("softmax")
def softmax_kernel(ctx: OpContext) -> None:
    x = ctx.input("X")
    ctx.set_output("Out", softmax(x, int(ctx.attr("axis"))).astype(x.dtype, copy=False), lod=ctx.lod("X"))


@register("softmax_grad")
def softmax_grad(ctx: OpContext) -> None:
    out, dout = ctx.input("Out"), ctx.input("Out@GRAD")
    axis = int(ctx.attr("axis"))
    ctx.set_output("X@GRAD", out * (dout - (dout * out).sum(axis=axis, keepdims=True)), lod=ctx.lod("Out@GRAD"))


# ------------------------------------------------------------------- embeddings

LOOKUP_EXTRA_DEFAULTS = {"is_test": False}  # Paddle 2.6's; the catalogue holds Fluid 1.8's attrs
NO_PADDING = -1


def _lookup_ids(ctx: OpContext) -> tuple[np.ndarray, tuple[int, ...]]:
    """Flat int64 ids and the leading shape of the output (v1 drops a trailing 1)."""
    ids = ctx.input("Ids")
    if ctx.type.startswith("lookup_table_v2"):
        return ids.reshape(-1).astype(np.int64, copy=False), ids.shape
    if ids.ndim == 0 or ids.shape[-1] != 1:
        raise KernelError(f"{ctx.type}: Ids must end in a dimension of 1, got shape {list(ids.shape)}")
    return ids.reshape(-1).astype(np.int64, copy=False), ids.shape[:-1]


def _padding(ctx: OpContext, height: int) -> int:
    pad = int(ctx.attr("padding_idx"))
    return pad + height if pad < NO_PADDING else pad  # Paddle 2.x: negative counts from the end


def _check_ids(ctx: OpContext, ids: np.ndarray, height: int, pad: int) -> None:
    bad = (ids < 0) | (ids >= height)
    if pad != NO_PADDING:
        bad &= ids != pad
    if bad.any():
        raise KernelError(f"{ctx.type}: id {int(ids[bad][0])} is out of the table's range [0, {height})")


def _lookup(ctx: OpContext) -> None:
    ids, lead = _lookup_ids(ctx)
    table = ctx.value("W")
    if isinstance(table, SelectedRows):  # a pserver-side table: known ids only
        slots = table.lookup_index(ids, grow=False)
        if (slots < 0).any():
            raise KernelError(f"{ctx.type}: id {int(ids[slots < 0][0])} is not in the sparse table")
        rows, height = table.value[slots], table.height
    else:
        w = ctx.input("W")
        height = w.shape[0]
        pad = _padding(ctx, height)
        _check_ids(ctx, ids, height, pad)
        rows = w[np.where(ids == pad, 0, ids) if pad != NO_PADDING else ids]
        if pad != NO_PADDING:
            rows[ids == pad] = 0
    width = rows.shape[1:]
    ctx.set_output("Out", rows.reshape(*lead, *width), lod=ctx.lod("Ids"))


def _table_shape(ctx: OpContext) -> tuple[int, ...]:
    """W's shape from its value (a fake_init placeholder will do) or its declaration."""
    value = ctx.optional_value("W")
    if value is not None and hasattr(value, "shape"):
        return tuple(value.shape)
    var = ctx.decl(ctx.input_names("W")[0])
    if var is None or var.shape is None or any(d < 0 for d in var.shape):
        raise KernelError(f"{ctx.type}: the shape of table {ctx.input_names('W')[0]!r} is unknown")
    return tuple(var.shape)


def _lookup_grad(ctx: OpContext) -> None:
    """Dense grad: ids' rows accumulated into a zero table. Sparse (`is_sparse`): a
    SelectedRows with one row per id, duplicates kept (as Paddle's kernel does)."""
    ids, _ = _lookup_ids(ctx)
    shape = _table_shape(ctx)
    height = shape[0]
    dout = ctx.input("Out@GRAD")
    grads = dout.reshape(ids.size, *shape[1:])
    pad = _padding(ctx, height)
    _check_ids(ctx, ids, height, pad)
    if pad != NO_PADDING and (ids == pad).any():
        grads = np.where((ids == pad).reshape(-1, *([1] * (grads.ndim - 1))), 0, grads).astype(dout.dtype)
    if ctx.attr("is_sparse"):
        ctx.set_output("W@GRAD", SelectedRows(ids.copy(), np.ascontiguousarray(grads), height))
        return
    table = np.zeros(shape, dtype=dout.dtype)
    scatter_add_rows(table, ids, np.ascontiguousarray(grads))
    ctx.set_output("W@GRAD", table)


for _name in ("lookup_table", "lookup_table_v2"):
    register(_name, defaults=LOOKUP_EXTRA_DEFAULTS)(_lookup)
    register(f"{_name}_grad", defaults=LOOKUP_EXTRA_DEFAULTS)(_lookup_grad)


# ---------------------------------------------------------------- sequence_pool

POOL_TYPES = ("SUM", "AVERAGE", "SQRT", "MAX", "FIRST", "LAST")


def _pool_layout(ctx: OpContext) -> tuple[np.ndarray, tuple, np.ndarray, np.ndarray, np.ndarray]:
    """(X as rows × features, LoD, sequence starts, lengths, non-empty mask) from the
    last LoD level of X."""
    pooltype = str(ctx.attr("pooltype")).upper()
    if pooltype not in POOL_TYPES:
        raise KernelError(f"sequence_pool: pooltype {pooltype!r} is not one of {', '.join(POOL_TYPES)}")
    x = ctx.input("X")
    lod = ctx.lod("X")
    if not lod:
        raise KernelError("sequence_pool needs X with a LoD (feed a LoDTensor)")
    offsets = lod[-1]
    lengths = np.diff(offsets)
    return x.reshape(x.shape[0], -1), lod, offsets[:-1], lengths, lengths > 0


@register("sequence_pool")
def sequence_pool(ctx: OpContext) -> None:
    """Pool each sequence of X's last LoD level to one row; empty sequences get
    `pad_value` (MaxIndex -1)."""
    x2, lod, starts, lengths, full = _pool_layout(ctx)
    x = ctx.input("X")
    pooltype = str(ctx.attr("pooltype")).upper()
    n, width = lengths.size, x2.shape[1]
    out = np.full((n, width), ctx.attr("pad_value"), dtype=x.dtype)
    index = np.full((n, width), -1, dtype=np.int32)
    nz_starts = starts[full]
    if nz_starts.size:
        if pooltype in ("SUM", "AVERAGE", "SQRT"):
            sums = np.add.reduceat(x2, nz_starts, axis=0)
            divisor = {"SUM": 1, "AVERAGE": lengths[full], "SQRT": np.sqrt(lengths[full])}[pooltype]
            out[full] = sums / np.asarray(divisor, dtype=x.dtype).reshape(-1, 1) if pooltype != "SUM" else sums
        elif pooltype == "MAX":
            maxima = np.maximum.reduceat(x2, nz_starts, axis=0)
            out[full] = maxima
            index[full] = _argmax_rows(x2, nz_starts, lengths[full], maxima)
        elif pooltype == "FIRST":
            out[full] = x2[nz_starts]
        else:  # LAST
            out[full] = x2[nz_starts + lengths[full] - 1]
    out = out.reshape(n, *x.shape[1:])
    ctx.set_output("Out", out, lod=lod[:-1])
    if ctx.has_output("MaxIndex"):
        ctx.set_output("MaxIndex", index.reshape(n, *x.shape[1:]))


def _argmax_rows(x2: np.ndarray, starts: np.ndarray, lengths: np.ndarray, maxima: np.ndarray) -> np.ndarray:
    """Absolute row index of each (sequence, column) maximum; the first one on ties.

    `starts`/`lengths` are the non-empty sequences; together they cover every row (a
    LoD covers all rows and empty sequences cover none)."""
    seg = np.repeat(np.arange(starts.size), lengths)
    hit = x2 == maxima[seg]
    candidates = np.where(hit, np.arange(x2.shape[0])[:, None], np.iinfo(np.int64).max)
    return np.minimum.reduceat(candidates, starts, axis=0).astype(np.int32)


@register("sequence_pool_grad")
def sequence_pool_grad(ctx: OpContext) -> None:
    x2, _, starts, lengths, full = _pool_layout(ctx)
    x = ctx.input("X")
    pooltype = str(ctx.attr("pooltype")).upper()
    dout = ctx.input("Out@GRAD").reshape(lengths.size, -1)
    seg = np.repeat(np.arange(lengths.size), lengths)
    if pooltype == "SUM":
        dx = dout[seg]
    elif pooltype == "AVERAGE":
        dx = dout[seg] / lengths[seg].astype(dout.dtype).reshape(-1, 1)
    elif pooltype == "SQRT":
        dx = dout[seg] / np.sqrt(lengths[seg]).astype(dout.dtype).reshape(-1, 1)
    else:
        dx = np.zeros(x2.shape, dtype=dout.dtype)
        if pooltype == "MAX":
            index = ctx.optional_input("MaxIndex")
            if index is None:
                maxima = np.maximum.reduceat(x2, starts[full], axis=0)
                index = np.full(dout.shape, -1, np.int64)
                index[full] = _argmax_rows(x2, starts[full], lengths[full], maxima)
            index = index.reshape(dout.shape)[full].astype(np.int64)
            cols = np.broadcast_to(np.arange(dx.shape[1]), index.shape)
            dx[index, cols] = dout[full]
        elif pooltype == "FIRST":
            dx[starts[full]] = dout[full]
        else:  # LAST
            dx[starts[full] + lengths[full] - 1] = dout[full]
    ctx.set_output("X@GRAD", np.asarray(dx, dtype=dout.dtype).reshape(x.shape), lod=ctx.lod("X"))


# ------------------------------------------------------------- top_k, accuracy


def _top_k(x: np.ndarray, k: int, axis: int, largest: bool) -> tuple[np.ndarray, np.ndarray]:
    if not 0 < k <= x.shape[axis]:
        raise KernelError(f"top_k: k={k} out of range for a dimension of {x.shape[axis]}")
    order = np.argsort(-x if largest else x, axis=axis, kind="stable")
    index = np.take(order, np.arange(k), axis=axis)
    return np.take_along_axis(x, index, axis=axis), index.astype(np.int64)


@register("top_k", defaults={"k": 1})
def top_k(ctx: OpContext) -> None:
    x = ctx.input("X")
    k = int(ctx.scalar("K")) if ctx.has_input("K") else int(ctx.attr("k"))
    values, index = _top_k(x, k, -1, True)
    ctx.set_output("Out", values, lod=ctx.lod("X"))
    ctx.set_output("Indices", index, lod=ctx.lod("X"))


@register("top_k_v2", defaults={"k": 1, "axis": -1, "largest": True, "sorted": True})
def top_k_v2(ctx: OpContext) -> None:
    x = ctx.input("X")
    k = int(ctx.scalar("K")) if ctx.has_input("K") else int(ctx.attr("k"))
    values, index = _top_k(x, k, int(ctx.attr("axis")), bool(ctx.attr("largest")))
    ctx.set_output("Out", values)
    ctx.set_output("Indices", index)


@register("accuracy")
def accuracy(ctx: OpContext) -> None:
    """Fraction of rows whose label is among their top-k `Indices`."""
    indices = ctx.input("Indices")
    label = ctx.input("Label").reshape(-1, 1)
    rows = indices.reshape(label.shape[0], -1)
    correct = int((rows == label).any(axis=1).sum())
    total = int(label.shape[0])
    dtype = ctx.input("Out").dtype
    ctx.set_output("Accuracy", np.asarray([correct / total if total else 0.0], dtype=dtype))
    ctx.set_output("Correct", np.asarray([correct], dtype=np.int32))
    ctx.set_output("Total", np.asarray([total], dtype=np.int32))
