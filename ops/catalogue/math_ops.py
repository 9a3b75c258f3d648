"""Elementwise arithmetic, activations, matrix multiply, reductions and friends.

Slots, attrs and defaults are Fluid 1.8.5's registered ones (the `fluid18_*`
fixtures show most of them as Paddle wrote them); the grad specs follow its makers.
"""

from __future__ import annotations

from ops.catalogue import shapes
from ops.catalogue.grad import GradSpec, assign_grad, cast_grad, scale_grad, sum_grad
from ops.catalogue.opdef import Bool, Float, Floats, Int, Ints, Str, op
from transpiler.ir.types import VarKind


def sum_var_kind(op_, kind_of):
    """`sum` of SelectedRows only is SelectedRows (how several sparse-table grads add up)."""
    kinds = [kind_of(name) for name in op_.input("X")]
    kind = VarKind.SELECTED_ROWS if kinds and all(k == VarKind.SELECTED_ROWS for k in kinds) else VarKind.LOD_TENSOR
    return {name: kind for name in op_.output("Out")}


def same_kind_var_kind(op_, kind_of):
    """`scale` / `assign`: the output is of the input's kind."""
    kinds = [kind_of(name) for name in op_.input("X")]
    return {name: kinds[0] for name in op_.output("Out")} if kinds and kinds[0] is not None else {}

_ELEMENTWISE_ATTRS = {"axis": Int(-1), "use_mkldnn": Bool(False), "x_data_format": Str(""), "y_data_format": Str("")}
_ACT_ATTRS = {"use_mkldnn": Bool(False), "use_cudnn": Bool(False)}
_REDUCE_ATTRS = {"dim": Ints([0]), "keep_dim": Bool(False), "reduce_all": Bool(False), "in_dtype": Int(-1), "out_dtype": Int(-1)}


def _elementwise(name: str, grad: GradSpec | None):
    return op(f"elementwise_{name}", "X Y", "Out", _ELEMENTWISE_ATTRS, grad=grad, infer=shapes.elementwise)


def _xy_grad(name: str) -> GradSpec:
    return GradSpec(f"elementwise_{name}_grad", inputs=("X", "Y"), in_grads=("X", "Y"))


def _act(name: str, grad_inputs: tuple[str, ...], grad_outputs: tuple[str, ...]):
    grad = GradSpec(f"{name}_grad", inputs=grad_inputs, outputs=grad_outputs)
    return op(name, "X", "Out", _ACT_ATTRS, grad=grad, infer=shapes.unary)


OPS = (
    _elementwise("add", _xy_grad("add")),
    _elementwise("sub", _xy_grad("sub")),
    _elementwise("mul", _xy_grad("mul")),
    _elementwise("div", GradSpec("elementwise_div_grad", inputs=("Y",), outputs=("Out",), in_grads=("X", "Y"))),
    _elementwise("pow", _xy_grad("pow")),
    _elementwise("max", _xy_grad("max")),
    _elementwise("min", _xy_grad("min")),
    # Activations: relu / tanh / sigmoid / exp grads read Out, square reads X, floor neither.
    _act("relu", (), ("Out",)),
    _act("tanh", (), ("Out",)),
    _act("sigmoid", (), ("Out",)),
    _act("exp", (), ("Out",)),
    _act("sqrt", (), ("Out",)),
    _act("square", ("X",), ()),
    _act("floor", (), ()),
    op(
        "softmax",
        "X",
        "Out",
        {"axis": Int(-1), "use_cudnn": Bool(False), "use_mkldnn": Bool(False), "data_format": Str("AnyLayout"), "is_test": Bool(False)},
        grad=GradSpec("softmax_grad", outputs=("Out",)),
        infer=shapes.unary,
    ),
    op(
        "mul",
        "X Y",
        "Out",
        {
            "x_num_col_dims": Int(1),
            "y_num_col_dims": Int(1),
            "use_mkldnn": Bool(False),
            "scale_x": Float(1.0),
            "scale_y": Floats([1.0]),
            "scale_out": Float(1.0),
            "force_fp32_output": Bool(False),
        },
        grad=GradSpec("mul_grad", inputs=("X", "Y"), in_grads=("X", "Y")),
        infer=shapes.mul,
    ),
    # mean's grad maker copies no attrs: Fluid's mean_grad carries only op_role and op_device.
    op("mean", "X", "Out", grad=GradSpec("mean_grad", inputs=("X",), copy_attrs=False), infer=shapes.scalar_out),
    op("reduce_sum", "X", "Out", _REDUCE_ATTRS, grad=GradSpec("reduce_sum_grad", inputs=("X",)), infer=shapes.reduce),
    op("reduce_mean", "X", "Out", _REDUCE_ATTRS, grad=GradSpec("reduce_mean_grad", inputs=("X",)), infer=shapes.reduce),
    op("sum", "X*", "Out", {"use_mkldnn": Bool(False)}, grad=sum_grad, infer=shapes.sum_, var_kind=sum_var_kind),
    op(
        "scale",
        "X ScaleTensor?",
        "Out",
        {"scale": Float(1.0), "bias": Float(0.0), "bias_after_scale": Bool(True)},
        grad=scale_grad,
        infer=shapes.keep_kind,
        var_kind=same_kind_var_kind,
    ),
    op(
        "concat",
        "X* AxisTensor?",
        "Out",
        {"axis": Int(0), "use_mkldnn": Bool(False), "use_quantizer": Bool(False)},
        grad=GradSpec("concat_grad", inputs=("X", "AxisTensor"), keep_empty=True),
        infer=shapes.concat,
    ),
    op("cast", "X", "Out", {"in_dtype": Int(), "out_dtype": Int()}, grad=cast_grad, infer=shapes.cast),
    op("clip", "X", "Out", {"min": Float(), "max": Float()}, grad=GradSpec("clip_grad", inputs=("X",)), infer=shapes.keep_kind),
    # Paddle's clip_by_norm: X * max_norm / ||X||_2 when the norm exceeds max_norm (gradient clipping; no grad).
    # SquaredNorm (ours, optional): ||whole grad||^2 when X is a block of it on a pserver
    # (summed across the pservers: transpiler/passes/pserver_norm_reduce.py).
    op("clip_by_norm", "X SquaredNorm?", "Out", {"max_norm": Float()}, infer=shapes.unary),
    op("assign", "X", "Out", grad=assign_grad, infer=shapes.keep_kind, var_kind=same_kind_var_kind),
    op("increment", "X", "Out", {"step": Float(1.0)}, infer=shapes.unary),
    op("fill_zeros_like", "X", "Out", infer=shapes.unary),
)
