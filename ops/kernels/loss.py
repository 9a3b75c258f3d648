"""Loss kernels: `cross_entropy` (v1), `cross_entropy2`, `softmax_with_cross_entropy`,
with their grads. Hard labels are int64 class ids with `ignore_index` rows giving zero
loss and zero grad; soft labels are distributions over the last axis."""

from __future__ import annotations

import numpy as np

from ops.kernels.context import KernelError, OpContext
from ops.kernels.nn import softmax
from ops.kernels.registry import register

# Paddle's TolerableValue: log(0) = -inf is replaced by -1e20 so losses stay finite.
APPROX_INF = 1e20


def tolerable_log(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        out = np.log(x)
    return np.where(np.isneginf(out), -APPROX_INF, np.where(np.isposinf(out), APPROX_INF, out)).astype(x.dtype)


def _hard_labels(ctx: OpContext, label: np.ndarray, rows: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat int64 labels (ignored rows mapped to 0) and the mask of rows that count."""
    flat = label.reshape(-1).astype(np.int64, copy=False)
    if flat.size != rows:
        raise KernelError(f"{ctx.type}: {flat.size} labels for {rows} rows")
    valid = flat != int(ctx.attr("ignore_index"))
    bad = valid & ((flat < 0) | (flat >= classes))
    if bad.any():
        raise KernelError(f"{ctx.type}: label {int(flat[bad][0])} is out of range [0, {classes})")
    return np.where(valid, flat, 0), valid


@register("cross_entropy")
def cross_entropy(ctx: OpContext) -> None:
    """`Y = -log(X[label])` (hard) or `-sum(label * log(X))` (soft), X probabilities."""
    x, label = ctx.input("X"), ctx.input("Label")
    x2 = x.reshape(-1, x.shape[-1])
    if ctx.attr("soft_label"):
        y = -(label.reshape(x2.shape) * tolerable_log(x2)).sum(axis=1)
    else:
        lbl, valid = _hard_labels(ctx, label, x2.shape[0], x2.shape[1])
        y = np.where(valid, -tolerable_log(x2[np.arange(x2.shape[0]), lbl]), 0)
    ctx.set_output("Y", y.astype(x.dtype).reshape(*x.shape[:-1], 1), lod=ctx.lod("X"))


@register("cross_entropy_grad")
def cross_entropy_grad(ctx: OpContext) -> None:
    x, label, dy = ctx.input("X"), ctx.input("Label"), ctx.input("Y@GRAD")
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, 1)
    if ctx.attr("soft_label"):
        dx = -dy2 * label.reshape(x2.shape) / x2
    else:
        lbl, valid = _hard_labels(ctx, label, x2.shape[0], x2.shape[1])
        dx = np.zeros_like(x2, dtype=dy.dtype)
        r = np.arange(x2.shape[0])
        dx[r, lbl] = np.where(valid, -dy2[:, 0] / x2[r, lbl], 0)
    ctx.set_output("X@GRAD", dx.astype(dy.dtype, copy=False).reshape(x.shape), lod=ctx.lod("X"))


@register("cross_entropy2")
def cross_entropy2(ctx: OpContext) -> None:
    """Hard-label cross entropy keeping `MatchX = X[label]` for the grad, and `XShape`
    (an empty tensor of dims X.shape + [0]) to recover X's shape."""
    x, label = ctx.input("X"), ctx.input("Label")
    x2 = x.reshape(-1, x.shape[-1])
    lbl, valid = _hard_labels(ctx, label, x2.shape[0], x2.shape[1])
    match = np.where(valid, x2[np.arange(x2.shape[0]), lbl], 0).astype(x.dtype)
    y = np.where(valid, -tolerable_log(np.where(valid, match, 1)), 0).astype(x.dtype)
    lead = (*x.shape[:-1], 1)
    ctx.set_output("Y", y.reshape(lead), lod=ctx.lod("X"))
    ctx.set_output("MatchX", match.reshape(lead), lod=ctx.lod("X"))
    ctx.set_output("XShape", np.zeros((*x.shape, 0), dtype=x.dtype))


@register("cross_entropy_grad2")
def cross_entropy_grad2(ctx: OpContext) -> None:
    label, match, dy = ctx.input("Label"), ctx.input("MatchX"), ctx.input("Y@GRAD")
    x_shape = ctx.input("XShape").shape[:-1]
    rows, classes = int(np.prod(x_shape[:-1])), x_shape[-1]
    lbl, valid = _hard_labels(ctx, label, rows, classes)
    dx = np.zeros((rows, classes), dtype=dy.dtype)
    safe = np.where(valid, match.reshape(-1), 1)
    dx[np.arange(rows), lbl] = np.where(valid, -dy.reshape(-1) / safe, 0)
    ctx.set_output("X@GRAD", dx.reshape(x_shape))


SWCE_EXTRA_DEFAULTS = {"use_softmax": True}  # Paddle 2.x's; the catalogue holds Fluid 1.8's attrs


def _axis(ctx: OpContext, ndim: int) -> int:
    axis = int(ctx.attr("axis"))
    return axis + ndim if axis < 0 else axis


def _axis_last(a: np.ndarray, axis: int) -> np.ndarray:
    """`a` with `axis` moved last (a view); `a` itself when it is last already, as it is
    in every classifier: `np.moveaxis` costs more than the 64 x 10 softmax it feeds."""
    return a if axis == a.ndim - 1 else np.moveaxis(a, axis, -1)


def _axis_back(a: np.ndarray, axis: int) -> np.ndarray:
    """Undo `_axis_last`."""
    return a if axis == a.ndim - 1 else np.moveaxis(a, -1, axis)


@register("softmax_with_cross_entropy", defaults=SWCE_EXTRA_DEFAULTS)
def softmax_with_cross_entropy(ctx: OpContext) -> None:
    """`Softmax = softmax(Logits)` along `axis`, `Loss = -log(Softmax[label])` (hard) or
    `-sum(label * log(Softmax))` (soft). With `use_softmax=False` (Paddle 2.x) the
    logits are taken as probabilities."""
    logits, label = ctx.input("Logits"), ctx.input("Label")
    axis = _axis(ctx, logits.ndim)
    z = _axis_last(logits, axis)
    z2 = z.reshape(-1, z.shape[-1])
    sm = softmax(z2).astype(logits.dtype, copy=False) if ctx.attr("use_softmax") else z2
    logp = tolerable_log(sm)
    if ctx.attr("soft_label"):
        lab = _axis_last(label, axis).reshape(z2.shape)
        loss = -(lab * logp).sum(axis=1)
    else:
        lbl, valid = _hard_labels(ctx, _axis_last(label, axis), z2.shape[0], z2.shape[1])
        loss = np.where(valid, -logp[np.arange(z2.shape[0]), lbl], 0)
    loss_shape = (*z.shape[:-1], 1)
    lod = ctx.lod("Logits")
    ctx.set_output("Softmax", _axis_back(sm.reshape(z.shape), axis), lod=lod)
    ctx.set_output("Loss", _axis_back(loss.astype(logits.dtype).reshape(loss_shape), axis), lod=lod)


@register("softmax_with_cross_entropy_grad", defaults=SWCE_EXTRA_DEFAULTS)
def softmax_with_cross_entropy_grad(ctx: OpContext) -> None:
    sm, label, dloss = ctx.input("Softmax"), ctx.input("Label"), ctx.input("Loss@GRAD")
    axis = _axis(ctx, sm.ndim)
    s = _axis_last(sm, axis)
    s2 = s.reshape(-1, s.shape[-1])
    d = _axis_last(dloss, axis).reshape(-1, 1)
    rows = np.arange(s2.shape[0])
    if ctx.attr("soft_label"):
        lab = _axis_last(label, axis).reshape(s2.shape)
        dx = (s2 - lab) * d if ctx.attr("use_softmax") else -d * lab / s2
    else:
        lbl, valid = _hard_labels(ctx, _axis_last(label, axis), s2.shape[0], s2.shape[1])
        if ctx.attr("use_softmax"):
            dx = s2.copy()
            dx[rows, lbl] -= 1
            dx *= d
        else:
            dx = np.zeros_like(s2)
            dx[rows, lbl] = -d[:, 0] / s2[rows, lbl]
        dx[~valid] = 0
    ctx.set_output("Logits@GRAD", _axis_back(dx.astype(sm.dtype, copy=False).reshape(s.shape), axis))
