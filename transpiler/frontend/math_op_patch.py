"""Operator overloading on `Variable`, built as Fluid 1.8's `monkey_patch_variable` builds it.

A Python number on either side of `+ - * /` becomes one `scale` op (Fluid 1.6+), so
`global_step / 2100` is `scale(scale=1/2100)`; a number on the left of `**` or `/`
becomes a `fill_constant` then `elementwise_pow` / `elementwise_div`; two Variables
give the `elementwise_*` or compare op. Temporaries are named `tmp_<n>`, as in Fluid.
"""

from __future__ import annotations

from typing import Any

from transpiler.frontend import unique_name
from transpiler.frontend.errors import BuildError
from transpiler.frontend.framework import Variable, append_op, create_var, fmt_shape
from transpiler.ir import DType

_INT_DTYPES = frozenset({DType.INT8, DType.INT16, DType.INT32, DType.INT64, DType.UINT8})
_COMPARE_OPS = frozenset({"less_than", "less_equal", "greater_than", "greater_equal", "equal", "not_equal"})


def _tmp(var: Variable, dtype: DType) -> Variable:
    return create_var(var.program.current_block(), unique_name.generate("tmp"), dtype=dtype, layer="tmp")


def scalar_op(var: Variable, scale: float, bias: float) -> Variable:
    out = _tmp(var, var.dtype)
    append_op(var.program.current_block(), "scale", {"X": [var]}, {"Out": [out]},
              {"scale": float(scale), "bias": float(bias)}, layer="scale")
    return out


def _scalar_add(var, value):
    return scalar_op(var, 1.0, value)


def _scalar_sub(var, value):
    return scalar_op(var, 1.0, -value)


def _scalar_rsub(var, value):
    return scalar_op(var, -1.0, value)


def _scalar_mul(var, value):
    return scalar_op(var, value, 0.0)


def _scalar_div(var, value):
    if value == 0:
        raise BuildError("scale", f"division of {var.name!r} by zero")
    return scalar_op(var, 1.0 / value, 0.0)


# method -> (op type, reverse, scalar method)
_METHODS = {
    "__add__": ("elementwise_add", False, _scalar_add),
    "__radd__": ("elementwise_add", False, _scalar_add),
    "__sub__": ("elementwise_sub", False, _scalar_sub),
    "__rsub__": ("elementwise_sub", True, _scalar_rsub),
    "__mul__": ("elementwise_mul", False, _scalar_mul),
    "__rmul__": ("elementwise_mul", False, _scalar_mul),
    "__truediv__": ("elementwise_div", False, _scalar_div),
    "__rtruediv__": ("elementwise_div", True, None),
    "__pow__": ("elementwise_pow", False, None),
    "__rpow__": ("elementwise_pow", True, None),
    "__lt__": ("less_than", False, None),
    "__le__": ("less_equal", False, None),
    "__gt__": ("greater_than", False, None),
    "__ge__": ("greater_equal", False, None),
}


def _constant(like: Variable, value: float, dtype: DType, shape: tuple[int, ...]) -> Variable:
    """Fluid's `create_tensor`: a `tmp_<n>` filled by `fill_constant` (no input slots)."""
    out = _tmp(like, dtype)
    append_op(like.program.current_block(), "fill_constant", None, {"Out": [out]},
              {"dtype": int(dtype), "shape": list(shape), "value": float(value)}, layer="fill_constant")
    out.stop_gradient = True
    return out


def binary(var: Variable, method: str, other: Any) -> Variable:
    op_type, reverse, scalar_method = _METHODS[method]
    is_number = isinstance(other, (int, float)) and not isinstance(other, bool)
    if scalar_method is not None and is_number and not (op_type == "elementwise_div" and var.dtype in _INT_DTYPES):
        if isinstance(other, float) and var.dtype in _INT_DTYPES and other != int(other):
            raise BuildError(op_type, f"{other} cannot be applied to the integer var {var.name!r}")
        return scalar_method(var, float(other))
    if not isinstance(other, Variable):
        if not is_number:
            raise BuildError(op_type, f"cannot combine {var.name!r} with a {type(other).__name__}")
        if reverse:
            if any(d < 0 for d in var.shape):
                raise BuildError(
                    op_type,
                    f"a number on the left of {var.name!r} {fmt_shape(var.shape)} needs a batch-sized constant; "
                    "build it with layers.fill_constant and combine two Variables",
                )
            other = _constant(var, other, var.dtype, var.shape)
        else:
            other = _constant(var, other, var.dtype, (1,))
    if other.dtype != var.dtype:
        other = other.astype(var.dtype)
    x, y = (other, var) if reverse else (var, other)
    out = _tmp(x, DType.BOOL if op_type in _COMPARE_OPS else var.dtype)
    axis = 0 if y.shape and y.shape[0] == -1 else -1
    if len(x.shape) < len(y.shape):
        raise BuildError(op_type, f"X {x.name!r} {fmt_shape(x.shape)} has fewer dims than Y {y.name!r} {fmt_shape(y.shape)}")
    append_op(x.program.current_block(), op_type, {"X": [x], "Y": [y]}, {"Out": [out]}, {"axis": axis}, layer=op_type)
    return out
