"""Compile-time shape rules, as Fluid 1.8.5's `InferShape` runs them when an op is appended.

Each rule takes a `ShapeContext` and returns, per output slot it decides, one
`TensorInfo` per argument. `-1` is a dimension known only at run time; rules keep it
where Paddle keeps it. A rule raises `ShapeError` with the shapes involved when the
inputs cannot go together; the builder adds the layer's name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ops.catalogue.opdef import ShapeContext, ShapeError, TensorInfo
from transpiler.ir.types import DType, VarKind

Result = Mapping[str, list["TensorInfo | None"]]


def fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def same_as(src: str = "X", dsts: Sequence[str] = ("Out",), *, dtype: DType | None = None, lod: bool = True):
    """Outputs shaped (and LoD-shared) like input `src`."""

    def rule(ctx: ShapeContext) -> Result:
        x = ctx.x(src)
        info = x.with_(dtype=dtype or x.dtype, lod_level=x.lod_level if lod else 0, kind=VarKind.LOD_TENSOR)
        return {dst: [info] for dst in dsts}

    return rule


unary = same_as()


def keep_kind(ctx: ShapeContext) -> Result:
    """`scale`, `assign`, `clip`: same shape and kind as X (a SelectedRows grad stays one)."""
    x = ctx.x("X")
    return {"Out": [x]}


def scalar_out(ctx: ShapeContext) -> Result:
    """`mean`: a `[1]` tensor."""
    x = ctx.x("X")
    return {"Out": [TensorInfo(x.dtype, (1,))]}


def _broadcast(op: str, x: Sequence[int], y: Sequence[int], axis: int) -> tuple[int, ...]:
    """Paddle's `GetBroadcastDimsArrays`: y aligned at `axis` of x (-1: trailing)."""
    if len(y) > len(x):
        x, y = y, x
    axis = len(x) - len(y) if axis == -1 else axis
    if not 0 <= axis <= len(x) - len(y):
        raise ShapeError(f"{op}: axis {axis} does not fit Y {fmt(y)} into X {fmt(x)}")
    y_full = [1] * axis + list(y) + [1] * (len(x) - len(y) - axis)
    out = []
    for i, (a, b) in enumerate(zip(x, y_full, strict=True)):
        if a > 1 and b > 1 and a != b:
            raise ShapeError(f"{op}: X {fmt(x)} and Y {fmt(y)} do not broadcast (dim {i}: {a} vs {b}, axis={axis})")
        if a > 1 or b > 1 or (a == 1 and b == 1):
            out.append(max(a, b))
        else:
            out.append(-1)
    return tuple(out)


def elementwise(ctx: ShapeContext) -> Result:
    x, y = ctx.x("X"), ctx.x("Y")
    shape = _broadcast(ctx.op_type, x.shape, y.shape, ctx.attr("axis"))
    return {"Out": [TensorInfo(x.dtype, shape, x.lod_level)]}


def compare(ctx: ShapeContext) -> Result:
    """`less_than` & co.: X's shape, bool."""
    x = ctx.x("X")
    return {"Out": [TensorInfo(DType.BOOL, x.shape, x.lod_level)]}


def logical(ctx: ShapeContext) -> Result:
    x = ctx.x("X")
    return {"Out": [TensorInfo(DType.BOOL, x.shape, x.lod_level)]}


def _flat(shape: Sequence[int], cols: int) -> tuple[int, int]:
    def prod(dims: Sequence[int]) -> int:
        return -1 if any(d < 0 for d in dims) else math.prod(dims)

    return prod(shape[:cols]), prod(shape[cols:])


def mul(ctx: ShapeContext) -> Result:
    x, y = ctx.x("X"), ctx.x("Y")
    xc, yc = ctx.attr("x_num_col_dims"), ctx.attr("y_num_col_dims")
    if not 0 < xc < len(x.shape) or not 0 < yc < len(y.shape):
        raise ShapeError(
            f"mul: x_num_col_dims={xc} / y_num_col_dims={yc} do not fit X {fmt(x.shape)} and Y {fmt(y.shape)}"
        )
    _, x_cols = _flat(x.shape, xc)
    y_rows, _ = _flat(y.shape, yc)
    if x_cols > 0 and y_rows > 0 and x_cols != y_rows:
        raise ShapeError(
            f"mul: X {fmt(x.shape)} and Y {fmt(y.shape)} cannot multiply "
            f"(X flattens to {x_cols} columns, Y to {y_rows} rows)"
        )
    shape = tuple(x.shape[:xc]) + tuple(y.shape[yc:])
    return {"Out": [TensorInfo(x.dtype, shape, x.lod_level)]}


def reduce(ctx: ShapeContext) -> Result:
    x = ctx.x("X")
    dims = [d + len(x.shape) if d < 0 else d for d in ctx.attr("dim")]
    for d in dims:
        if not 0 <= d < len(x.shape):
            raise ShapeError(f"{ctx.op_type}: dim {d} is out of range for X {fmt(x.shape)}")
    keep = ctx.attr("keep_dim")
    if ctx.attr("reduce_all") or not dims:
        shape: tuple[int, ...] = tuple(1 for _ in x.shape) if keep else (1,)
    else:
        shape = tuple(1 if i in dims else d for i, d in enumerate(x.shape) if keep or i not in dims) or (1,)
    dtype = x.dtype if ctx.attr("out_dtype") in (-1, None) else DType(ctx.attr("out_dtype"))
    return {"Out": [TensorInfo(dtype, shape)]}


