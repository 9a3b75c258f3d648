"""Optimizer kernels for dense and SelectedRows grads (Paddle 1.8 / 2.6 update rules):
`sgd`, `momentum`, `lars_momentum`, `adam`, `adamw`, `lamb`, `adamax`, `adagrad`, `decayed_adagrad`,
`rmsprop`, `ftrl`.

A SelectedRows grad is first merged (duplicate rows summed). What it updates follows
Paddle: `sgd`, `adagrad` and `ftrl` touch only the rows present (for `sgd` and `adagrad`
that equals the dense update with zero grads elsewhere; for `ftrl` it does not, since a
dense zero grad still re-shrinks the param); `momentum`, `rmsprop` and non-lazy `adam`
update every row, absent rows with a zero grad (their velocity / moments still decay),
so sparse and dense grads give the same parameters; `adam` with `lazy_mode=True`
touches only the rows present. `lars_momentum`, `adamax` and `decayed_adagrad` take
dense grads only, as in Paddle. A SelectedRows *parameter* (a pserver's shard of the
distributed table) is updated in place, with its accumulators, by every optimizer with
a sparse rule (`ops.kernels.table_update`); Paddle updates it with `sgd` only.

`adamax` does not advance `Beta1Pow`: Fluid's `Adamax` appends a `scale` op for that.

Outputs are new values (a dense param is not written in place) so a reader holding
the old value keeps a consistent tensor; dense `adam` computes into arrays recycled from
its earlier outputs once nothing holds them (`OpContext.output_buffer`), and into the
param and moments themselves when no reader can tell or on a sync pserver
(`OpContext.may_update_in_place`), as `sgd` does. A sparse `adagrad`, `ftrl` and lazy `adam`
(the rules that touch only the grad's rows) write those rows into the param and state
themselves under the same condition (`_row_targets`) instead of copying the whole param and
state every step to change a few rows; on a sync pserver that was most of its CPU per
step on a large table (benchmarks/RESULTS.md, "Cost model and planner").
"""

from __future__ import annotations

import os

import numpy as np

from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register
from ops.kernels.table_update import on_table
from ops.tensor import SelectedRows

try:  # the one-pass updates, built by setup.py where a C compiler is found
    from ops.kernels import _fused
except ImportError:  # pragma: no cover - a build without it runs the numpy path
    _fused = None

# PSTRANSPILE_FUSED=0 runs the numpy path even where the compiled one is built (both compute
# the same bits; the switch is for measuring one against the other).
FUSED = _fused is not None and os.environ.get("PSTRANSPILE_FUSED", "1") != "0"
FUSED_SGD = hasattr(_fused, "sgd")  # a build from before the compiled sgd has adam alone


def _learning_rate(ctx: OpContext, dtype: np.dtype) -> np.generic:
    return dtype.type(ctx.scalar("LearningRate"))


def _grad(ctx: OpContext) -> np.ndarray | SelectedRows:
    value = ctx.value("Grad")
    if isinstance(value, SelectedRows):
        return value.merged()
    return ctx.dense("Grad", value)


def _dense_grad(ctx: OpContext, i: int = 0) -> np.ndarray:
    """The grad of an op Paddle implements for dense grads only."""
    value = ctx.value("Grad", i)
    if isinstance(value, SelectedRows):
        name = ctx.input_names("Grad")[i]
        raise KernelError(
            f"{ctx.type} takes only a dense Grad, as in Paddle; {name!r} is SelectedRows "
            "(a sparse grad needs sgd, momentum, adam, adagrad, rmsprop or ftrl)"
        )
    return ctx.dense("Grad", value)


def _dense_param(ctx: OpContext, i: int = 0) -> np.ndarray:
    value = ctx.value("Param", i)
    if isinstance(value, SelectedRows):
        raise KernelError(
            f"{ctx.type} cannot update a SelectedRows parameter (a table needs sgd, momentum, adam, adagrad, "
            "rmsprop or ftrl)"
        )
    return ctx.dense("Param", value)


