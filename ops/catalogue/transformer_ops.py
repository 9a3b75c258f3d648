"""Ops of Paddle 2.x transformer models (BERT, GPT): `matmul_v2`, ...

Slots, attrs and defaults are Paddle 2.6's registered ones (the BERT fixtures in
tests/fixtures/paddle_programs/ show them as Paddle wrote them); the grad specs follow its
makers. Attrs Paddle 2.6 marks "extra" (`use_mkldnn`, `mkldnn_data_type`) are listed
because Paddle writes them into its programs.
"""

from __future__ import annotations

from ops.catalogue.grad import GradSpec
from ops.catalogue.opdef import Bool, ShapeContext, ShapeError, Str, TensorInfo, op
from ops.catalogue.shapes import Result, fmt

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


OPS = (
    op(
        "matmul_v2",
        "X Y",
        "Out",
        {"trans_x": Bool(False), "trans_y": Bool(False), **_MKLDNN},
        grad=GradSpec("matmul_v2_grad", inputs=("X", "Y"), in_grads=("X", "Y")),
        infer=matmul_v2_shape,
    ),
)