def concat(ctx: ShapeContext) -> Result:
    xs = ctx.all("X")
    if not xs:
        raise ShapeError("concat: needs at least one input")
    rank = len(xs[0].shape)
    axis = ctx.attr("axis")
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        raise ShapeError(f"concat: axis {ctx.attr('axis')} is out of range for inputs of rank {rank}")
    out = list(xs[0].shape)
    for x in xs[1:]:
        if len(x.shape) != rank:
            raise ShapeError(f"concat: inputs {fmt(xs[0].shape)} and {fmt(x.shape)} differ in rank")
        for i, (a, b) in enumerate(zip(out, x.shape, strict=True)):
            if i == axis:
                out[i] = -1 if a < 0 or b < 0 else a + b
            elif a > 0 and b > 0 and a != b:
                raise ShapeError(f"concat: inputs {fmt(xs[0].shape)} and {fmt(x.shape)} differ in dim {i} (axis={axis})")
            elif a < 0:
                out[i] = b
    return {"Out": [TensorInfo(xs[0].dtype, tuple(out), xs[0].lod_level)]}


def sum_(ctx: ShapeContext) -> Result:
    xs = ctx.all("X")
    if not xs:
        raise ShapeError("sum: needs at least one input")
    first = xs[0]
    for x in xs[1:]:
        if len(x.shape) != len(first.shape) or any(
            a > 0 and b > 0 and a != b for a, b in zip(x.shape, first.shape, strict=True)
        ):
            raise ShapeError(f"sum: inputs {fmt(first.shape)} and {fmt(x.shape)} differ")
    kind = VarKind.SELECTED_ROWS if all(x.kind == VarKind.SELECTED_ROWS for x in xs) else VarKind.LOD_TENSOR
    return {"Out": [first.with_(kind=kind)]}


def cast(ctx: ShapeContext) -> Result:
    x = ctx.x("X")
    return {"Out": [x.with_(dtype=DType(ctx.attr("out_dtype")))]}


def from_attrs(ctx: ShapeContext) -> Result:
    """`fill_constant`, `uniform_random`, ...: shape and dtype are attrs."""
    return {"Out": [TensorInfo(DType(ctx.attr("dtype")), tuple(ctx.attr("shape")))]}


def lookup_table(ctx: ShapeContext) -> Result:
    """v1 ids end in a 1: `[N, 1]` ids give `[N, width]`; the LoD follows the ids."""
    w, ids = ctx.x("W"), ctx.x("Ids")
    if len(w.shape) != 2:
        raise ShapeError(f"{ctx.op_type}: the table W must be 2-D, got {fmt(w.shape)}")
    if not ids.shape or ids.shape[-1] != 1:
        raise ShapeError(f"{ctx.op_type}: Ids {fmt(ids.shape)} must end in a dimension of 1")
    return {"Out": [TensorInfo(w.dtype, tuple(ids.shape[:-1]) + (w.shape[1],), ids.lod_level)]}


def lookup_table_v2(ctx: ShapeContext) -> Result:
    """v2 (Paddle 2.x's `embedding`): `[N]` or `[N, k]` ids give `ids.shape + [width]`."""
    w, ids = ctx.x("W"), ctx.x("Ids")
    if len(w.shape) != 2:
        raise ShapeError(f"{ctx.op_type}: the table W must be 2-D, got {fmt(w.shape)}")
    return {"Out": [TensorInfo(w.dtype, tuple(ids.shape) + (w.shape[1],), ids.lod_level)]}


def sequence_pool(ctx: ShapeContext) -> Result:
    x = ctx.x("X")
    if x.lod_level < 1:
        raise ShapeError(f"sequence_pool: X {fmt(x.shape)} has no LoD (lod_level 0); pool a sequence (lod_level >= 1)")
    out: dict[str, list[TensorInfo | None]] = {"Out": [TensorInfo(x.dtype, x.shape, x.lod_level - 1)]}
    if ctx.attr("pooltype") == "MAX":
        out["MaxIndex"] = [TensorInfo(x.dtype, x.shape)]
    return out


def _label_dims(op: str, x: TensorInfo, label: TensorInfo, soft: bool) -> None:
    want = tuple(x.shape[:-1]) + ((x.shape[-1],) if soft else (1,))
    if len(label.shape) != len(want) or any(a > 0 and b > 0 and a != b for a, b in zip(label.shape, want, strict=True)):
        kind = "soft" if soft else "hard"
        raise ShapeError(f"{op}: Label {fmt(label.shape)} does not fit input {fmt(x.shape)} ({kind} labels need {fmt(want)})")
    if not soft and label.dtype not in (DType.INT64, DType.INT32):
        raise ShapeError(f"{op}: hard labels must be int64, got {label.dtype.short if label.dtype else None}")


def cross_entropy(ctx: ShapeContext) -> Result:
    x, label = ctx.x("X"), ctx.x("Label")
    _label_dims(ctx.op_type, x, label, bool(ctx.attrs.get("soft_label", False)))
    y = TensorInfo(x.dtype, tuple(x.shape[:-1]) + (1,), x.lod_level)
    if ctx.op_type == "cross_entropy2":
        return {"Y": [y], "XShape": [TensorInfo(x.dtype, tuple(x.shape) + (0,))], "MatchX": [y.with_(lod_level=0)]}
    return {"Y": [y]}


def softmax_with_cross_entropy(ctx: ShapeContext) -> Result:
    logits, label = ctx.x("Logits"), ctx.x("Label")
    _label_dims(ctx.op_type, logits, label, bool(ctx.attr("soft_label")))
    loss = TensorInfo(logits.dtype, tuple(logits.shape[:-1]) + (1,), logits.lod_level)
    return {"Softmax": [TensorInfo(logits.dtype, logits.shape, logits.lod_level)], "Loss": [loss]}
