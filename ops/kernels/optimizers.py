"""Optimizer kernels: `sgd`, `momentum`, `adam`, `adagrad`, for dense and SelectedRows
grads (Paddle 1.8 / 2.6 update rules).

A SelectedRows grad is first merged (duplicate rows summed). What it updates follows
Paddle: `sgd` and `adagrad` touch only the rows present (which equals the dense update
with zero grads elsewhere); `momentum` and non-lazy `adam` update every row, absent
rows with a zero grad (their velocity / moments still decay), so sparse and dense
grads give the same parameters; `adam` with `lazy_mode=True` touches only the rows
present. A SelectedRows *parameter* (a pserver's auto-grown table) is updated in place
under its lock, and only `sgd` supports it, as in Paddle.

Outputs are new arrays (a dense param is never written in place) so a reader holding
the old value keeps a consistent tensor.
"""

from __future__ import annotations

import numpy as np

from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register
from ops.tensor import SelectedRows


def _learning_rate(ctx: OpContext, dtype: np.dtype) -> np.generic:
    return dtype.type(ctx.scalar("LearningRate"))


def _grad(ctx: OpContext) -> np.ndarray | SelectedRows:
    value = ctx.value("Grad")
    if isinstance(value, SelectedRows):
        return value.merged()
    return ctx.input("Grad")


def _dense_param(ctx: OpContext) -> np.ndarray:
    value = ctx.value("Param")
    if isinstance(value, SelectedRows):
        raise KernelError(f"{ctx.type} cannot update a SelectedRows parameter (Paddle supports only sgd)")
    return ctx.input("Param")


def _check_rows(ctx: OpContext, grad: SelectedRows, param: np.ndarray) -> None:
    if grad.rows.size and (grad.rows.min() < 0 or grad.rows.max() >= param.shape[0]):
        row = int(grad.rows.max()) if grad.rows.max() >= param.shape[0] else int(grad.rows.min())
        raise KernelError(f"{ctx.type}: grad row {row} is outside the parameter's {param.shape[0]} rows")


# -------------------------------------------------------------------------- sgd


@register("sgd", defaults={"multi_precision": False})
def sgd(ctx: OpContext) -> None:
    """`ParamOut = Param - lr * Grad`."""
    param_value = ctx.value("Param")
    grad = _grad(ctx)
    if isinstance(param_value, SelectedRows):
        _sgd_table(ctx, param_value, grad)
        return
    param = ctx.input("Param")
    lr = _learning_rate(ctx, param.dtype)
    if isinstance(grad, SelectedRows):
        _check_rows(ctx, grad, param)
        out = param.copy()
        out[grad.rows] -= lr * grad.value.astype(param.dtype, copy=False)  # rows are unique after merging
    else:
        out = np.multiply(grad, lr, dtype=param.dtype)
        np.subtract(param, out, out=out)
    ctx.set_output("ParamOut", out, lod=ctx.lod("Param"))


def _sgd_table(ctx: OpContext, table: SelectedRows, grad: np.ndarray | SelectedRows) -> None:
    """SGD on an auto-grown table: rows are found (or created) by id and updated in place."""
    if not isinstance(grad, SelectedRows):
        raise KernelError("sgd on a SelectedRows parameter needs a SelectedRows grad")
    lr = _learning_rate(ctx, table.dtype)
    with table.lock:
        slots = table.lookup_index(grad.rows, grow=True)
        table.value[slots] -= lr * grad.value.astype(table.dtype, copy=False)
    ctx.set_output("ParamOut", table)


# --------------------------------------------------------------------- momentum

MOMENTUM_DEFAULTS = {
    "mu": 0.9,
    "use_nesterov": False,
    "regularization_method": "",
    "regularization_coeff": 0.0,
    "rescale_grad": 1.0,
    "multi_precision": False,
}


@register("momentum", defaults=MOMENTUM_DEFAULTS)
def momentum(ctx: OpContext) -> None:
    """`v = mu * v + g; p -= lr * v` (Nesterov: `p -= lr * (g + mu * v)`), with
    Paddle 2.x's optional L2 decay and grad rescaling folded into g."""
    param = _dense_param(ctx)
    grad = _grad(ctx)
    if isinstance(grad, SelectedRows):
        _check_rows(ctx, grad, param)
        grad = grad.to_dense()
    velocity = ctx.input("Velocity")
    dt = param.dtype.type
    lr, mu = _learning_rate(ctx, param.dtype), dt(ctx.attr("mu"))
    g = grad * dt(ctx.attr("rescale_grad"))
    if ctx.attr("regularization_method") == "l2_decay":
        g = g + dt(ctx.attr("regularization_coeff")) * param
    v_out = mu * velocity + g
    p_out = param - (g + mu * v_out) * lr if ctx.attr("use_nesterov") else param - lr * v_out
    ctx.set_output("ParamOut", p_out.astype(param.dtype, copy=False))
    ctx.set_output("VelocityOut", v_out.astype(param.dtype, copy=False))


# ------------------------------------------------------------------------- adam

ADAM_DEFAULTS = {
    "beta1": 0.9,
    "beta2": 0.999,
    "epsilon": 1e-8,
    "lazy_mode": False,
    "min_row_size_to_use_multithread": 1000,
    "use_global_beta_pow": False,
    "multi_precision": False,
}


