"""Tensor kernels: constants and copies (`fill_constant`, `fill_zeros_like`,
`assign`, `assign_value`, `cast`), shape ops (`concat`, `reshape2`, `transpose2`,
with grads), counters (`increment`), comparisons and logical ops, and the distributed
`ref_by_trainer_id` (no RPC in it: it picks one of its inputs)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ops.kernels.broadcast import operands
from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register
from ops.tensor import LoDTensor, SelectedRows
from transpiler.ir.types import DType, VarKind


def np_dtype(code: Any) -> np.dtype:
    """A Paddle dtype attr (the `VarType` wire number) as a numpy dtype."""
    try:
        return DType(int(code)).to_numpy()
    except (ValueError, TypeError) as exc:
        raise KernelError(f"unsupported dtype {code!r}: {exc}") from None


def shape_from(ctx: OpContext, attr: str = "shape") -> tuple[int, ...]:
    """The shape an op creates: its `ShapeTensor` input, else its `ShapeTensorList`
    inputs, else the attr (Paddle's precedence)."""
    if ctx.has_input("ShapeTensor"):
        return tuple(int(d) for d in ctx.input("ShapeTensor").reshape(-1))
    if ctx.has_input("ShapeTensorList"):
        return tuple(int(a.reshape(-1)[0]) for a in ctx.inputs("ShapeTensorList"))
    shape = tuple(int(d) for d in ctx.attr(attr))
    if any(d < 0 for d in shape):
        raise KernelError(f"{ctx.type}: shape {list(shape)} has an unknown (-1) dimension")
    return shape


def store_created(ctx: OpContext, array: np.ndarray, initializer: Callable[[int], np.ndarray] | None = None) -> None:
    """Store a freshly created tensor as `Out`; a var declared SELECTED_ROWS gets it as
    the value of an (empty) table, as Paddle's initializers do."""
    if ctx.output_kind("Out") == VarKind.SELECTED_ROWS:
        if array.ndim == 0:
            raise KernelError(f"{ctx.type}: a SelectedRows var needs a shape with rows")
        ctx.set_output("Out", SelectedRows(np.zeros(0, np.int64), array, array.shape[0], initializer=initializer))
    else:
        ctx.set_output("Out", array)


def _parse_value(text: str, dtype: np.dtype) -> Any:
    if dtype == np.bool_:
        return text.strip().lower() in ("true", "1", "1.0")
    if np.issubdtype(dtype, np.integer):
        try:
            return int(text)
        except ValueError:
            return int(float(text))
    return float(text)  # accepts "inf", "-inf", "nan", "1e-3"


@register("fill_constant")
def fill_constant(ctx: OpContext) -> None:
    dtype = np_dtype(ctx.attr("dtype"))
    if ctx.has_input("ValueTensor"):
        value = ctx.scalar("ValueTensor")
    elif str(ctx.attr("str_value")):
        value = _parse_value(str(ctx.attr("str_value")), dtype)
    else:
        value = ctx.attr("value")
    shape = shape_from(ctx)
    grow = (lambda n: np.full((n, *shape[1:]), value, dtype=dtype)) if shape else None
    store_created(ctx, np.full(shape, value, dtype=dtype), grow)


@register("fill_zeros_like")
def fill_zeros_like(ctx: OpContext) -> None:
    x = ctx.input("X")
    ctx.set_output("Out", np.zeros_like(x), lod=ctx.lod("X"))


@register("assign")
def assign(ctx: OpContext) -> None:
    """Out = X (the same value object: values are never mutated in place)."""
    ctx.set_output("Out", ctx.value("X"))


ASSIGN_VALUE_SLOTS = ("fp32_values", "fp64_values", "int32_values", "int64_values", "bool_values", "values")


@register("assign_value", defaults={"shape": (), "dtype": int(DType.FP32)})
def assign_value(ctx: OpContext) -> None:
    dtype = np_dtype(ctx.attr("dtype"))
    values: tuple = ()
    for name in ASSIGN_VALUE_SLOTS:
        if ctx.has_attr(name) and ctx.attr(name):
            values = ctx.attr(name)
            break
    shape = tuple(int(d) for d in ctx.attr("shape"))
    if len(values) != math.prod(shape):
        raise KernelError(f"assign_value: {len(values)} values for shape {list(shape)}")
    ctx.set_output("Out", np.asarray(values, dtype=dtype).reshape(shape))


@register("cast")
def cast(ctx: OpContext) -> None:
    """Out = X as `out_dtype`. Its grad is `cast` with the dtypes swapped."""
    value = ctx.value("X")
    dtype = np_dtype(ctx.attr("out_dtype"))
    if isinstance(value, SelectedRows):
        ctx.set_output("Out", SelectedRows(value.rows, value.active_value().astype(dtype), value.height))
        return
    ctx.set_output("Out", ctx.input("X").astype(dtype, copy=False), lod=ctx.lod("X"))


@register("increment")
def increment(ctx: OpContext) -> None:
    x = ctx.input("X")
    step = x.dtype.type(ctx.attr("step"))
    ctx.set_output("Out", np.asarray(x + step, dtype=x.dtype))


# ------------------------------------------------------------------ concat


def _axis(ctx: OpContext, ndim: int) -> int:
    axis = int(ctx.scalar("AxisTensor")) if ctx.has_input("AxisTensor") else int(ctx.attr("axis"))
    axis = axis + ndim if axis < 0 else axis
    if not 0 <= axis < max(ndim, 1):
        raise KernelError(f"{ctx.type}: axis {axis} out of range for rank {ndim}")
    return axis


@register("concat")
def concat(ctx: OpContext) -> None:
    xs = ctx.inputs("X")
    axis = _axis(ctx, xs[0].ndim)
    held = _joined_already(ctx, xs, axis)
    if held is not None:  # the blocks were received into the output's own array: nothing to copy
        ctx.set_output("Out", held, lod=ctx.lod("X") if axis != 0 else None)
        return
    # Into the array the output var holds when nobody else can see it change (a trainer
    # joining the param blocks it received into its param: no second param-sized array).
    dtype = np.result_type(*xs)
    shape = list(xs[0].shape)
    shape[axis] = sum(x.shape[axis] for x in xs)
    into = ctx.current_output("Out", tuple(shape), dtype) if all(x.ndim == len(shape) for x in xs) else None
    if into is not None and any(np.may_share_memory(into, x) for x in xs):
        into = None
    out = np.concatenate(xs, axis=axis, out=into)
    ctx.set_output("Out", out, lod=ctx.lod("X") if axis != 0 else None)


def _joined_already(ctx: OpContext, xs: list[np.ndarray], axis: int) -> np.ndarray | None:
    """The array Out holds when the inputs are views of it that tile it in order along
    axis 0 (a transport that receives param blocks straight into the param): then the
    concatenation is that array, bit for bit, and no copy is needed. Else None."""
    if axis != 0 or len(xs) < 2:
        return None
    names = ctx.output_names("Out")
    if not names or names[0] in ctx.op.input_names:
        return None
    tensor = ctx.scope.find_var(names[0])
    if type(tensor) is not LoDTensor:
        return None
    return tensor.array if tiles_rows(tensor.array, xs) else None


def tiles_rows(whole: np.ndarray, xs: list[np.ndarray]) -> bool:
    """Whether `xs` are views of `whole`'s rows that tile it in order along axis 0, each
    where the one before ends (a param whose blocks were received straight into it)."""
    if not whole.flags.c_contiguous or whole.ndim == 0:
        return False
    start = whole.__array_interface__["data"][0]
    offset = 0
    for x in xs:
        if (x.base is None or x.dtype != whole.dtype or x.ndim != whole.ndim or x.shape[1:] != whole.shape[1:]
                or not x.flags.c_contiguous or x.__array_interface__["data"][0] != start + offset
                or not np.may_share_memory(x, whole)):
            return False
        offset += x.nbytes
    return offset == whole.nbytes


@register("concat_grad")
def concat_grad(ctx: OpContext) -> None:
    """Split Out@GRAD back into one piece per X (X@GRAD args line up with X's; Paddle
    puts `@EMPTY@` where a grad is not needed)."""
    dout = ctx.input("Out@GRAD")
    axis = _axis(ctx, dout.ndim)
    xs = ctx.inputs("X")
    bounds = np.cumsum([x.shape[axis] for x in xs])[:-1]
    pieces = np.split(dout, bounds, axis=axis)
    names = ctx.op.output("X@GRAD")
    for i, name in enumerate(names):
        if i < len(pieces):
            ctx.set_var(name, pieces[i], lod=ctx.lod("X", i))


# ----------------------------------------------------------- reshape, transpose


def _target_shape(ctx: OpContext, x: np.ndarray) -> tuple[int, ...]:
    if ctx.has_input("Shape"):
        shape = [int(d) for d in ctx.input("Shape").reshape(-1)]
    elif ctx.has_input("ShapeTensor"):
        shape = [int(a.reshape(-1)[0]) for a in ctx.inputs("ShapeTensor")]
    else:
        shape = [int(d) for d in ctx.attr("shape")]
    # 0 copies the input's dim at that position; -1 is inferred (numpy does that).
    return tuple(x.shape[i] if d == 0 else d for i, d in enumerate(shape))


def _xshape(x: np.ndarray) -> np.ndarray:
    """Paddle's XShape: an empty tensor of dims [0] + X.shape, kept for the grad."""
    return np.zeros((0, *x.shape), dtype=x.dtype)


@register("reshape2")
def reshape2(ctx: OpContext) -> None:
    x = ctx.input("X")
    try:
        out = x.reshape(_target_shape(ctx, x))
    except ValueError as exc:
        raise KernelError(f"reshape2: cannot reshape {list(x.shape)}: {exc}") from None
    ctx.set_output("Out", out)
    ctx.set_output("XShape", _xshape(x))


@register("reshape2_grad")
def reshape2_grad(ctx: OpContext) -> None:
    dout = ctx.input("Out@GRAD")
    ctx.set_output("X@GRAD", dout.reshape(ctx.input("XShape").shape[1:]))


@register("transpose2", defaults={"axis": ()}, grad="transpose2_grad")
def transpose2(ctx: OpContext) -> None:
    x = ctx.input("X")
    axis = tuple(int(a) for a in ctx.attr("axis"))
    if sorted(axis) != list(range(x.ndim)):
        raise KernelError(f"transpose2: axis {list(axis)} is not a permutation of {x.ndim} dims")
    ctx.set_output("Out", x.transpose(axis))
    ctx.set_output("XShape", _xshape(x))


@register("transpose2_grad", defaults={"axis": ()})
def transpose2_grad(ctx: OpContext) -> None:
    dout = ctx.input("Out@GRAD")
    axis = tuple(int(a) for a in ctx.attr("axis"))
    ctx.set_output("X@GRAD", dout.transpose(np.argsort(axis)))


# ------------------------------------------------------- comparisons and logic

COMPARE: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "less_than": np.less,
    "less_equal": np.less_equal,
    "greater_than": np.greater,
    "greater_equal": np.greater_equal,
    "equal": np.equal,
    "not_equal": np.not_equal,
}


