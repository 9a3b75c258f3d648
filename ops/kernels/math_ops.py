"""Math kernels: elementwise binary ops, activations, `mul`, reductions, `scale`, `sum`,
`clip`, with their grads (Paddle 1.8 / 2.6 slots and attrs).

Kernels keep their inputs' dtype (float32 in training, float64 in the gradient check)
and never write into an input array.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ops import catalogue
from ops.kernels.broadcast import operands, reduce_to
from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register
from ops.tensor import LoDTensor, SelectedRows, scatter_add_rows
from transpiler.ir.types import DType

# ------------------------------------------------------------------ elementwise


def _int_div(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Integer division truncating toward zero, as C++ does."""
    return np.trunc(np.true_divide(x, y)).astype(np.result_type(x, y))


def _div(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if np.issubdtype(x.dtype, np.integer) and np.issubdtype(y.dtype, np.integer):
        return _int_div(x, y)
    return np.true_divide(x, y)


ELEMENTWISE_FORWARD: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "elementwise_add": np.add,
    "elementwise_sub": np.subtract,
    "elementwise_mul": np.multiply,
    "elementwise_div": _div,
    "elementwise_max": np.maximum,
    "elementwise_min": np.minimum,
    "elementwise_pow": np.power,
    "elementwise_mod": np.mod,
    "elementwise_floordiv": np.floor_divide,
}
DIFFERENTIABLE_ELEMENTWISE = (
    "elementwise_add",
    "elementwise_sub",
    "elementwise_mul",
    "elementwise_div",
    "elementwise_max",
    "elementwise_min",
    "elementwise_pow",
)


def _elementwise(ctx: OpContext) -> None:
    x, y = ctx.input("X"), ctx.input("Y")
    xb, yb = operands(x, y, int(ctx.attr("axis")))
    out = ELEMENTWISE_FORWARD[ctx.type](xb, yb)
    ctx.set_output("Out", np.asarray(out), lod=ctx.lod("X") if x.ndim >= y.ndim else ctx.lod("Y"))


for _name in DIFFERENTIABLE_ELEMENTWISE:
    register(_name)(_elementwise)
for _name in ("elementwise_mod", "elementwise_floordiv"):  # not in the catalogue: the attrs of the others
    register(_name, defaults=catalogue.require("elementwise_add").attr_defaults())(_elementwise)


def _elementwise_grad(ctx: OpContext) -> None:
    """dX and dY of `Out = f(X, Y)` with broadcasting undone by summation."""
    op = ctx.type[: -len("_grad")]
    axis = int(ctx.attr("axis"))
    dout = ctx.input("Out@GRAD")
    y = ctx.input("Y")
    x = ctx.optional_input("X")  # Paddle 1.8's elementwise_div_grad has no X
    out = ctx.optional_input("Out")
    if x is None:
        if op != "elementwise_div" or out is None:
            raise KernelError(f"{ctx.type} needs input X (or, for elementwise_div, Out)")
        x_shape = dout.shape  # X is the larger operand, shaped like Out
        xb, yb = None, operands(dout, y, axis)[1]
    else:
        x_shape = x.shape
        xb, yb = operands(x, y, axis)

    if op == "elementwise_add":
        dx, dy = dout, dout
    elif op == "elementwise_sub":
        dx, dy = dout, -dout
    elif op == "elementwise_mul":
        dx, dy = dout * yb, dout * xb
    elif op == "elementwise_div":
        quotient = out if out is not None else xb / yb
        dx, dy = dout / yb, -dout * quotient / yb
    elif op == "elementwise_max":
        dx, dy = dout * (xb > yb), dout * (xb <= yb)
    elif op == "elementwise_min":
        dx, dy = dout * (xb < yb), dout * (xb >= yb)
    elif op == "elementwise_pow":
        dx = dout * yb * np.power(xb, yb - 1)
        dy = dout * np.log(xb) * np.power(xb, yb)
    else:  # pragma: no cover - registration keeps this in step with the table
        raise KernelError(f"no grad rule for {op}")
    if ctx.has_output("X@GRAD"):
        ctx.set_output("X@GRAD", reduce_to(np.asarray(dx, dtype=dout.dtype), x_shape, axis, y.shape), lod=ctx.lod("X"))
    if ctx.has_output("Y@GRAD"):
        ctx.set_output("Y@GRAD", reduce_to(np.asarray(dy, dtype=dout.dtype), y.shape, axis, x_shape), lod=ctx.lod("Y"))