def _attr_or_tensor(ctx: OpContext, attr: str, slot: str, dt: type) -> np.generic:
    return dt(ctx.scalar(slot)) if ctx.has_input(slot) else dt(ctx.attr(attr))


@register("adam", defaults=ADAM_DEFAULTS)
def adam(ctx: OpContext) -> None:
    """Adam as Paddle computes it: `lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t)`,
    `p -= lr_t * m1 / (sqrt(m2) + eps * sqrt(1 - b2^t))`, and the beta powers advance
    (unless `use_global_beta_pow`)."""
    param = _dense_param(ctx)
    dt = param.dtype.type
    beta1 = _attr_or_tensor(ctx, "beta1", "Beta1Tensor", dt)
    beta2 = _attr_or_tensor(ctx, "beta2", "Beta2Tensor", dt)
    eps = _attr_or_tensor(ctx, "epsilon", "EpsilonTensor", dt)
    m1, m2 = ctx.input("Moment1"), ctx.input("Moment2")
    b1p_arr, b2p_arr = ctx.input("Beta1Pow"), ctx.input("Beta2Pow")
    if ctx.has_input("SkipUpdate") and bool(ctx.scalar("SkipUpdate")):
        for slot, value in (("ParamOut", param), ("Moment1Out", m1), ("Moment2Out", m2)):
            ctx.set_output(slot, value)
        ctx.set_output("Beta1PowOut", b1p_arr)
        ctx.set_output("Beta2PowOut", b2p_arr)
        return
    b1p, b2p = dt(b1p_arr.reshape(-1)[0]), dt(b2p_arr.reshape(-1)[0])
    lr = _learning_rate(ctx, param.dtype)
    lr_t = lr * np.sqrt(dt(1) - b2p) / (dt(1) - b1p)
    eps_t = eps * np.sqrt(dt(1) - b2p)
    grad = _grad(ctx)
    if isinstance(grad, SelectedRows) and ctx.attr("lazy_mode"):
        _check_rows(ctx, grad, param)
        rows, g = grad.rows, grad.value.astype(param.dtype, copy=False)
        p_out, m1_out, m2_out = param.copy(), m1.copy(), m2.copy()
        m1_out[rows] = beta1 * m1[rows] + (dt(1) - beta1) * g
        m2_out[rows] = beta2 * m2[rows] + (dt(1) - beta2) * g * g
        p_out[rows] = param[rows] - lr_t * (m1_out[rows] / (np.sqrt(m2_out[rows]) + eps_t))
    else:
        if isinstance(grad, SelectedRows):
            _check_rows(ctx, grad, param)
            grad = grad.to_dense()
        p_out, m1_out, m2_out = _adam_dense(param, grad, m1, m2, beta1, beta2, lr_t, eps_t)
    ctx.set_output("ParamOut", p_out.astype(param.dtype, copy=False))
    ctx.set_output("Moment1Out", m1_out.astype(param.dtype, copy=False))
    ctx.set_output("Moment2Out", m2_out.astype(param.dtype, copy=False))
    if ctx.attr("use_global_beta_pow"):
        return
    ctx.set_output("Beta1PowOut", (b1p_arr * beta1).astype(b1p_arr.dtype, copy=False))
    ctx.set_output("Beta2PowOut", (b2p_arr * beta2).astype(b2p_arr.dtype, copy=False))


def _adam_dense(p, g, m1, m2, beta1, beta2, lr_t, eps_t) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The dense Adam update with four allocations instead of a dozen temporaries,
    in Paddle's order of operations (`(1 - b2) * g * g`, `lr * (m1 / (sqrt(m2) + eps))`)."""
    one = type(beta1)(1)
    tmp = np.multiply(g, one - beta1)
    m1_out = np.multiply(m1, beta1)
    m1_out += tmp
    np.multiply(g, one - beta2, out=tmp)
    tmp *= g
    m2_out = np.multiply(m2, beta2)
    m2_out += tmp
    np.sqrt(m2_out, out=tmp)
    tmp += eps_t
    np.divide(m1_out, tmp, out=tmp)
    tmp *= lr_t
    return np.subtract(p, tmp), m1_out, m2_out


# ---------------------------------------------------------------------- adagrad


@register("adagrad", defaults={"epsilon": 1e-6, "multi_precision": False})
def adagrad(ctx: OpContext) -> None:
    """`m += g^2; p -= lr * g / (sqrt(m) + eps)`; a sparse grad touches its rows only."""
    param = _dense_param(ctx)
    moment = ctx.input("Moment")
    dt = param.dtype.type
    lr, eps = _learning_rate(ctx, param.dtype), dt(ctx.attr("epsilon"))
    grad = _grad(ctx)
    if isinstance(grad, SelectedRows):
        _check_rows(ctx, grad, param)
        rows, g = grad.rows, grad.value.astype(param.dtype, copy=False)
        m_out, p_out = moment.copy(), param.copy()
        m_out[rows] = moment[rows] + g * g
        p_out[rows] = param[rows] - lr * g / (np.sqrt(m_out[rows]) + eps)
    else:
        m_out = moment + grad * grad
        p_out = param - lr * grad / (np.sqrt(m_out) + eps)
    ctx.set_output("ParamOut", p_out.astype(param.dtype, copy=False))
    ctx.set_output("MomentOut", m_out.astype(param.dtype, copy=False))