def _check_rows(ctx: OpContext, grad: SelectedRows, param: np.ndarray) -> None:
    if grad.rows.size and (grad.rows.min() < 0 or grad.rows.max() >= param.shape[0]):
        row = int(grad.rows.max()) if grad.rows.max() >= param.shape[0] else int(grad.rows.min())
        raise KernelError(f"{ctx.type}: grad row {row} is outside the parameter's {param.shape[0]} rows")


def _writable(ctx: OpContext, *pairs: tuple[str, str]) -> list[bool]:
    """Per (input slot, output slot), may the op write the output into the input's own array
    (`OpContext.may_update_in_place`); asked before the kernel binds any array."""
    return [ctx.may_update_in_place(slot, out) for slot, out in pairs]


def _row_targets(arrays: tuple[np.ndarray, ...], writable: list[bool], dtype: np.dtype) -> list[np.ndarray]:
    """Where a sparse update that touches only its grad's rows writes: each array itself
    where the run allows it (a sync pserver: no step copies the whole param and state to
    change a few rows) and its dtype is the output's, else a copy. Both ways compute the
    same rows from the same inputs, so the same bits."""
    return [a if here and a.dtype == dtype else a.copy() for a, here in zip(arrays, writable, strict=True)]


# Attr defaults come from the op catalogue (Fluid 1.8's attrs); a kernel names only the
# attrs Paddle 2.x added, which every optimizer shares one of.
PADDLE2_DEFAULTS = {"multi_precision": False}

# -------------------------------------------------------------------------- sgd


@register("sgd", defaults=PADDLE2_DEFAULTS)
@on_table
def sgd(ctx: OpContext) -> None:
    """`ParamOut = Param - lr * Grad`."""
    in_place = ctx.may_update_in_place("Param", "ParamOut")  # before this kernel binds the param
    param = ctx.input("Param")
    # lr * Grad into Grad's own array when the grad dies here (a pserver's summed grad):
    # asked before this kernel binds the grad. The same bits as into a new array.
    reuse = ctx.reusable_input("Grad", param.shape, param.dtype)
    grad = _grad(ctx)
    lr = _learning_rate(ctx, param.dtype)
    if isinstance(grad, SelectedRows):
        _check_rows(ctx, grad, param)
        out = param if in_place else param.copy()  # a sparse step copying a whole table costs more than the step
        out[grad.rows] -= lr * grad.value.astype(param.dtype, copy=False)  # rows are unique after merging
    elif in_place and FUSED and FUSED_SGD and _fusable(param, (grad,), (lr,)):
        _fused.sgd(param, grad, lr)  # the same operations element by element, in one pass, no temporary
        out = param
    elif reuse is None and in_place and grad.shape == param.shape and _chunkable(grad, param):
        # In place without a param-sized temporary: lr * Grad a chunk at a time (the same
        # bits: each element's two operations are those of the whole-array path).
        out = param
        flat_grad, flat_param = grad.reshape(-1), param.reshape(-1)
        chunk = _sgd_chunk(param.dtype)
        scratch = ctx.scratch(min(chunk, flat_param.size), param.dtype)  # a pserver lends its chunk buffer
        for start in range(0, flat_param.size, chunk):
            piece = flat_param[start:start + chunk]
            step = np.multiply(flat_grad[start:start + chunk], lr, dtype=param.dtype, out=scratch[:piece.size])
            np.subtract(piece, step, out=piece)
    else:
        step = np.multiply(grad, lr, dtype=param.dtype, out=reuse)
        out = np.subtract(param, step, out=param if in_place and step.shape == param.shape else step)
    ctx.set_output("ParamOut", out, lod=ctx.lod("Param"))


# bytes of lr * Grad computed at a time by an in-place dense sgd: its scratch, in a pserver's
# peak beside the params (issue 30). 512 kB: the 64 MB pserver's peak is 0.5 MB lower than at
# 1 MB, for 0.4 ms more per 32 MB of float32 (one ufunc call pair per chunk; 0.7 ms float64),
# measured (docs/runtime.md "Where a peak goes").
SGD_CHUNK_BYTES = 512 << 10