for _name in DIFFERENTIABLE_ELEMENTWISE:
    register(f"{_name}_grad")(_elementwise_grad)


# ------------------------------------------------------------------ activations


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """Paddle's `1 / (1 + exp(-x))`; exp overflowing to inf for very negative x gives 0."""
    with np.errstate(over="ignore"):
        return 1 / (1 + np.exp(-x))


# name → (forward, grad, which forward var the grad op reads: "X" or "Out").
# The grad slots are Paddle's: relu/tanh/sigmoid/exp/sqrt read Out, square/log/abs read X.
ACTIVATIONS: dict[str, tuple[Callable, Callable, str]] = {
    "relu": (lambda x: np.maximum(x, 0).astype(x.dtype, copy=False), lambda out, d: d * (out > 0), "Out"),
    "tanh": (np.tanh, lambda out, d: d * (1 - out * out), "Out"),
    "sigmoid": (_sigmoid, lambda out, d: d * out * (1 - out), "Out"),
    "exp": (np.exp, lambda out, d: d * out, "Out"),
    "sqrt": (np.sqrt, lambda out, d: d * 0.5 / out, "Out"),
    "square": (np.square, lambda x, d: d * 2 * x, "X"),
    "log": (np.log, lambda x, d: d / x, "X"),
    "abs": (np.abs, lambda x, d: d * np.sign(x), "X"),
}


def _activation(ctx: OpContext) -> None:
    forward = ACTIVATIONS[ctx.type][0]
    x = ctx.input("X")
    ctx.set_output("Out", np.asarray(forward(x), dtype=x.dtype), lod=ctx.lod("X"))


def _activation_grad(ctx: OpContext) -> None:
    _, grad, dep = ACTIVATIONS[ctx.type[: -len("_grad")]]
    other = "X" if dep == "Out" else "Out"
    source = dep if ctx.has_input(dep) else other
    if source != dep and dep == "X":
        raise KernelError(f"{ctx.type} needs input X")
    dout = ctx.input("Out@GRAD")
    ref = ctx.input(source)
    if source != dep:  # Out missing: recompute it from X
        ref = ACTIVATIONS[ctx.type[: -len("_grad")]][0](ref)
    ctx.set_output("X@GRAD", np.asarray(grad(ref, dout), dtype=dout.dtype), lod=ctx.lod("Out@GRAD"))


for _name in ACTIVATIONS:
    # The catalogue names the grad op of the ones it holds; sqrt, log and abs are not in it.
    register(_name, grad=None if catalogue.get(_name) else f"{_name}_grad")(_activation)
    register(f"{_name}_grad")(_activation_grad)


@register("floor")
def floor(ctx: OpContext) -> None:
    x = ctx.input("X")
    ctx.set_output("Out", np.floor(x), lod=ctx.lod("X"))


@register("floor_grad")
def floor_grad(ctx: OpContext) -> None:
    """Zero almost everywhere (Paddle's floor_grad reads only Out@GRAD)."""
    dout = ctx.input("Out@GRAD")
    ctx.set_output("X@GRAD", np.zeros_like(dout), lod=ctx.lod("Out@GRAD"))


# -------------------------------------------------------------------------- mul


def _flatten(a: np.ndarray, num_col_dims: int) -> np.ndarray:
    return a.reshape(math.prod(a.shape[:num_col_dims]), math.prod(a.shape[num_col_dims:]))




