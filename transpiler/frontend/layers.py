"""`fluid.layers`: the layers of Fluid 1.x, building the same ops with the same names.

    x = layers.data(name="x", shape=[1000], dtype="float32")
    y = layers.fc(input=x, size=10, act="relu")        # mul + elementwise_add + relu
    loss = layers.mean(layers.square_error_cost(y, label))

Each layer appends to the current block of `default_main_program()`; parameters go to
both programs, their initializers to `default_startup_program()`. Misuse raises
`BuildError` naming the layer (`fc_0: ...`) and the shapes involved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from transpiler.frontend.control_flow import (
    ConditionalBlock,
    Switch,
    equal,
    greater_equal,
    greater_than,
    less_equal,
    less_than,
    logical_and,
    logical_not,
    logical_or,
    logical_xor,
    not_equal,
)
from transpiler.frontend import unique_name
from transpiler.frontend.framework import Variable, append_op, fmt_shape, to_dtype
from transpiler.frontend.initializer import Constant
from transpiler.frontend.layer_helper import LayerHelper
from transpiler.frontend.learning_rate_scheduler import (
    exponential_decay,
    inverse_time_decay,
    natural_exp_decay,
    piecewise_decay,
)
from transpiler.ir import DType, VarKind

# ----------------------------------------------------------------- inputs


def data(
    name: str,
    shape: Sequence[int],
    append_batch_size: bool = True,
    dtype: Any = "float32",
    lod_level: int = 0,
    type: VarKind = VarKind.LOD_TENSOR,
    stop_gradient: bool = True,
) -> Variable:
    """`fluid.layers.data`: a feed var; `[-1]` is prepended unless a dim is already None/-1.
    Fluid 1.8 did not mark these `need_check_feed` (use `frontend.data` for that)."""
    helper = LayerHelper("data", name=name)
    if not isinstance(name, str) or not name:
        raise helper.error(f"a data layer needs a name, got {name!r}")
    dims = []
    for dim in shape:
        if dim is None or dim < 0:
            append_batch_size = False
            dims.append(-1)
        else:
            dims.append(int(dim))
    if append_batch_size:
        dims = [-1, *dims]
    return helper.create_global_variable(
        name=name, shape=dims, dtype=dtype, kind=type, stop_gradient=stop_gradient, lod_level=lod_level, is_data=True
    )


def fluid_data(name: str, shape: Sequence[int], dtype: Any = "float32", lod_level: int = 0) -> Variable:
    """`fluid.data` (1.6+): the shape as given (None → -1), and `need_check_feed` set."""
    helper = LayerHelper("data", name=name)
    dims = [-1 if d is None else int(d) for d in shape]
    return helper.create_global_variable(
        name=name, shape=dims, dtype=dtype, stop_gradient=True, lod_level=lod_level, is_data=True, need_check_feed=True
    )


# ----------------------------------------------------------------- nn


def fc(
    input: Variable | Sequence[Variable],
    size: int,
    num_flatten_dims: int = 1,
    param_attr: Any = None,
    bias_attr: Any = None,
    act: str | None = None,
    name: str | None = None,
) -> Variable:
    """`mul` (one per input, `sum`med when several) + `elementwise_add` bias + activation."""
    helper = LayerHelper("fc", input=input, size=size, param_attr=param_attr, bias_attr=bias_attr, act=act, name=name)
    inputs = helper.multiple_input()
    dtype = helper.input_dtype()
    for var in inputs:
        helper.check_float(var)
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise helper.error(f"size must be a positive int, got {size!r}")
    results = []
    for var, attr in zip(inputs, helper.multiple_param_attr(len(inputs)), strict=True):
        shape = var.shape
        flatten = len(shape) - 1 if num_flatten_dims == -1 else num_flatten_dims
        if not 0 < flatten < len(shape):
            raise helper.error(f"num_flatten_dims={num_flatten_dims} does not fit input {var.name!r} {fmt_shape(shape)}")
        in_features = shape[flatten:]
        if any(d <= 0 for d in in_features):
            raise helper.error(
                f"input {var.name!r} {fmt_shape(shape)} has unknown feature dims {fmt_shape(in_features)}; "
                "fc needs them to shape its weight"
            )
        weight = helper.create_parameter(attr, [math.prod(in_features), size], dtype)
        out = helper.create_variable_for_type_inference(dtype)
        helper.append_op("mul", {"X": var, "Y": weight}, {"Out": out}, {"x_num_col_dims": flatten, "y_num_col_dims": 1})
        results.append(out)
    if len(results) == 1:
        pre_bias = results[0]
    else:
        pre_bias = helper.create_variable_for_type_inference(dtype)
        helper.append_op("sum", {"X": results}, {"Out": pre_bias}, {"use_mkldnn": False})
    flatten = len(inputs[0].shape) - 1 if num_flatten_dims == -1 else num_flatten_dims
    return helper.append_activation(helper.append_bias_op(pre_bias, dim_start=flatten))


def embedding(
    input: Variable,
    size: Sequence[int],
    is_sparse: bool = False,
    is_distributed: bool = False,
    padding_idx: int | None = None,
    param_attr: Any = None,
    dtype: Any = "float32",
) -> Variable:
    """`lookup_table` on an int64 `[N, 1]` id var; the table is `[size[0], size[1]]`.
    `remote_prefetch` is `is_sparse and not is_distributed`, as in Fluid 1.8."""
    helper = LayerHelper("embedding", input=input, size=size, param_attr=param_attr)
    helper.check_variable(input, "input")
    if input.dtype != DType.INT64:
        raise helper.error(f"ids {input.name!r} are {input.dtype.short} {fmt_shape(input.shape)}; embedding needs int64 ids")
    if len(size) != 2:
        raise helper.error(f"size must be [rows, width], got {list(size)}")
    weight = helper.create_parameter(helper.param_attr, list(size), dtype)
    out = helper.create_variable_for_type_inference(dtype)
    if padding_idx is None:
        padding = -1
    else:
        padding = padding_idx if padding_idx >= 0 else size[0] + padding_idx
        if not 0 <= padding < size[0]:
            raise helper.error(f"padding_idx {padding_idx} is outside the table's {size[0]} rows")
    helper.append_op(
        "lookup_table",
        {"Ids": input, "W": weight},
        {"Out": out},
        {
            "is_sparse": bool(is_sparse),
            "is_distributed": bool(is_distributed),
            "remote_prefetch": bool(is_sparse and not is_distributed),
            "padding_idx": padding,
        },
    )
    return out


def _activation(op_type: str, x: Variable, name: str | None, attrs: dict | None = None) -> Variable:
    helper = LayerHelper(op_type, x=x, name=name)
    helper.check_variable(x, "x")
    helper.check_float(x, "x")
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op(op_type, {"X": [x]}, {"Out": [out]}, attrs or {})
    return out


def relu(x: Variable, name: str | None = None) -> Variable:
    return _activation("relu", x, name)


def tanh(x: Variable, name: str | None = None) -> Variable:
    return _activation("tanh", x, name)


def sigmoid(x: Variable, name: str | None = None) -> Variable:
    return _activation("sigmoid", x, name)


def exp(x: Variable, name: str | None = None) -> Variable:
    return _activation("exp", x, name)


def square(x: Variable, name: str | None = None) -> Variable:
    return _activation("square", x, name)


def sqrt(x: Variable, name: str | None = None) -> Variable:
    return _activation("sqrt", x, name)


def floor(x: Variable, name: str | None = None) -> Variable:
    return _activation("floor", x, name)


def softmax(input: Variable, use_cudnn: bool = False, name: str | None = None, axis: int = -1) -> Variable:
    return _activation("softmax", input, name, {"axis": axis, "use_cudnn": use_cudnn})


def mul(x: Variable, y: Variable, x_num_col_dims: int = 1, y_num_col_dims: int = 1, name: str | None = None) -> Variable:
    helper = LayerHelper("mul", x=x, y=y, name=name)
    helper.check_variable(x, "x")
    helper.check_variable(y, "y")
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op("mul", {"X": x, "Y": y}, {"Out": out}, {"x_num_col_dims": x_num_col_dims, "y_num_col_dims": y_num_col_dims})
    return out


# ----------------------------------------------------------------- losses


def softmax_with_cross_entropy(
    logits: Variable,
    label: Variable,
    soft_label: bool = False,
    ignore_index: int = -100,
    numeric_stable_mode: bool = True,
    return_softmax: bool = False,
    axis: int = -1,
) -> Variable | tuple[Variable, Variable]:
    helper = LayerHelper("softmax_with_cross_entropy", logits=logits, label=label)
    helper.check_variable(logits, "logits")
    helper.check_variable(label, "label")
    helper.check_float(logits, "logits")
    softmax_out = helper.create_variable_for_type_inference(logits.dtype)
    loss = helper.create_variable_for_type_inference(logits.dtype)
    helper.append_op(
        "softmax_with_cross_entropy",
        {"Logits": logits, "Label": label},
        {"Softmax": softmax_out, "Loss": loss},
        {"soft_label": soft_label, "ignore_index": ignore_index, "numeric_stable_mode": numeric_stable_mode, "axis": axis},
    )
    return (loss, softmax_out) if return_softmax else loss


def cross_entropy(input: Variable, label: Variable, soft_label: bool = False, ignore_index: int = -100) -> Variable:
    """Hard labels build `cross_entropy2` (as Fluid 1.4+ does); soft labels `cross_entropy`."""
    if not soft_label:
        return cross_entropy2(input, label, ignore_index)
    helper = LayerHelper("cross_entropy", input=input, label=label)
    helper.check_float(helper.check_variable(input, "input"))
    out = helper.create_variable_for_type_inference(input.dtype)
    helper.append_op(
        "cross_entropy", {"X": [input], "Label": [label]}, {"Y": [out]}, {"soft_label": soft_label, "ignore_index": ignore_index}
    )
    return out


def cross_entropy2(input: Variable, label: Variable, ignore_index: int = -100) -> Variable:
    helper = LayerHelper("cross_entropy2", input=input, label=label)
    helper.check_float(helper.check_variable(input, "input"))
    helper.check_variable(label, "label")
    out = helper.create_variable_for_type_inference(input.dtype)
    xshape = helper.create_variable_for_type_inference(input.dtype)
    match_x = helper.create_variable_for_type_inference(input.dtype)
    helper.append_op(
        "cross_entropy2",
        {"X": [input], "Label": [label]},
        {"Y": [out], "MatchX": [match_x], "XShape": [xshape]},
        {"ignore_index": ignore_index},
    )
    return out


def square_error_cost(input: Variable, label: Variable) -> Variable:
    """`(input - label)²`: `elementwise_sub` then `square`."""
    helper = LayerHelper("square_error_cost", input=input, label=label)
    helper.check_float(helper.check_variable(input, "input"))
    helper.check_variable(label, "label")
    minus = helper.create_variable_for_type_inference(input.dtype)
    helper.append_op("elementwise_sub", {"X": [input], "Y": [label]}, {"Out": [minus]})
    out = helper.create_variable_for_type_inference(input.dtype)
    helper.append_op("square", {"X": [minus]}, {"Out": [out]})
    return out


def mean(x: Variable, name: str | None = None) -> Variable:
    """The `mean` op (Paddle 2.x builds `reduce_mean` instead); the result is `[1]`."""
    return _activation_like("mean", x, name)


def _activation_like(op_type: str, x: Variable, name: str | None) -> Variable:
    helper = LayerHelper(op_type, x=x, name=name)
    helper.check_float(helper.check_variable(x, "x"), "x")
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op(op_type, {"X": x}, {"Out": out}, {})
    return out


# ----------------------------------------------------------------- tensor math


def _reduce(op_type: str, input: Variable, dim: int | Sequence[int] | None, keep_dim: bool, name: str | None) -> Variable:
    helper = LayerHelper(op_type, input=input, name=name)
    helper.check_variable(input, "input")
    dims = None if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    attrs = {
        "dim": dims if dims else [0],
        "keep_dim": bool(keep_dim),
        "reduce_all": not dims or len(dims) == len(input.shape),
    }
    out = helper.create_variable_for_type_inference(input.dtype)
    helper.append_op(op_type, {"X": input}, {"Out": out}, attrs)
    return out


def reduce_sum(input: Variable, dim: int | Sequence[int] | None = None, keep_dim: bool = False, name: str | None = None) -> Variable:
    return _reduce("reduce_sum", input, dim, keep_dim, name)


def reduce_mean(input: Variable, dim: int | Sequence[int] | None = None, keep_dim: bool = False, name: str | None = None) -> Variable:
    return _reduce("reduce_mean", input, dim, keep_dim, name)


def sum(x: Variable | Sequence[Variable]) -> Variable:  # noqa: A001 - Fluid's name
    """The `sum` op over a list of same-shaped vars."""
    helper = LayerHelper("sum", input=x)
    inputs = helper.multiple_input()
    out = helper.create_variable_for_type_inference(helper.input_dtype())
    helper.append_op("sum", {"X": inputs}, {"Out": out}, {"use_mkldnn": False})
    return out


def sums(input: Sequence[Variable], out: Variable | None = None) -> Variable:
    helper = LayerHelper("sum", input=input)
    inputs = helper.multiple_input()
    if out is None:
        out = helper.create_variable_for_type_inference(helper.input_dtype())
    helper.append_op("sum", {"X": inputs}, {"Out": out}, {"use_mkldnn": False})
    return out


def concat(input: Sequence[Variable], axis: int = 0, name: str | None = None) -> Variable:
    helper = LayerHelper("concat", input=input, name=name)
    inputs = helper.multiple_input()
    out = helper.create_variable_for_type_inference(helper.input_dtype())
    if isinstance(axis, Variable):
        axis.stop_gradient = True
        helper.append_op("concat", {"X": inputs, "AxisTensor": axis}, {"Out": [out]}, {})
    else:
        helper.append_op("concat", {"X": inputs}, {"Out": [out]}, {"axis": axis})
    return out


def scale(x: Variable, scale: float = 1.0, bias: float = 0.0, bias_after_scale: bool = True, act: str | None = None,
          name: str | None = None) -> Variable:
    helper = LayerHelper("scale", x=x, act=act, name=name)
    helper.check_variable(x, "x")
    inputs: dict[str, Any] = {"X": [x]}
    attrs: dict[str, Any] = {"bias": float(bias), "bias_after_scale": bool(bias_after_scale)}
    if isinstance(scale, Variable):
        inputs["ScaleTensor"] = [scale]
    else:
        attrs["scale"] = float(scale)
    if name is None:
        out = helper.create_variable_for_type_inference(x.dtype)
    else:
        out = helper.create_variable(name=name, dtype=x.dtype, persistable=False)
    helper.append_op("scale", inputs, {"Out": out}, attrs)
    return helper.append_activation(out)


def _elementwise(op_type: str, x: Variable, y: Variable, axis: int, act: str | None, name: str | None) -> Variable:
    helper = LayerHelper(op_type, x=x, y=y, act=act, name=name)
    helper.check_variable(x, "x")
    helper.check_variable(y, "y")
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op(op_type, {"X": x, "Y": y}, {"Out": out}, {"axis": axis, "use_mkldnn": False})
    return helper.append_activation(out)


def elementwise_add(x, y, axis=-1, act=None, name=None):
    return _elementwise("elementwise_add", x, y, axis, act, name)


def elementwise_sub(x, y, axis=-1, act=None, name=None):
    return _elementwise("elementwise_sub", x, y, axis, act, name)


def elementwise_mul(x, y, axis=-1, act=None, name=None):
    return _elementwise("elementwise_mul", x, y, axis, act, name)


def elementwise_div(x, y, axis=-1, act=None, name=None):
    return _elementwise("elementwise_div", x, y, axis, act, name)


def elementwise_pow(x, y, axis=-1, act=None, name=None):
    return _elementwise("elementwise_pow", x, y, axis, act, name)


def elementwise_max(x, y, axis=-1, act=None, name=None):
    return _elementwise("elementwise_max", x, y, axis, act, name)


def elementwise_min(x, y, axis=-1, act=None, name=None):
    return _elementwise("elementwise_min", x, y, axis, act, name)


def clip(x: Variable, min: float, max: float, name: str | None = None) -> Variable:  # noqa: A002 - Fluid's names
    helper = LayerHelper("clip", x=x, name=name)
    helper.check_float(helper.check_variable(x, "x"), "x")
    if min > max:
        raise helper.error(f"min {min} is greater than max {max}")
    out_name = name if name is not None else unique_name.generate_with_ignorable_key(f"{helper.name}.tmp")
    out = helper.create_variable(name=out_name, dtype=x.dtype, kind=x.type, persistable=False)
    helper.append_op("clip", {"X": x}, {"Out": out}, {"min": float(min), "max": float(max)})
    return out


def clip_by_norm(x: Variable, max_norm: float, name: str | None = None) -> Variable:
    """`x * max_norm / ||x||_2` when the L2 norm of `x` exceeds `max_norm`, else `x`."""
    helper = LayerHelper("clip_by_norm", x=x, name=name)
    helper.check_float(helper.check_variable(x, "x"), "x")
    out_name = name if name is not None else unique_name.generate_with_ignorable_key(f"{helper.name}.tmp")
    out = helper.create_variable(name=out_name, dtype=x.dtype, kind=x.type, persistable=False)
    helper.append_op("clip_by_norm", {"X": x}, {"Out": out}, {"max_norm": float(max_norm)})
    return out


def cast(x: Variable, dtype: Any) -> Variable:
    helper = LayerHelper("cast", x=x)
    helper.check_variable(x, "x")
    out = helper.create_variable_for_type_inference(to_dtype(dtype))
    helper.append_op("cast", {"X": [x]}, {"Out": [out]}, {"in_dtype": int(x.dtype), "out_dtype": int(out.dtype)})
    return out


# ----------------------------------------------------------------- sequences


def sequence_pool(input: Variable, pool_type: str, is_test: bool = False, pad_value: float = 0.0) -> Variable:
    """Pool each sequence of a LoD input (`sum`, `average`, `max`, `sqrt`, `first`, `last`)."""
    helper = LayerHelper("sequence_pool", input=input)
    helper.check_float(helper.check_variable(input, "input"))
    kinds = ("AVERAGE", "SUM", "SQRT", "MAX", "LAST", "FIRST")
    if not isinstance(pool_type, str) or pool_type.upper() not in kinds:
        raise helper.error(f"pool_type must be one of {[k.lower() for k in kinds]}, got {pool_type!r}")
    out = helper.create_variable_for_type_inference(input.dtype)
    max_index = helper.create_variable_for_type_inference(input.dtype)
    helper.append_op(
        "sequence_pool",
        {"X": input},
        {"Out": out, "MaxIndex": max_index},
        {"pooltype": pool_type.upper(), "is_test": is_test, "pad_value": pad_value},
    )
    if pool_type.lower() == "max":
        max_index.stop_gradient = True
    return out


# ----------------------------------------------------------------- tensors


def fill_constant(shape: Sequence[int], dtype: Any, value: float, force_cpu: bool = False, out: Variable | None = None) -> Variable:
    helper = LayerHelper("fill_constant")
    dtype = to_dtype(dtype)
    attrs: dict[str, Any] = {"value": float(value), "force_cpu": bool(force_cpu)}
    attrs["str_value"] = str(int(value)) if dtype in (DType.INT32, DType.INT64) else str(float(value))
    if any(int(d) < 0 for d in shape):
        raise helper.error(f"shape {list(shape)} has a negative dim")
    if out is None:
        out = helper.create_variable_for_type_inference(dtype)
    attrs["dtype"] = int(out.dtype)
    attrs["shape"] = [int(d) for d in shape]
    helper.append_op("fill_constant", {}, {"Out": [out]}, attrs)
    out.stop_gradient = True
    return out


def assign(input: Variable, output: Variable | None = None) -> Variable:
    helper = LayerHelper("assign", input=input)
    helper.check_variable(input, "input")
    if output is None:
        output = helper.create_variable_for_type_inference(input.dtype)
    helper.append_op("assign", {"X": [input]}, {"Out": [output]})
    return output


def create_global_var(shape: Sequence[int], value: float, dtype: Any, persistable: bool = False, force_cpu: bool = False,
                      name: str | None = None) -> Variable:
    """A global-block var filled by a `fill_constant` in the startup program."""
    helper = LayerHelper("global_var")
    var = helper.create_global_variable(dtype=dtype, shape=list(shape), persistable=persistable, name=name, stop_gradient=True)
    helper.set_variable_initializer(var, Constant(value=float(value), force_cpu=force_cpu))
    return var


def autoincreased_step_counter(counter_name: str | None = None, begin: int = 1, step: int = 1) -> Variable:
    """A persistable int64 `[1]` counter, set to `begin - 1` at startup and bumped by an
    `increment` prepended to the main block (so it runs first every step)."""
    helper = LayerHelper("global_step_counter")
    counter, is_new = helper.create_or_get_global_variable(
        name=counter_name or "@STEP_COUNTER@", dtype="int64", shape=[1], persistable=True
    )
    if is_new:
        helper.set_variable_initializer(counter, Constant(value=begin - 1, force_cpu=True))
        block = helper.main_program.global_block()
        append_op(block, "increment", {"X": [counter]}, {"Out": [counter]}, {"step": float(step)}, index=0, layer=helper.name)
        counter.stop_gradient = True
    return counter


def increment(x: Variable, value: float = 1.0, in_place: bool = True) -> Variable:
    helper = LayerHelper("increment", x=x)
    out = x if in_place else helper.create_variable_for_type_inference(x.dtype)
    helper.append_op("increment", {"X": [x]}, {"Out": [out]}, {"step": float(value)})
    return out


def create_tensor(dtype: Any, name: str | None = None, persistable: bool = False) -> Variable:
    helper = LayerHelper("create_tensor", name=name)
    return helper.create_variable(name=helper.name, dtype=dtype, persistable=persistable)


__all__ = [
    "ConditionalBlock",
    "Switch",
    "assign",
    "autoincreased_step_counter",
    "cast",
    "clip",
    "clip_by_norm",
    "concat",
    "create_global_var",
    "create_tensor",
    "cross_entropy",
    "cross_entropy2",
    "data",
    "elementwise_add",
    "elementwise_div",
    "elementwise_max",
    "elementwise_min",
    "elementwise_mul",
    "elementwise_pow",
    "elementwise_sub",
    "embedding",
    "equal",
    "exp",
    "exponential_decay",
    "fc",
    "fill_constant",
    "floor",
    "fluid_data",
    "greater_equal",
    "greater_than",
    "increment",
    "inverse_time_decay",
    "less_equal",
    "less_than",
    "logical_and",
    "logical_not",
    "logical_or",
    "logical_xor",
    "mean",
    "mul",
    "natural_exp_decay",
    "not_equal",
    "piecewise_decay",
    "reduce_mean",
    "reduce_sum",
    "relu",
    "scale",
    "sequence_pool",
    "sigmoid",
    "softmax",
    "softmax_with_cross_entropy",
    "sqrt",
    "square",
    "square_error_cost",
    "sum",
    "sums",
    "tanh",
]