def _sgd_chunk(dtype: np.dtype) -> int:
    """Elements of a chunk of `SGD_CHUNK_BYTES`."""
    return max(1, SGD_CHUNK_BYTES // np.dtype(dtype).itemsize)


def _chunkable(grad: np.ndarray, param: np.ndarray) -> bool:
    """Both C-contiguous (their flat views are views), and big enough to be worth it."""
    return param.size > _sgd_chunk(param.dtype) and grad.flags.c_contiguous and param.flags.c_contiguous


# --------------------------------------------------------------------- momentum

MOMENTUM_PADDLE2_DEFAULTS = {
    **PADDLE2_DEFAULTS,
    "regularization_method": "",
    "regularization_coeff": 0.0,
    "rescale_grad": 1.0,
}


@register("momentum", defaults=MOMENTUM_PADDLE2_DEFAULTS)
@on_table
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


# ---------------------------------------------------------------- lars_momentum

LARS_MOMENTUM_PADDLE2_DEFAULTS = {**PADDLE2_DEFAULTS, "epsilon": 0.0, "rescale_grad": 1.0}


@register("lars_momentum", defaults=LARS_MOMENTUM_PADDLE2_DEFAULTS)
def lars_momentum(ctx: OpContext) -> None:
    """Momentum with a layer-wise lr (lars_momentum_op.h): `local_lr = lr * lars_coeff *
    |p| / (|g| + lars_weight_decay * |p| + epsilon)` when both L2 norms are non-zero, else
    `lr`; `v = mu * v + local_lr * (g + lars_weight_decay * p); p -= v`.

    Paddle 2.x made `lars_weight_decay` a list (one decay per `Param` of a merged op), added
    `epsilon` and `rescale_grad` (which scales g first), and keeps `lr` when the decay is 0
    too. An op with a float decay (Fluid 1.8's) keeps 1.8's rule; the new attrs' defaults
    leave it unchanged."""
    decay_attr = ctx.attr("lars_weight_decay")
    per_param = isinstance(decay_attr, (list, tuple))
    count = len(ctx.input_names("Param"))
    decays = list(decay_attr) if per_param else [decay_attr] * count
    if len(decays) != count:
        raise KernelError(f"lars_momentum has {count} params but {len(decays)} lars_weight_decay values")
    for i, decay in enumerate(decays):
        _lars_momentum_one(ctx, i, decay, keep_lr_without_decay=per_param)


def _lars_momentum_one(ctx: OpContext, i: int, decay: float, *, keep_lr_without_decay: bool) -> None:
    param = _dense_param(ctx, i)
    grad = _dense_grad(ctx, i)
    velocity = ctx.input("Velocity", i)
    lr_array = ctx.input("LearningRate", i)
    if lr_array.size != 1:
        raise KernelError(f"lars_momentum: LearningRate {i} must hold one element, got shape {list(lr_array.shape)}")
    dt = param.dtype.type
    lr, mu, wd = dt(lr_array.reshape(-1)[0]), dt(ctx.attr("mu")), dt(decay)
    coeff, eps = dt(ctx.attr("lars_coeff")), dt(ctx.attr("epsilon"))
    rescale = dt(ctx.attr("rescale_grad"))
    g = grad * rescale
    if ctx.has_input("SquaredNorms"):  # a block of the param: its whole norms, summed across the pservers
        squared = ctx.input("SquaredNorms", i).reshape(-1)
        p_norm, g_norm = np.sqrt(dt(squared[0])), np.sqrt(dt(squared[1])) * np.abs(rescale)
    else:
        p_norm, g_norm = np.sqrt(np.sum(param * param)), np.sqrt(np.sum(g * g))
    local_lr = lr
    if p_norm > 0 and g_norm > 0 and (wd > 0 or not keep_lr_without_decay):
        local_lr = lr * coeff * p_norm / (g_norm + wd * p_norm + eps)
    v_out = velocity * mu + local_lr * (g + wd * param)
    ctx.set_output("ParamOut", (param - v_out).astype(param.dtype, copy=False), i=i)
    ctx.set_output("VelocityOut", v_out.astype(param.dtype, copy=False), i=i)


# ------------------------------------------------------------------------- adam

ADAM_PADDLE2_DEFAULTS = {**PADDLE2_DEFAULTS, "use_global_beta_pow": False}


def _attr_or_tensor(ctx: OpContext, attr: str, slot: str, dt: type) -> np.generic:
    return dt(ctx.scalar(slot)) if ctx.has_input(slot) else dt(ctx.attr(attr))


@register("adam", defaults=ADAM_PADDLE2_DEFAULTS)
@on_table
def adam(ctx: OpContext) -> None:
    """Adam as Paddle computes it: `lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t)`,
    `p -= lr_t * m1 / (sqrt(m2) + eps * sqrt(1 - b2^t))`, and the beta powers advance
    (unless `use_global_beta_pow`)."""
    # Asked before this kernel binds the arrays (see `OpContext.may_update_in_place`).
    writable = [ctx.may_update_in_place(slot, f"{slot}Out") for slot in ("Param", "Moment1", "Moment2")]
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
        p_out, m1_out, m2_out = _row_targets((param, m1, m2), writable, param.dtype)
        m1_out[rows] = beta1 * m1[rows] + (dt(1) - beta1) * g
        m2_out[rows] = beta2 * m2[rows] + (dt(1) - beta2) * g * g
        p_out[rows] = param[rows] - lr_t * (m1_out[rows] / (np.sqrt(m2_out[rows]) + eps_t))
    else:
        if isinstance(grad, SelectedRows):
            _check_rows(ctx, grad, param)
            grad = grad.to_dense()
        in_place = [here and a.dtype == param.dtype for a, here in zip((param, m1, m2), writable, strict=True)]
        if any(in_place):  # a sync pserver's own arrays, or arrays only the scope holds: updated where they are
            into = tuple(a if here else None for a, here in zip((param, m1, m2), in_place, strict=True))
        else:  # recycled output arrays (or new ones)
            into = _adam_buffers(ctx, param, grad, m1, m2)
        p_out, m1_out, m2_out = _adam_dense(param, grad, m1, m2, beta1, beta2, lr_t, eps_t, into)
    ctx.set_output("ParamOut", p_out.astype(param.dtype, copy=False))
    ctx.set_output("Moment1Out", m1_out.astype(param.dtype, copy=False))
    ctx.set_output("Moment2Out", m2_out.astype(param.dtype, copy=False))
    if ctx.attr("use_global_beta_pow"):
        return
    ctx.set_output("Beta1PowOut", (b1p_arr * beta1).astype(b1p_arr.dtype, copy=False))
    ctx.set_output("Beta2PowOut", (b2p_arr * beta2).astype(b2p_arr.dtype, copy=False))


# ------------------------------------------------------------------------ adamw


@register("adamw")
@on_table
def adamw(ctx: OpContext) -> None:
    """AdamW as Paddle 2.6's CPU kernel computes it (phi adamw_kernel.cc, `CPUAdamW`):
    `lr = LearningRate * lr_ratio`; with `with_decay`, first `p = p * (1 - lr * coeff)`
    (decoupled decay); then Adam's update with that `lr`, and the beta powers advance.
    `with_decay=False` (a param `apply_decay_param_fun` excludes) is Adam at `lr`."""
    param = _dense_param(ctx)
    dt = param.dtype.type
    beta1 = _attr_or_tensor(ctx, "beta1", "Beta1Tensor", dt)
    beta2 = _attr_or_tensor(ctx, "beta2", "Beta2Tensor", dt)
    eps = _attr_or_tensor(ctx, "epsilon", "EpsilonTensor", dt)
    m1, m2 = ctx.input("Moment1"), ctx.input("Moment2")
    b1p_arr, b2p_arr = ctx.input("Beta1Pow"), ctx.input("Beta2Pow")
    if ctx.has_input("SkipUpdate") and bool(ctx.scalar("SkipUpdate")):
        for slot, value in (("ParamOut", param), ("Moment1Out", m1), ("Moment2Out", m2),
                            ("Beta1PowOut", b1p_arr), ("Beta2PowOut", b2p_arr)):
            ctx.set_output(slot, value)
        return
    b1p, b2p = dt(b1p_arr.reshape(-1)[0]), dt(b2p_arr.reshape(-1)[0])
    lr = _learning_rate(ctx, param.dtype) * dt(ctx.attr("lr_ratio"))
    if ctx.attr("with_decay"):
        param = param * (dt(1) - lr * dt(ctx.attr("coeff")))
    lr_t = lr * (np.sqrt(dt(1) - b2p) / (dt(1) - b1p))
    eps_t = eps * np.sqrt(dt(1) - b2p)
    grad = _grad(ctx)
    if isinstance(grad, SelectedRows) and ctx.attr("lazy_mode"):
        raise KernelError("adamw: lazy_mode with a sparse grad is not supported (use adam, or a dense grad)")
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


# ------------------------------------------------------------------------- lamb


@register("lamb")
def lamb(ctx: OpContext) -> None:
    """LAMB as Paddle 2.6 computes it (lamb_kernel_impl.h): Adam's moments, the update
    `r = (m1 / (1 - b1^t)) / (sqrt(m2 / (1 - b2^t)) + eps) + weight_decay * p`, then
    `p -= lr * (|p| / |r|) * r` (the ratio 1 when either norm is 0, or when `weight_decay`
    is 0 and not `always_adapt`); the beta powers advance. The norms are of the whole
    param: on a block of it, `SquaredNorms` brings the whole param's (summed across the
    pservers holding its blocks from their `lamb_squared_norms`)."""
    param = _dense_param(ctx)
    grad = _dense_grad(ctx)
    dt = param.dtype.type
    beta1, beta2 = dt(ctx.attr("beta1")), dt(ctx.attr("beta2"))
    decay = dt(ctx.attr("weight_decay"))
    m1, m2 = ctx.input("Moment1"), ctx.input("Moment2")
    b1p_arr, b2p_arr = ctx.input("Beta1Pow"), ctx.input("Beta2Pow")
    if ctx.has_input("SkipUpdate") and bool(ctx.scalar("SkipUpdate")):
        for slot, value in (("ParamOut", param), ("Moment1Out", m1), ("Moment2Out", m2)):
            ctx.set_output(slot, value)
        return
    m1_out, m2_out, update = _lamb_direction(ctx, param, grad, m1, m2)
    lr = _learning_rate(ctx, param.dtype)
    if ctx.has_input("SquaredNorms"):  # a block of the param: its whole norms, summed across the pservers
        squared = ctx.input("SquaredNorms").reshape(-1)
        p_norm, r_norm = np.sqrt(dt(squared[0])), np.sqrt(dt(squared[1]))
    else:
        p_norm, r_norm = lamb_norms(param, update)
    ratio = lamb_trust_ratio(p_norm, r_norm, decay, bool(ctx.attr("always_adapt")))
    ctx.set_output("ParamOut", (param - (lr * ratio) * update).astype(param.dtype, copy=False))
    ctx.set_output("Moment1Out", m1_out.astype(param.dtype, copy=False))
    ctx.set_output("Moment2Out", m2_out.astype(param.dtype, copy=False))
    if ctx.has_output("Beta1PowOut"):
        ctx.set_output("Beta1PowOut", (b1p_arr * beta1).astype(b1p_arr.dtype, copy=False))
    if ctx.has_output("Beta2PowOut"):
        ctx.set_output("Beta2PowOut", (b2p_arr * beta2).astype(b2p_arr.dtype, copy=False))


def _lamb_direction(ctx: OpContext, param, grad, m1, m2):
    """(Moment1Out, Moment2Out, r): LAMB's moments and update direction, before the ratio."""
    dt = param.dtype.type
    beta1, beta2, eps = dt(ctx.attr("beta1")), dt(ctx.attr("beta2")), dt(ctx.attr("epsilon"))
    decay = dt(ctx.attr("weight_decay"))
    b1p, b2p = dt(ctx.input("Beta1Pow").reshape(-1)[0]), dt(ctx.input("Beta2Pow").reshape(-1)[0])
    one = dt(1)
    m1_out = beta1 * m1 + (one - beta1) * grad
    m2_out = beta2 * m2 + (one - beta2) * grad * grad
    update = (m1_out / (one - b1p)) / (np.sqrt(m2_out / (one - b2p)) + eps) + decay * param
    return m1_out, m2_out, update


@register("lamb_squared_norms")
def lamb_squared_norms(ctx: OpContext) -> None:
    """[|p|^2, |r|^2] of this block, r what `lamb` computes from the same inputs: the
    partial sums the pservers holding a LAMB param's blocks add up."""
    param = _dense_param(ctx)
    _, _, update = _lamb_direction(ctx, param, _dense_grad(ctx), ctx.input("Moment1"), ctx.input("Moment2"))
    ctx.set_output("Out", np.array([np.sum(param * param), np.sum(update * update)], dtype=param.dtype))


def lamb_norms(param: np.ndarray, update: np.ndarray) -> tuple[np.generic, np.generic]:
    """(|p|, |r|), the L2 norms LAMB's trust ratio divides."""
    return np.sqrt(np.sum(param * param)), np.sqrt(np.sum(update * update))


def lamb_trust_ratio(p_norm, r_norm, decay, always_adapt: bool):
    if (decay == 0 and not always_adapt) or not (p_norm > 0 and r_norm > 0):
        return type(p_norm)(1)
    return p_norm / r_norm


# Below this many elements a new array costs less than recycling one: malloc hands small
# blocks back from its free lists, without the page faults of a large one.
RECYCLE_FROM_ELEMENTS = 4096


def _adam_buffers(ctx: OpContext, p, g, m1, m2) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Arrays for ParamOut, Moment1Out and Moment2Out (`output_buffer`) when all four
    tensors share one dtype and shape and are large; None (new arrays, numpy's casts)
    otherwise. Both ways compute the same bits."""
    if p.size < RECYCLE_FROM_ELEMENTS:
        return None
    if not (p.dtype == g.dtype == m1.dtype == m2.dtype and p.shape == g.shape == m1.shape == m2.shape):
        return None
    return tuple(ctx.output_buffer(slot, p.shape, p.dtype) for slot in ("ParamOut", "Moment1Out", "Moment2Out"))


def _adam_dense(p, g, m1, m2, beta1, beta2, lr_t, eps_t, into=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The dense Adam update in Paddle's order of operations (`(1 - b2) * g * g`,
    `lr * (m1 / (sqrt(m2) + eps))`). `into` (p_out, m1_out, m2_out; each an array or None:
    a new one) says where the results go: recycled output arrays (`_adam_buffers`), or on a
    sync pserver the param and moments themselves. A recycled p_out is the scratch array
    until the last step, `p - scratch`, which numpy computes element by element in place.
    Where the compiled `_fused.adam` is built and takes the arrays (`_fusable`), it runs the
    same operations element by element in one pass, about 3x faster.
    Every way runs the same operations, so computes the same bits."""
    p_into, m1_into, m2_into = into if into is not None else (None, None, None)
    if FUSED and _fusable(p, (g, m1, m2, *(a for a in into or () if a is not None)), (beta1, beta2, lr_t, eps_t)):
        outs = tuple(np.empty_like(p) if a is None else a for a in (p_into, m1_into, m2_into))
        _fused.adam(p, g, m1, m2, *outs, beta1, beta2, lr_t, eps_t)
        return outs
    one = type(beta1)(1)
    scratch = p_into if p_into is not None and p_into is not p else None
    tmp = np.multiply(g, one - beta1, out=scratch)
    m1_out = np.multiply(m1, beta1, out=m1_into)
    m1_out += tmp
    np.multiply(g, one - beta2, out=tmp)
    tmp *= g
    m2_out = np.multiply(m2, beta2, out=m2_into)
    m2_out += tmp
    np.sqrt(m2_out, out=tmp)
    tmp += eps_t
    np.divide(m1_out, tmp, out=tmp)
    tmp *= lr_t
    return np.subtract(p, tmp, out=p_into), m1_out, m2_out


def _fusable(param: np.ndarray, others: tuple[np.ndarray, ...], scalars: tuple[np.generic, ...]) -> bool:
    """Can the compiled update take these: one float dtype (scalars included) and one shape,
    every array C-contiguous (its one pass reads raw memory); else the numpy path, which
    casts and broadcasts."""
    dtype, shape = param.dtype, param.shape
    if dtype != np.float32 and dtype != np.float64:
        return False
    return (all(type(x) is dtype.type for x in scalars)
            and all(a.dtype == dtype and a.shape == shape and a.flags.c_contiguous for a in (param, *others)))


# ----------------------------------------------------------------------- adamax


@register("adamax")
def adamax(ctx: OpContext) -> None:
    """adamax_op.h: `m = b1 * m + (1 - b1) * g; u = max(|g|, b2 * u + eps);
    p -= lr / (1 - beta1_pow) * (m / u)`. `Beta1Pow` is only read: Fluid's `Adamax`
    advances it with a `scale` op after the update."""
    param = _dense_param(ctx)
    grad = _dense_grad(ctx)
    dt = param.dtype.type
    beta1, beta2, eps = dt(ctx.attr("beta1")), dt(ctx.attr("beta2")), dt(ctx.attr("epsilon"))
    lr, beta1_pow = _learning_rate(ctx, param.dtype), dt(ctx.scalar("Beta1Pow"))
    m_out = beta1 * ctx.input("Moment") + (dt(1) - beta1) * grad
    u_out = np.maximum(np.abs(grad), beta2 * ctx.input("InfNorm") + eps)
    p_out = param - lr / (dt(1) - beta1_pow) * (m_out / u_out)
    ctx.set_output("ParamOut", p_out.astype(param.dtype, copy=False))
    ctx.set_output("MomentOut", m_out.astype(param.dtype, copy=False))
    ctx.set_output("InfNormOut", u_out.astype(param.dtype, copy=False))


# ---------------------------------------------------------------------- adagrad


@register("adagrad", defaults=PADDLE2_DEFAULTS)
@on_table
def adagrad(ctx: OpContext) -> None:
    """`m += g^2; p -= lr * g / (sqrt(m) + eps)`; a sparse grad touches its rows only
    (merged first: a row once, its grads summed, as Paddle's SparseAdagradFunctor), in the
    param and moment themselves where the run allows it (`_row_targets`)."""
    writable = _writable(ctx, ("Param", "ParamOut"), ("Moment", "MomentOut"))
    param = _dense_param(ctx)
    moment = ctx.input("Moment")
    dt = param.dtype.type
    lr, eps = _learning_rate(ctx, param.dtype), dt(ctx.attr("epsilon"))
    grad = _grad(ctx)
    if isinstance(grad, SelectedRows):
        _check_rows(ctx, grad, param)
        rows, g = grad.rows, grad.value.astype(param.dtype, copy=False)
        p_out, m_out = _row_targets((param, moment), writable, param.dtype)
        m_out[rows] = moment[rows] + g * g
        p_out[rows] = param[rows] - lr * g / (np.sqrt(m_out[rows]) + eps)
    else:
        m_out = moment + grad * grad
        p_out = param - lr * grad / (np.sqrt(m_out) + eps)
    ctx.set_output("ParamOut", p_out.astype(param.dtype, copy=False))
    ctx.set_output("MomentOut", m_out.astype(param.dtype, copy=False))


@register("decayed_adagrad")
def decayed_adagrad(ctx: OpContext) -> None:
    """`m = decay * m + (1 - decay) * g^2; p -= lr * g / (sqrt(m) + eps)` (dense grads only)."""
    param = _dense_param(ctx)
    grad = _dense_grad(ctx)
    dt = param.dtype.type
    lr, decay, eps = _learning_rate(ctx, param.dtype), dt(ctx.attr("decay")), dt(ctx.attr("epsilon"))
    m_out = decay * ctx.input("Moment") + (dt(1) - decay) * grad * grad
    p_out = param - lr * grad / (np.sqrt(m_out) + eps)
    ctx.set_output("ParamOut", p_out.astype(param.dtype, copy=False))
    ctx.set_output("MomentOut", m_out.astype(param.dtype, copy=False))


# ---------------------------------------------------------------------- rmsprop

@register("rmsprop", defaults=PADDLE2_DEFAULTS)
@on_table
def rmsprop(ctx: OpContext) -> None:
    """`ms = decay * ms + (1 - decay) * g^2`; centered: `mg = decay * mg + (1 - decay) * g`,
    `mom = momentum * mom + lr * g / sqrt(ms - mg^2 + eps)`, else `mom = momentum * mom +
    lr * g / sqrt(ms + eps)`; `p -= mom`. A sparse grad updates every row, absent rows
    with a zero grad (rmsprop_op.h's SparseRmspropGradFunctor)."""
    param = _dense_param(ctx)
    grad = _grad(ctx)
    if isinstance(grad, SelectedRows):
        _check_rows(ctx, grad, param)
        grad = grad.to_dense()
    dt = param.dtype.type
    lr = _learning_rate(ctx, param.dtype)
    rho, eps, mu = dt(ctx.attr("decay")), dt(ctx.attr("epsilon")), dt(ctx.attr("momentum"))
    ms_out = rho * ctx.input("MeanSquare") + (dt(1) - rho) * grad * grad
    mg_out = None
    if ctx.attr("centered"):
        if not ctx.has_input("MeanGrad"):
            raise KernelError("rmsprop with centered=True needs a MeanGrad input")
        mg_out = rho * ctx.input("MeanGrad") + (dt(1) - rho) * grad
        mom_out = mu * ctx.input("Moment") + lr * grad / np.sqrt(ms_out - mg_out * mg_out + eps)
    else:
        mom_out = mu * ctx.input("Moment") + lr * grad / np.sqrt(ms_out + eps)
    ctx.set_output("ParamOut", (param - mom_out).astype(param.dtype, copy=False))
    ctx.set_output("MomentOut", mom_out.astype(param.dtype, copy=False))
    ctx.set_output("MeanSquareOut", ms_out.astype(param.dtype, copy=False))
    if mg_out is not None:  # Paddle leaves MeanGradOut alone unless centered
        ctx.set_output("MeanGradOut", mg_out.astype(param.dtype, copy=False))


# ------------------------------------------------------------------------- ftrl


@register("ftrl")
@on_table
def ftrl(ctx: OpContext) -> None:
    """Follow The Regularized Leader as ftrl_op.h computes it (l1 and l2 each + 1e-10;
    `sqrt` when `lr_power == -0.5`, else `pow(·, -lr_power)`). A sparse grad updates
    only its rows (SparseFTRLFunctor; merged first); every other row keeps its param and
    accumulators, updated in their own arrays where the run allows it (`_row_targets`)."""
    writable = _writable(ctx, ("Param", "ParamOut"), ("SquaredAccumulator", "SquaredAccumOut"),
                         ("LinearAccumulator", "LinearAccumOut"))
    param = _dense_param(ctx)
    dt = param.dtype.type
    l1, l2 = dt(ctx.attr("l1")) + dt(1e-10), dt(ctx.attr("l2")) + dt(1e-10)
    lr, lr_power = _learning_rate(ctx, param.dtype), dt(ctx.attr("lr_power"))
    squared, linear = ctx.input("SquaredAccumulator"), ctx.input("LinearAccumulator")
    grad = _grad(ctx)
    if isinstance(grad, SelectedRows):
        _check_rows(ctx, grad, param)
        rows, g = grad.rows, grad.value.astype(param.dtype, copy=False)
        p_out, sq_out, lin_out = _row_targets((param, squared, linear), writable, param.dtype)
        p_out[rows], sq_out[rows], lin_out[rows] = _ftrl_update(
            param[rows], g, squared[rows], linear[rows], lr, l1, l2, lr_power
        )
    else:
        p_out, sq_out, lin_out = _ftrl_update(param, grad, squared, linear, lr, l1, l2, lr_power)
    ctx.set_output("ParamOut", p_out.astype(param.dtype, copy=False))
    ctx.set_output("SquaredAccumOut", sq_out.astype(param.dtype, copy=False))
    ctx.set_output("LinearAccumOut", lin_out.astype(param.dtype, copy=False))


def _ftrl_update(p, g, squared, linear, lr, l1, l2, lr_power) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    new_squared = squared + g * g
    if lr_power == type(lr_power)(-0.5):
        sigma_root, old_root = np.sqrt(new_squared), np.sqrt(squared)
    else:
        sigma_root, old_root = np.power(new_squared, -lr_power), np.power(squared, -lr_power)
    lin_out = linear + g - (sigma_root - old_root) / lr * p
    shrunk = (l1 * np.sign(lin_out) - lin_out) / (sigma_root / lr + type(l2)(2) * l2)
    p_out = np.where(np.abs(lin_out) > l1, shrunk, type(l1)(0))
    return p_out, new_squared, lin_out