def _compare(ctx: OpContext) -> None:
    x, y = operands(ctx.input("X"), ctx.input("Y"), int(ctx.attr("axis")))
    ctx.set_output("Out", np.asarray(COMPARE[ctx.type](x, y)), lod=ctx.lod("X"))


for _name in COMPARE:
    register(_name)(_compare)

LOGICAL: dict[str, Callable[..., np.ndarray]] = {
    "logical_and": np.logical_and,
    "logical_or": np.logical_or,
    "logical_xor": np.logical_xor,
}


def _logical(ctx: OpContext) -> None:
    x, y = operands(ctx.input("X"), ctx.input("Y"), -1)
    ctx.set_output("Out", np.asarray(LOGICAL[ctx.type](x, y)), lod=ctx.lod("X"))


for _name in LOGICAL:
    register(_name)(_logical)


@register("logical_not")
def logical_not(ctx: OpContext) -> None:
    ctx.set_output("Out", np.logical_not(ctx.input("X")), lod=ctx.lod("X"))


# --------------------------------------------------------------- ref_by_trainer_id


@register("ref_by_trainer_id")
def ref_by_trainer_id(ctx: OpContext) -> None:
    """`Out = X[TrainerId]`: the DC-ASGD pserver picks the param backup of the trainer
    whose grad it is applying (ref_by_trainer_id_op.h)."""
    trainer_id = ctx.scalar("TrainerId")
    if not np.issubdtype(np.asarray(trainer_id).dtype, np.integer):
        raise KernelError(f"ref_by_trainer_id: TrainerId must be an integer tensor, got {np.asarray(trainer_id).dtype}")
    count = len(ctx.input_names("X"))
    if not 0 <= int(trainer_id) < count:
        raise KernelError(f"ref_by_trainer_id: TrainerId {int(trainer_id)} is out of range for {count} X inputs")
    ctx.set_output("Out", ctx.input("X", int(trainer_id)))