BLAS_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _matmul(ctx: OpContext, slot: str, a: np.ndarray, b: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`a @ b` (2-D) shaped `shape`, computed into the slot's `output_buffer` when both
    operands are one BLAS dtype (numpy's matmul writes the same bits with or without
    `out=`); mixed dtypes keep numpy's promotion and a new array."""
    if a.dtype != b.dtype or a.dtype not in BLAS_DTYPES:
        return (a @ b).reshape(shape)
    out = ctx.output_buffer(slot, shape, a.dtype)
    np.matmul(a, b, out=out.reshape(a.shape[0], b.shape[1]))
    return out


@register("mul")
def mul(ctx: OpContext) -> None:
    """`Out = flatten(X, x_num_col_dims) @ flatten(Y, y_num_col_dims)`."""
    x, y = ctx.input("X"), ctx.input("Y")
    xn, yn = int(ctx.attr("x_num_col_dims")), int(ctx.attr("y_num_col_dims"))
    out = _matmul(ctx, "Out", _flatten(x, xn), _flatten(y, yn), x.shape[:xn] + y.shape[yn:])
    ctx.set_output("Out", out, lod=ctx.lod("X"))


@register("mul_grad")
def mul_grad(ctx: OpContext) -> None:
    """Without X@GRAD, Y's values are not needed, only its shape: then a Y the program
    declares with a fully known shape is not read (the executor may have released it,
    `ops.executor.Liveness.released`)."""
    x, dout = ctx.input("X"), ctx.input("Out@GRAD")
    xn, yn = int(ctx.attr("x_num_col_dims")), int(ctx.attr("y_num_col_dims"))
    want_dx = ctx.has_output("X@GRAD")
    y = ctx.input("Y") if want_dx else None
    y_shape = y.shape if y is not None else _declared_shape(ctx, "Y")
    x2 = _flatten(x, xn)
    y_rows, y_cols = math.prod(y_shape[:yn]), math.prod(y_shape[yn:])
    d2 = dout.reshape(x2.shape[0], y_cols)
    if want_dx:
        ctx.set_output("X@GRAD", _matmul(ctx, "X@GRAD", d2, _flatten(y, yn).T, x.shape), lod=ctx.lod("X"))
    if ctx.has_output("Y@GRAD"):
        if x2.shape[1] != y_rows:
            raise KernelError(f"mul_grad: X flattens to {list(x2.shape)}, Y {[y_rows, y_cols]}: they do not multiply")
        ctx.set_output("Y@GRAD", _matmul(ctx, "Y@GRAD", x2.T, d2, y_shape))


def _declared_shape(ctx: OpContext, slot: str) -> tuple[int, ...]:
    """The shape of the slot's value; when the scope holds none (a released param), the
    var's declared shape if fully known (else the usual missing-input error)."""
    if ctx.optional_value(slot) is None and ctx.has_input(slot):
        var = ctx.decl(ctx.input_names(slot)[0])
        if var is not None and var.shape is not None and all(d >= 0 for d in var.shape):
            return tuple(var.shape)
    return ctx.input(slot).shape


# ------------------------------------------------------------------- reductions


def _scalar_shape(ctx: OpContext, slot: str) -> tuple[int, ...]:
    """A full reduction's shape: `[]` when the program declares a 0-d var (Paddle 2.x),
    else `[1]` (Paddle 1.8)."""
    return () if ctx.declared_shape(slot) == () else (1,)


@register("mean")
def mean(ctx: OpContext) -> None:
    x = ctx.input("X")
    ctx.set_output("Out", np.asarray(x.mean(dtype=x.dtype), dtype=x.dtype).reshape(_scalar_shape(ctx, "Out")))


@register("mean_grad")
def mean_grad(ctx: OpContext) -> None:
    x, dout = ctx.input("X"), ctx.input("Out@GRAD")
    value = dout.reshape(-1)[0] / x.size
    ctx.set_output("X@GRAD", np.full(x.shape, value, dtype=dout.dtype), lod=ctx.lod("X"))


def _reduce_axes(ctx: OpContext, ndim: int) -> tuple[int, ...]:
    dims = tuple(int(d) for d in ctx.attr("dim"))
    if ctx.attr("reduce_all") or not dims or ndim == 0:
        return tuple(range(ndim))
    axes = tuple(sorted({d + ndim if d < 0 else d for d in dims}))
    if any(not 0 <= a < ndim for a in axes):
        raise KernelError(f"{ctx.type}: dim {list(dims)} out of range for a rank-{ndim} input")
    return axes


REDUCERS = {"reduce_sum": np.sum, "reduce_mean": np.mean, "reduce_max": np.max, "reduce_min": np.min}


def _reduce(ctx: OpContext) -> None:
    x = ctx.input("X")
    axes = _reduce_axes(ctx, x.ndim)
    keep = bool(ctx.attr("keep_dim"))
    out = np.asarray(REDUCERS[ctx.type](x, axis=axes, keepdims=keep))
    if ctx.attr("out_dtype") not in (-1, None):
        out = out.astype(DType(int(ctx.attr("out_dtype"))).to_numpy())
    elif out.dtype != x.dtype and np.issubdtype(x.dtype, np.floating):
        out = out.astype(x.dtype)
    if len(axes) == x.ndim and not keep:
        out = out.reshape(_scalar_shape(ctx, "Out"))
    ctx.set_output("Out", out)


register("reduce_sum")(_reduce)
register("reduce_mean")(_reduce)
for _name in ("reduce_max", "reduce_min"):  # not in the catalogue: the attrs of the others
    register(_name, defaults=catalogue.require("reduce_sum").attr_defaults())(_reduce)


def _reduce_grad(ctx: OpContext) -> None:
    x, dout = ctx.input("X"), ctx.input("Out@GRAD")
    axes = _reduce_axes(ctx, x.ndim)
    kept = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    grad = np.broadcast_to(dout.reshape(kept), x.shape)
    if ctx.type == "reduce_mean_grad":
        count = math.prod(x.shape[a] for a in axes) or 1
        grad = grad / np.asarray(count, dtype=dout.dtype)
    ctx.set_output("X@GRAD", np.ascontiguousarray(grad, dtype=dout.dtype), lod=ctx.lod("X"))


register("reduce_sum_grad")(_reduce_grad)
register("reduce_mean_grad")(_reduce_grad)


# ------------------------------------------------------------------- scale, sum


@register("scale")
def scale(ctx: OpContext) -> None:
    """`Out = scale * X + bias` (or `scale * (X + bias)`); a SelectedRows input keeps its
    rows. Paddle's grad of `scale` is `scale` with the same factor and no bias."""
    factor = float(ctx.scalar("ScaleTensor")) if ctx.has_input("ScaleTensor") else float(ctx.attr("scale"))
    bias = float(ctx.attr("bias"))
    after = bool(ctx.attr("bias_after_scale"))
    # Out is X (a pserver scales its summed grad): into X's own array when no reader can
    # tell (`may_update_in_place`, asked before this kernel binds X), the same bits.
    in_place = ctx.may_update_in_place("X", "Out")
    value = ctx.value("X")
    if isinstance(value, SelectedRows):
        scaled = _affine(value.active_value(), factor, bias, after)
        ctx.set_output("Out", SelectedRows(value.rows, scaled, value.height))
        return
    x = ctx.input("X")
    ctx.set_output("Out", _affine(x, factor, bias, after, in_place), lod=ctx.lod("X"))


def _affine(x: np.ndarray, factor: float, bias: float, after: bool, in_place: bool = False) -> np.ndarray:
    if np.issubdtype(x.dtype, np.integer):  # Paddle casts the factors to T
        f, b = x.dtype.type(factor), x.dtype.type(bias)
    else:
        f, b = factor, bias
    # One new array (or x itself, when the caller may write it and both operations keep its
    # dtype), the second operation in place (a pserver scales every grad of every step).
    # (`asarray`: a 0-d x gives a numpy scalar, which cannot be an `out=`.)
    if in_place and x.ndim and np.result_type(x.dtype, f) == x.dtype and np.result_type(x.dtype, b) == x.dtype:
        first, second = (np.multiply, np.add) if after else (np.add, np.multiply)
        first(x, f if after else b, out=x)
        second(x, b if after else f, out=x, casting="unsafe")
        return x
    if after:
        out = np.asarray(np.multiply(x, f))
        np.add(out, b, out=out, casting="unsafe")
    else:
        out = np.asarray(np.add(x, b))
        np.multiply(out, f, out=out, casting="unsafe")
    return np.asarray(out, dtype=x.dtype)


@register("sum")
def sum_(ctx: OpContext) -> None:
    """Sum of dense tensors and/or SelectedRows. All-SelectedRows inputs give a
    SelectedRows with duplicate rows merged (rows sorted, Paddle's MergeAdd); otherwise a
    dense tensor with the sparse inputs scattered in."""
    values = ctx.values("X")
    if not values:
        raise KernelError("sum needs at least one input")
    if all(isinstance(v, list) for v in values):  # tensor arrays (ops/kernels/control.py)
        from ops.kernels.control import sum_arrays

        ctx.set_output("Out", sum_arrays(values))
        return
    if all(isinstance(v, SelectedRows) for v in values):
        rows = np.concatenate([v.rows for v in values])
        value = np.concatenate([v.active_value() for v in values])
        ctx.set_output("Out", SelectedRows(rows, value, values[0].height).merged())
        return
    reuse = None
    if len(values) > 1 and all(type(v) is LoDTensor for v in values):
        # A pserver sums every grad of every step here: into the first grad's own array when
        # it dies here (`reusable_input`: X[0] + X[1] into X[0] is the same bits as into a
        # new array). The check counts holders, so this kernel lets go of its own first.
        shape, dtype = values[0].array.shape, values[0].array.dtype
        same = all(v.array.shape == shape and v.array.dtype == dtype for v in values)
        del values
        reuse = ctx.reusable_input("X", shape, dtype) if same else None
        values = ctx.values("X")
    dense = [v for v in values if not isinstance(v, SelectedRows)]
    first = dense[0]
    arrays = [v.array if isinstance(v, LoDTensor) else np.asarray(v) for v in dense]
    if (reuse is None and len(arrays) > 1
            and all(a.shape == arrays[0].shape and a.dtype == arrays[0].dtype for a in arrays)):
        # Else into the array Out holds from the last step, when no reader can tell (a sync
        # pserver's summed grad, `current_output`): no new grad-sized array per step.
        reuse = ctx.current_output("Out", arrays[0].shape, arrays[0].dtype)
        if reuse is not None and any(np.may_share_memory(reuse, a) for a in arrays):
            reuse = None
    if reuse is not None:
        out = np.add(arrays[0], arrays[1], out=reuse)
    else:
        out = arrays[0] + arrays[1] if len(arrays) > 1 else arrays[0].copy()
    for array in arrays[2:]:
        np.add(out, array, out=out)
    for v in values:
        if isinstance(v, SelectedRows):
            scatter_add_rows(out, v.rows, v.active_value().astype(out.dtype, copy=False))
    ctx.set_output("Out", out, lod=first.lod if isinstance(first, LoDTensor) else None)


# ------------------------------------------------------------------------- clip

def _clip_bounds(ctx: OpContext) -> tuple[float, float]:
    low = float(ctx.scalar("Min")) if ctx.has_input("Min") else float(ctx.attr("min"))
    high = float(ctx.scalar("Max")) if ctx.has_input("Max") else float(ctx.attr("max"))
    if low > high:
        raise KernelError(f"clip: min ({low}) must not exceed max ({high})")
    return low, high


@register("clip")
def clip(ctx: OpContext) -> None:
    x = ctx.input("X")
    low, high = _clip_bounds(ctx)
    ctx.set_output("Out", np.clip(x, low, high).astype(x.dtype, copy=False), lod=ctx.lod("X"))


@register("clip_by_norm")
def clip_by_norm(ctx: OpContext) -> None:
    """Paddle's: the L2 norm of the whole tensor, scaled down to `max_norm` when above it.
    With `SquaredNorm` (a pserver's block of a grad), the norm is that of the whole grad."""
    x = ctx.input("X")
    max_norm = float(ctx.attr("max_norm"))
    if ctx.has_input("SquaredNorm"):
        norm = float(np.sqrt(float(np.asarray(ctx.input("SquaredNorm")).reshape(-1)[0])))
    else:
        norm = float(np.sqrt(np.sum(np.square(x, dtype=np.float64))))
    out = x * x.dtype.type(max_norm / norm) if norm > max_norm else x
    ctx.set_output("Out", out.astype(x.dtype, copy=False), lod=ctx.lod("X"))


@register("clip_grad")
def clip_grad(ctx: OpContext) -> None:
    x, dout = ctx.input("X"), ctx.input("Out@GRAD")
    low, high = _clip_bounds(ctx)
    ctx.set_output("X@GRAD", dout * ((x > low) & (x < high)), lod=ctx.lod("X"))
