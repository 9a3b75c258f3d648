"""Kernels of Paddle 2.x transformer models (BERT, GPT): `matmul_v2`, ... with their grads.

Semantics are Paddle 2.6's CPU kernels (phi); `tests/test_kernels_transformer.py` checks
each against Paddle 2.6 itself on the same inputs. Kernels keep their inputs' dtype.
"""

from __future__ import annotations

import numpy as np

from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register

# ---------------------------------------------------------------------- matmul_v2


def _t(a: np.ndarray) -> np.ndarray:
    return np.swapaxes(a, -1, -2)


def _sum_to(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum a grad over the batch dims `shape` was broadcast along (leading dims it lacks,
    and its size-1 dims that grew)."""
    if grad.shape == shape:
        return grad
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape) if d == 1 and grad.shape[lead + i] != 1)
    return grad.sum(axis=axes, keepdims=True).reshape(shape) if axes else grad.reshape(shape)


def _mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`a @ b` for a >= 2-D `a` and a 2-D `b`: one GEMM over the stacked rows (numpy's
    matmul would loop over the batch); otherwise numpy's batched matmul."""
    if b.ndim == 2 and a.ndim > 2 and a.flags.c_contiguous:
        return (a.reshape(-1, a.shape[-1]) @ b).reshape(*a.shape[:-1], b.shape[-1])
    return np.matmul(a, b)


def _check_matmul(ctx: OpContext, x: np.ndarray, y: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    if x.ndim == 0 or y.ndim == 0:
        raise KernelError(f"{ctx.type}: X {list(x.shape)} and Y {list(y.shape)} must have at least one dim")
    if a.shape[-1] != b.shape[-2]:
        raise KernelError(
            f"{ctx.type}: X {list(x.shape)} (trans_x={bool(ctx.attr('trans_x'))}) and Y {list(y.shape)} "
            f"(trans_y={bool(ctx.attr('trans_y'))}) cannot multiply: {a.shape[-1]} vs {b.shape[-2]}"
        )


def _operands(ctx: OpContext, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """X and Y as >= 2-D matrices after `trans_*` (Paddle: a 1-D X is [1, K], a 1-D Y is
    [K, 1], and `trans_*` of a 1-D operand is ignored)."""
    a = x[np.newaxis, :] if x.ndim == 1 else (_t(x) if ctx.attr("trans_x") else x)
    b = y[:, np.newaxis] if y.ndim == 1 else (_t(y) if ctx.attr("trans_y") else y)
    return a, b


@register("matmul_v2")
def matmul_v2(ctx: OpContext) -> None:
    x, y = ctx.input("X"), ctx.input("Y")
    if x.ndim == 0 or y.ndim == 0:
        raise KernelError(f"matmul_v2: X {list(x.shape)} and Y {list(y.shape)} must have at least one dim")
    a, b = _operands(ctx, x, y)
    _check_matmul(ctx, x, y, a, b)
    try:
        out = _mm(a, b)
    except ValueError as exc:  # batch dims that do not broadcast
        raise KernelError(f"matmul_v2: X {list(x.shape)} and Y {list(y.shape)}: {exc}") from None
    if y.ndim == 1:
        out = out[..., 0]
    if x.ndim == 1:
        out = out[..., 0, :] if y.ndim > 1 else out[..., 0]
    ctx.set_output("Out", np.ascontiguousarray(out, dtype=np.result_type(x, y)))


@register("matmul_v2_grad")
def matmul_v2_grad(ctx: OpContext) -> None:
    """dA = dOut @ B^T, dB = A^T @ dOut on the >= 2-D operands, then the transposes undone,
    the broadcast batch dims summed and the 1-D operands' dims dropped again."""
    x, y, dout = ctx.input("X"), ctx.input("Y"), ctx.input("Out@GRAD")
    a, b = _operands(ctx, x, y)
    d = dout
    if x.ndim == 1:
        d = d[..., np.newaxis, :] if y.ndim > 1 else d[..., np.newaxis]
    if y.ndim == 1:
        d = d[..., np.newaxis]
    if ctx.has_output("X@GRAD"):
        da = _mm(d, _t(b))
        if x.ndim == 1:
            dx = _sum_to(da, (1, x.shape[0])).reshape(x.shape)
        else:
            dx = _sum_to(_t(da) if ctx.attr("trans_x") else da, x.shape)
        ctx.set_output("X@GRAD", np.ascontiguousarray(dx, dtype=x.dtype))
    if ctx.has_output("Y@GRAD"):
        if y.ndim <= 2:  # Y is shared by the whole batch: one GEMM over the stacked rows
            db = a.reshape(-1, a.shape[-1]).T @ d.reshape(-1, d.shape[-1])
        else:
            db = np.matmul(_t(a), d)
        if y.ndim == 1:
            dy = _sum_to(db, (y.shape[0], 1)).reshape(y.shape)
        else:
            dy = _sum_to(_t(db) if ctx.attr("trans_y") else db, y.shape)
        ctx.set_output("Y@GRAD", np.ascontiguousarray(dy, dtype=y.dtype))
