"""Ops of Paddle 2.x transformer models (BERT, GPT): `matmul_v2`, `layer_norm`, `dropout`,
`gelu`, `slice`, `range`, `tril_triu`, `unsqueeze2` and `squared_l2_norm` (a global-norm clip).

Slots, attrs and defaults are Paddle 2.6's registered ones (the BERT fixtures in
tests/fixtures/paddle_programs/ show them as Paddle wrote them); the grad specs follow its
makers. Attrs Paddle 2.6 marks "extra" (`use_mkldnn`, `mkldnn_data_type`) are listed
because Paddle writes them into its programs.
"""

from __future__ import annotations

import math

from ops.catalogue import shapes
from ops.catalogue.grad import GradSpec
from ops.catalogue.opdef import Bool, Float, Int, Ints, ShapeContext, ShapeError, Str, TensorInfo, op
from ops.catalogue.shapes import Result, fmt
from transpiler.ir.types import DType, VarKind

_MKLDNN = {"use_mkldnn": Bool(False), "mkldnn_data_type": Str("float32")}


def _broadcast_batch(op_type: str, a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """numpy's broadcast of two batch shapes (-1 stays unknown unless the other dim is > 1)."""
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + a
    b = (1,) * (n - len(b)) + b
    out = []
    for i, (p, q) in enumerate(zip(a, b, strict=True)):
        if p > 1 and q > 1 and p != q:
            raise ShapeError(f"{op_type}: batch dims {fmt(a)} and {fmt(b)} do not broadcast (dim {i}: {p} vs {q})")
        if p == q or q == 1:
            out.append(p)
        elif p == 1:
            out.append(q)
        else:  # one is -1 (unknown), the other > 1: that one
            out.append(max(p, q))
    return tuple(out)


def matmul_v2_shape(ctx: ShapeContext) -> Result:
    """Paddle's `MatmulInferMeta`: a 1-D X is a row vector and a 1-D Y a column vector
    (their `trans_*` ignored, their dim dropped from Out); the batch dims broadcast."""
    x, y = ctx.x("X"), ctx.x("Y")
    xs, ys = list(x.shape), list(y.shape)
    if not xs or not ys:
        raise ShapeError(f"matmul_v2: X {fmt(xs)} and Y {fmt(ys)} must have at least one dim")
    x_vec, y_vec = len(xs) == 1, len(ys) == 1
    if x_vec:
        xs = [1, xs[0]]
    if y_vec:
        ys = [ys[0], 1]
    m, kx = (xs[-1], xs[-2]) if ctx.attr("trans_x") and not x_vec else (xs[-2], xs[-1])
    ky, n = (ys[-1], ys[-2]) if ctx.attr("trans_y") and not y_vec else (ys[-2], ys[-1])
    if kx > 0 and ky > 0 and kx != ky:
        raise ShapeError(f"matmul_v2: X {fmt(x.shape)} and Y {fmt(y.shape)} cannot multiply ({kx} vs {ky})")
    shape = list(_broadcast_batch("matmul_v2", tuple(xs[:-2]), tuple(ys[:-2])))
    if not x_vec:
        shape.append(m)
    if not y_vec:
        shape.append(n)
    return {"Out": [TensorInfo(x.dtype, tuple(shape))]}


def layer_norm_shape(ctx: ShapeContext) -> Result:
    """Y like X; Mean and Variance shaped like X's dims before `begin_norm_axis` (Paddle
    2.6's InferMeta and kernel both: [-1, 128] for BERT's [-1, 128, 768])."""
    x = ctx.x("X")
    axis = ctx.attr("begin_norm_axis")
    if not 0 < axis < len(x.shape):
        raise ShapeError(f"layer_norm: begin_norm_axis={axis} does not fit X {fmt(x.shape)}")
    stat = TensorInfo(x.dtype, tuple(x.shape[:axis]))
    return {"Y": [x.with_(kind=VarKind.LOD_TENSOR)], "Mean": [stat], "Variance": [stat]}


def dropout_shape(ctx: ShapeContext) -> Result:
    """Out like X; Mask X's shape in uint8 (Paddle 2.6)."""
    x = ctx.x("X")
    return {"Out": [x.with_(kind=VarKind.LOD_TENSOR)], "Mask": [TensorInfo(DType.UINT8, x.shape)]}


def slice_shape(ctx: ShapeContext) -> Result:
    """Paddle's `SliceRawInferMeta` for constant starts/ends (tensor starts/ends: -1 dims)."""
    x = ctx.x("Input")
    shape = list(x.shape)
    tensors = any(ctx.has(s) for s in ("StartsTensor", "EndsTensor", "StartsTensorList", "EndsTensorList"))
    for i, axis in enumerate(ctx.attr("axes")):
        axis = axis + len(shape) if axis < 0 else axis
        if not 0 <= axis < len(shape):
            raise ShapeError(f"slice: axis {axis} is out of range for Input {fmt(x.shape)}")
        dim = shape[axis]
        if tensors or dim < 0:
            shape[axis] = -1
            continue
        start, end = ctx.attr("starts")[i], ctx.attr("ends")[i]
        start = max(0, min(dim, start + dim if start < 0 else start))
        end = max(0, min(dim, end + dim if end < 0 else end))
        shape[axis] = max(0, end - start)
    decrease = {a + len(shape) if a < 0 else a for a in ctx.attr("decrease_axis")}
    shape = [d for i, d in enumerate(shape) if i not in decrease]
    return {"Out": [TensorInfo(x.dtype, tuple(shape))]}


def unsqueeze_dims(in_dims, axes) -> list[int]:
    """Paddle's `GetUnsqueezeShape`: each axis inserted in turn, a negative one counted
    from the end of the shape so far (+1)."""
    rank = len(in_dims) + len(axes)
    out = [0] * rank
    cur = len(in_dims)
    for axis in axes:
        pos = axis + cur + 1 if axis < 0 else axis
        if not 0 <= pos <= cur:
            raise ShapeError(f"unsqueeze2: axis {axis} is out of range for a rank-{cur} shape")
        for i in range(cur, pos - 1, -1):
            if out[i] == 1:  # move an inserted axis right
                out[i + 1], out[i] = 1, 0
        out[pos] = 1
        cur += 1
    it = iter(in_dims)
    return [next(it) if d == 0 else d for d in out]


def reshape2_shape(ctx: ShapeContext) -> Result:
    """Paddle's reshape2 with a `shape` attr: a 0 copies the input's dim, one -1 is
    inferred from the element count."""
    x = ctx.x("X")
    if ctx.has("Shape") or ctx.has("ShapeTensor"):
        return {}
    shape = [x.shape[i] if d == 0 else d for i, d in enumerate(ctx.attr("shape"))]
    if shape.count(-1) > 1:
        raise ShapeError(f"reshape2: more than one -1 in {list(ctx.attr('shape'))}")
    if -1 in shape and all(d >= 0 for d in x.shape):
        known = math.prod(d for d in shape if d != -1)
        shape[shape.index(-1)] = math.prod(x.shape) // known if known else -1
    if all(d >= 0 for d in shape) and all(d >= 0 for d in x.shape) and math.prod(shape) != math.prod(x.shape):
        raise ShapeError(f"reshape2: {list(x.shape)} cannot be reshaped to {list(ctx.attr('shape'))}")
    return {"Out": [TensorInfo(x.dtype, tuple(shape))], "XShape": [TensorInfo(x.dtype, (0, *x.shape))]}


def unsqueeze2_shape(ctx: ShapeContext) -> Result:
    x = ctx.x("X")
    if ctx.has("AxesTensor") or ctx.has("AxesTensorList"):
        return {}
    shape = unsqueeze_dims(list(x.shape), list(ctx.attr("axes")))
    return {"Out": [TensorInfo(x.dtype, tuple(shape))], "XShape": [TensorInfo(x.dtype, (0, *x.shape))]}


_SLICE_TENSORS = ("StartsTensor", "EndsTensor", "StartsTensorList", "EndsTensorList")

OPS = (
    op(
        "matmul_v2",
        "X Y",
        "Out",
        {"trans_x": Bool(False), "trans_y": Bool(False), **_MKLDNN},
        grad=GradSpec("matmul_v2_grad", inputs=("X", "Y"), in_grads=("X", "Y")),
        infer=matmul_v2_shape,
    ),
    op(
        "layer_norm",
        "X Scale? Bias?",
        "Y Mean!? Variance!?",
        {"epsilon": Float(1e-5), "begin_norm_axis": Int(1), "is_test": Bool(False), **_MKLDNN},
        grad=GradSpec(
            "layer_norm_grad", inputs=("X", "Scale", "Bias"), outputs=("Mean", "Variance"), out_grads=("Y",),
            in_grads=("X", "Scale", "Bias"),
        ),
        infer=layer_norm_shape,
    ),
    op(
        "dropout",
        "X Seed?",
        "Out Mask!?",
        {
            "dropout_prob": Float(0.5),
            "is_test": Bool(False),
            "fix_seed": Bool(False),
            "seed": Int(0),
            "dropout_implementation": Str("downgrade_in_infer"),
        },
        grad=GradSpec("dropout_grad", outputs=("Mask",)),
        infer=dropout_shape,
    ),
    op("gelu", "X", "Out", {"approximate": Bool(False), **_MKLDNN}, grad=GradSpec("gelu_grad", inputs=("X",)), infer=shapes.unary),
    op(
        "slice",
        "Input StartsTensor? EndsTensor? StartsTensorList*? EndsTensorList*?",
        "Out",
        {"axes": Ints(), "starts": Ints([]), "ends": Ints([]), "infer_flags": Ints([]), "decrease_axis": Ints([]), **_MKLDNN},
        grad=GradSpec("slice_grad", inputs=("Input", *_SLICE_TENSORS), in_grads=("Input",)),
        infer=slice_shape,
    ),
    # Start / End / Step are one-element tensors; Out's length is known at run time only.
    op("range", "Start End Step", "Out"),
    op(
        "tril_triu",
        "X",
        "Out",
        {"diagonal": Int(0), "lower": Bool()},
        grad=GradSpec("tril_triu_grad", inputs=()),
        infer=shapes.unary,
    ),
    # (here for the trainer's column cut of a rank-3+ param: its grad seen as [rows, cols])
    op(
        "reshape2",
        "X Shape? ShapeTensor*?",
        "Out XShape!?",
        {"shape": Ints([])},
        grad=GradSpec("reshape2_grad", outputs=("XShape",)),
        infer=reshape2_shape,
    ),
    op(
        "unsqueeze2",
        "X AxesTensor? AxesTensorList*?",
        "Out XShape!?",
        {"axes": Ints([])},
        grad=GradSpec("unsqueeze2_grad", outputs=("XShape",)),
        infer=unsqueeze2_shape,
    ),
    op(
        "squared_l2_norm",
        "X",
        "Out",
        grad=GradSpec("squared_l2_norm_grad", inputs=("X",)),
        infer=shapes.scalar_out,
    ),
)
