"""Optimizer kernels against hand-written update rules, dense and SelectedRows grads, and
every optimizer the builder emits run end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ops.executor import ExecutionError, Executor
from ops.testing import run_op
from ops.scope import Scope
from ops.tensor import SelectedRows
from transpiler.frontend import fluid18_networks as nets
from transpiler.frontend.errors import BuildError

RNG = np.random.default_rng(5)
LR = np.array([0.1], np.float32)


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def sparse_grad() -> SelectedRows:
    """Rows 1 and 3 of a [5, 2] grad, row 3 twice (a lookup grad looks like this)."""
    return SelectedRows([3, 1, 3], f32(3, 2), 5)


# -------------------------------------------------------------------------- sgd


def test_sgd_dense():
    p, g = f32(3, 2), f32(3, 2)
    out = run_op("sgd", {"Param": p, "Grad": g, "LearningRate": LR}, ["ParamOut"])["ParamOut"]
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, p - np.float32(0.1) * g, rtol=1e-6)


def test_sgd_does_not_write_into_the_param_it_read():
    p, g = f32(3, 2), f32(3, 2)
    keep = p.copy()
    run_op("sgd", {"Param": p, "Grad": g, "LearningRate": LR}, ["ParamOut"])
    np.testing.assert_array_equal(p, keep)


def test_sgd_sparse_updates_only_present_rows_and_sums_duplicates():
    p, g = f32(5, 2), sparse_grad()
    out = run_op("sgd", {"Param": p, "Grad": g, "LearningRate": LR}, ["ParamOut"])["ParamOut"]
    expected = p.copy()
    expected[3] -= 0.1 * (g.value[0] + g.value[2])
    expected[1] -= 0.1 * g.value[1]
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    np.testing.assert_array_equal(out[[0, 2, 4]], p[[0, 2, 4]])


def test_sgd_on_an_auto_grown_table_updates_in_place():
    table = SelectedRows([], np.zeros((4, 2), np.float32), 100)
    g = SelectedRows([42, 7], np.ones((2, 2), np.float32), 100)
    out = run_op("sgd", {"Param": table, "Grad": g, "LearningRate": LR}, ["ParamOut"])["ParamOut"]
    assert out is table
    assert table.rows.tolist() == [7, 42]  # the grad is merged (rows sorted) first
    np.testing.assert_allclose(table.value[:2], -0.1)
    np.testing.assert_array_equal(table.value[2:], 0)


def test_sgd_rejects_grad_rows_outside_the_param():
    g = SelectedRows([9], np.ones((1, 2), np.float32), 10)
    with pytest.raises(ExecutionError, match="outside the parameter's 5 rows"):
        run_op("sgd", {"Param": f32(5, 2), "Grad": g, "LearningRate": LR}, ["ParamOut"])


# --------------------------------------------------------------------- momentum


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_dense(nesterov):
    p, g, v = f32(3, 2), f32(3, 2), f32(3, 2)
    out = run_op(
        "momentum",
        {"Param": p, "Grad": g, "Velocity": v, "LearningRate": LR},
        ["ParamOut", "VelocityOut"],
        attrs={"mu": 0.9, "use_nesterov": nesterov},
    )
    v_out = 0.9 * v + g
    p_out = p - (g + 0.9 * v_out) * 0.1 if nesterov else p - 0.1 * v_out
    np.testing.assert_allclose(out["VelocityOut"], v_out, rtol=1e-5)
    np.testing.assert_allclose(out["ParamOut"], p_out, rtol=1e-5)


def test_momentum_sparse_equals_dense_with_zero_rows():
    p, v, g = f32(5, 2), f32(5, 2), sparse_grad()
    ins = {"Param": p, "Velocity": v, "LearningRate": LR}
    sparse = run_op("momentum", {**ins, "Grad": g}, ["ParamOut", "VelocityOut"], attrs={"mu": 0.9})
    dense = run_op("momentum", {**ins, "Grad": g.to_dense()}, ["ParamOut", "VelocityOut"], attrs={"mu": 0.9})
    for slot in ("ParamOut", "VelocityOut"):
        np.testing.assert_array_equal(sparse[slot], dense[slot])
    # absent rows still decay their velocity, as Paddle's sparse momentum does
    np.testing.assert_allclose(sparse["VelocityOut"][0], 0.9 * v[0], rtol=1e-6)


# ------------------------------------------------------------------------- adam


def adam_reference(p, g, m1, m2, b1p, b2p, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8):
    lr_t = lr * np.sqrt(1 - b2p) / (1 - b1p)
    m1 = beta1 * m1 + (1 - beta1) * g
    m2 = beta2 * m2 + (1 - beta2) * g * g
    return p - lr_t * (m1 / (np.sqrt(m2) + eps * np.sqrt(1 - b2p))), m1, m2


ADAM_OUTS = ["ParamOut", "Moment1Out", "Moment2Out", "Beta1PowOut", "Beta2PowOut"]


def adam_step(p, g, m1, m2, b1p, b2p, **attrs):
    return run_op(
        "adam",
        {
            "Param": p,
            "Grad": g,
            "LearningRate": LR,
            "Moment1": m1,
            "Moment2": m2,
            "Beta1Pow": b1p,
            "Beta2Pow": b2p,
        },
        ADAM_OUTS,
        attrs=attrs,
    )


def test_adam_two_steps_match_the_reference_and_advance_beta_powers():
    p, m1, m2 = f32(4, 3), np.zeros((4, 3), np.float32), np.zeros((4, 3), np.float32)
    b1p, b2p = np.array([0.9], np.float32), np.array([0.999], np.float32)
    rp, rm1, rm2, rb1, rb2 = p.astype(np.float64), 0.0, 0.0, 0.9, 0.999
    for _ in range(2):
        g = f32(4, 3)
        out = adam_step(p, g, m1, m2, b1p, b2p)
        rp, rm1, rm2 = adam_reference(rp, g.astype(np.float64), rm1, rm2, rb1, rb2)
        rb1, rb2 = rb1 * 0.9, rb2 * 0.999
        p, m1, m2, b1p, b2p = (out[k] for k in ADAM_OUTS)
        assert p.dtype == np.float32
    np.testing.assert_allclose(p, rp, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(b1p, [0.9**3], rtol=1e-6)
    np.testing.assert_allclose(b2p, [0.999**3], rtol=1e-6)


def test_adam_sparse_non_lazy_equals_dense():
    p, m1, m2 = f32(5, 2), f32(5, 2), np.abs(f32(5, 2))
    b1p, b2p = np.array([0.81], np.float32), np.array([0.998], np.float32)
    g = sparse_grad()
    sparse = adam_step(p, g, m1, m2, b1p, b2p)
    dense = adam_step(p, g.to_dense(), m1, m2, b1p, b2p)
    for slot in ADAM_OUTS:
        np.testing.assert_array_equal(sparse[slot], dense[slot])
    assert not np.array_equal(sparse["Moment1Out"][0], m1[0])  # absent rows' moments decay


def test_adam_lazy_mode_touches_only_present_rows():
    p, m1, m2 = f32(5, 2), f32(5, 2), np.abs(f32(5, 2))
    b1p, b2p = np.array([0.81], np.float32), np.array([0.998], np.float32)
    g = sparse_grad()
    lazy = adam_step(p, g, m1, m2, b1p, b2p, lazy_mode=True)
    dense = adam_step(p, g.to_dense(), m1, m2, b1p, b2p)
    for slot, before in (("ParamOut", p), ("Moment1Out", m1), ("Moment2Out", m2)):
        np.testing.assert_array_equal(lazy[slot][[0, 2, 4]], before[[0, 2, 4]])
        np.testing.assert_allclose(lazy[slot][[1, 3]], dense[slot][[1, 3]], rtol=1e-6)


def test_adam_refuses_a_table_whose_moments_are_not_tables():
    table = SelectedRows([], np.zeros((4, 2), np.float32), 100)
    with pytest.raises(ExecutionError, match="accumulator Moment1='Moment1' must be a SelectedRows"):
        adam_step(table, sparse_grad(), f32(4, 2), f32(4, 2), np.array([0.9], np.float32), np.array([0.9], np.float32))


# ---------------------------------------------------------------------- adagrad


def test_adagrad_dense():
    p, g, m = f32(3, 2), f32(3, 2), np.abs(f32(3, 2))
    out = run_op("adagrad", {"Param": p, "Grad": g, "Moment": m, "LearningRate": LR}, ["ParamOut", "MomentOut"])
    m_out = m + g * g
    np.testing.assert_allclose(out["MomentOut"], m_out, rtol=1e-6)
    np.testing.assert_allclose(out["ParamOut"], p - 0.1 * g / (np.sqrt(m_out) + 1e-6), rtol=1e-5)


def test_adagrad_sparse_touches_only_present_rows_and_equals_dense():
    p, m, g = f32(5, 2), np.abs(f32(5, 2)), sparse_grad()
    ins = {"Param": p, "Moment": m, "LearningRate": LR}
    sparse = run_op("adagrad", {**ins, "Grad": g}, ["ParamOut", "MomentOut"])
    dense = run_op("adagrad", {**ins, "Grad": g.to_dense()}, ["ParamOut", "MomentOut"])
    np.testing.assert_array_equal(sparse["ParamOut"][[0, 2, 4]], p[[0, 2, 4]])
    for slot in ("ParamOut", "MomentOut"):
        np.testing.assert_allclose(sparse[slot], dense[slot], rtol=1e-6)


# ---------------------------------------------------------------------------------------
# The kernels below are checked in float64 against references written from Paddle's
# formulas (the file each comes from is named in the kernel's docstring).

LR64 = np.array([0.1])


def f64(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


def sparse_grad64(height: int = 5) -> SelectedRows:
    """Rows 1 and 3 of a [height, 2] grad, row 3 twice."""
    return SelectedRows([3, 1, 3], f64(3, 2), height)


def dense_error(op: str, ins: dict, outs: list[str], **attrs) -> None:
    with pytest.raises(ExecutionError, match=f"{op} takes only a dense Grad"):
        run_op(op, ins, outs, attrs=attrs)


# ---------------------------------------------------------------- lars_momentum

LARS_OUTS = ["ParamOut", "VelocityOut"]


def lars_reference(p, g, v, lr=0.1, mu=0.9, coeff=0.001, wd=0.0005, eps=0.0):
    p_norm, g_norm = np.linalg.norm(p), np.linalg.norm(g)
    local_lr = lr * coeff * p_norm / (g_norm + wd * p_norm + eps) if p_norm > 0 and g_norm > 0 else lr
    v = mu * v + local_lr * (g + wd * p)
    return p - v, v


def lars_step(p, g, v, **attrs):
    ins = {"Param": p, "Grad": g, "Velocity": v, "LearningRate": LR64}
    return run_op("lars_momentum", ins, LARS_OUTS, attrs={"mu": 0.9, **attrs})


def test_lars_momentum_two_steps_match_the_reference():
    p, v = f64(4, 3), np.zeros((4, 3))
    rp, rv = p, v
    for _ in range(2):
        g = f64(4, 3)
        out = lars_step(p, g, v, lars_coeff=0.01, lars_weight_decay=0.001)
        rp, rv = lars_reference(rp, g, rv, coeff=0.01, wd=0.001)
        p, v = out["ParamOut"], out["VelocityOut"]
    np.testing.assert_allclose(p, rp, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(v, rv, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("zero", ["Param", "Grad"])
def test_lars_momentum_falls_back_to_the_global_lr_on_a_zero_norm(zero):
    ins = {"Param": f64(3, 2), "Grad": f64(3, 2), "Velocity": f64(3, 2)}
    ins[zero] = np.zeros((3, 2))
    out = lars_step(ins["Param"], ins["Grad"], ins["Velocity"])
    v = 0.9 * ins["Velocity"] + 0.1 * (ins["Grad"] + 0.0005 * ins["Param"])
    np.testing.assert_allclose(out["VelocityOut"], v, rtol=1e-12)
    np.testing.assert_allclose(out["ParamOut"], ins["Param"] - v, rtol=1e-12)


def test_lars_momentum_paddle2_attrs_epsilon_rescale_and_per_param_decays():
    """Paddle 2.x: a merged op with one decay per param, `rescale_grad` scaling g, `epsilon`
    in the denominator, and the global lr kept where the decay is 0."""
    ps, gs, vs = [f64(3, 2), f64(4)], [f64(3, 2), f64(4)], [f64(3, 2), f64(4)]
    out = run_op(
        "lars_momentum",
        {"Param": ps, "Grad": gs, "Velocity": vs, "LearningRate": [LR64, np.array([0.2])]},
        {"ParamOut": 2, "VelocityOut": 2},
        attrs={"mu": 0.8, "lars_coeff": 0.01, "lars_weight_decay": [0.001, 0.0], "epsilon": 1e-3, "rescale_grad": 0.5},
    )
    p0, v0 = lars_reference(ps[0], 0.5 * gs[0], vs[0], mu=0.8, coeff=0.01, wd=0.001, eps=1e-3)
    v1 = 0.8 * vs[1] + 0.2 * (0.5 * gs[1])  # decay 0: Paddle 2.x keeps lr
    np.testing.assert_allclose(out["ParamOut"][0], p0, rtol=1e-12)
    np.testing.assert_allclose(out["VelocityOut"][0], v0, rtol=1e-12)
    np.testing.assert_allclose(out["ParamOut"][1], ps[1] - v1, rtol=1e-12)
    np.testing.assert_allclose(out["VelocityOut"][1], v1, rtol=1e-12)


def test_lars_momentum_fluid18_float_decay_of_zero_still_scales_the_lr():
    p, g, v = f64(3, 2), f64(3, 2), f64(3, 2)
    out = lars_step(p, g, v, lars_weight_decay=0.0)
    rp, rv = lars_reference(p, g, v, wd=0.0)
    np.testing.assert_allclose(out["ParamOut"], rp, rtol=1e-12)
    np.testing.assert_allclose(out["VelocityOut"], rv, rtol=1e-12)


def test_lars_momentum_keeps_float32_and_refuses_sparse_grads_and_a_missing_mu():
    ins = {"Param": f32(3, 2), "Grad": f32(3, 2), "Velocity": f32(3, 2), "LearningRate": LR}
    out = run_op("lars_momentum", ins, LARS_OUTS, attrs={"mu": 0.9})
    assert out["ParamOut"].dtype == np.float32 and out["VelocityOut"].dtype == np.float32
    sparse = {"Param": f64(5, 2), "Grad": sparse_grad64(), "Velocity": f64(5, 2), "LearningRate": LR64}
    dense_error("lars_momentum", sparse, LARS_OUTS, mu=0.9)
    with pytest.raises(ExecutionError, match="no attr 'mu'"):
        run_op("lars_momentum", ins, LARS_OUTS)


# ----------------------------------------------------------------------- adamax

ADAMAX_OUTS = ["ParamOut", "MomentOut", "InfNormOut"]


def adamax_reference(p, g, m, u, beta1_pow, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8):
    m = beta1 * m + (1 - beta1) * g
    u = np.maximum(beta2 * u + eps, np.abs(g))
    return p - lr / (1 - beta1_pow) * m / u, m, u


def adamax_step(p, g, m, u, beta1_pow, **attrs):
    ins = {"Param": p, "Grad": g, "LearningRate": LR64, "Moment": m, "InfNorm": u, "Beta1Pow": beta1_pow}
    return run_op("adamax", ins, ADAMAX_OUTS, attrs=attrs)


def test_adamax_three_steps_match_the_reference_and_leave_beta1_pow_alone():
    p, m, u = f64(4, 3), np.zeros((4, 3)), np.zeros((4, 3))
    beta1_pow = np.array([0.8])
    rp, rm, ru = p, m, u
    for _ in range(3):
        g, kept = f64(4, 3), beta1_pow.copy()
        out = adamax_step(p, g, m, u, beta1_pow, beta1=0.8, beta2=0.99, epsilon=1e-6)
        rp, rm, ru = adamax_reference(rp, g, rm, ru, float(beta1_pow[0]), beta1=0.8, beta2=0.99, eps=1e-6)
        np.testing.assert_array_equal(beta1_pow, kept)  # the kernel never writes it ...
        p, m, u = (out[k] for k in ADAMAX_OUTS)
        beta1_pow = beta1_pow * 0.8  # ... Fluid's `scale` op after it does
    for got, want in ((p, rp), (m, rm), (u, ru)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_adamax_keeps_float32_and_refuses_sparse_grads():
    out = run_op(
        "adamax",
        {"Param": f32(3, 2), "Grad": f32(3, 2), "LearningRate": LR, "Moment": f32(3, 2), "InfNorm": np.abs(f32(3, 2)),
         "Beta1Pow": np.array([0.9], np.float32)},
        ADAMAX_OUTS,
    )
    assert all(out[k].dtype == np.float32 for k in ADAMAX_OUTS)
    ins = {"Param": f64(5, 2), "Grad": sparse_grad64(), "LearningRate": LR64, "Moment": f64(5, 2),
           "InfNorm": f64(5, 2), "Beta1Pow": np.array([0.9])}
    dense_error("adamax", ins, ADAMAX_OUTS)


# -------------------------------------------------------------- decayed_adagrad


def test_decayed_adagrad_two_steps_match_the_reference():
    p, m = f64(4, 3), np.zeros((4, 3))
    rp, rm = p, m
    for _ in range(2):
        g = f64(4, 3)
        out = run_op(
            "decayed_adagrad", {"Param": p, "Grad": g, "Moment": m, "LearningRate": LR64}, ["ParamOut", "MomentOut"],
            attrs={"decay": 0.8, "epsilon": 1e-4},
        )
        rm = 0.8 * rm + 0.2 * g * g
        rp = rp - 0.1 * g / (np.sqrt(rm) + 1e-4)
        p, m = out["ParamOut"], out["MomentOut"]
    np.testing.assert_allclose(p, rp, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(m, rm, rtol=1e-12, atol=1e-15)


def test_decayed_adagrad_defaults_keep_float32_and_refuse_sparse_grads():
    p, g, m = f32(3, 2), f32(3, 2), np.abs(f32(3, 2))
    out = run_op("decayed_adagrad", {"Param": p, "Grad": g, "Moment": m, "LearningRate": LR}, ["ParamOut", "MomentOut"])
    m_out = 0.95 * m.astype(np.float64) + 0.05 * g.astype(np.float64) ** 2
    assert out["ParamOut"].dtype == np.float32
    np.testing.assert_allclose(out["MomentOut"], m_out, rtol=1e-5)
    np.testing.assert_allclose(out["ParamOut"], p - 0.1 * g / (np.sqrt(m_out) + 1e-6), rtol=1e-5)
    sparse = {"Param": f64(5, 2), "Grad": sparse_grad64(), "Moment": f64(5, 2), "LearningRate": LR64}
    dense_error("decayed_adagrad", sparse, ["ParamOut", "MomentOut"])


# ---------------------------------------------------------------------- rmsprop

RMSPROP_OUTS = ["ParamOut", "MomentOut", "MeanSquareOut", "MeanGradOut"]


def rmsprop_reference(p, g, ms, mom, mg, *, centered, lr=0.1, decay=0.9, eps=1e-10, momentum=0.0):
    ms = decay * ms + (1 - decay) * g**2
    if centered:
        mg = decay * mg + (1 - decay) * g
        mom = momentum * mom + lr * g / np.sqrt(ms - mg**2 + eps)
    else:
        mom = momentum * mom + lr * g / np.sqrt(ms + eps)
    return p - mom, mom, ms, mg


def rmsprop_step(p, g, ms, mom, mg, **attrs):
    ins = {"Param": p, "Grad": g, "MeanSquare": ms, "Moment": mom, "MeanGrad": mg, "LearningRate": LR64}
    return run_op("rmsprop", ins, RMSPROP_OUTS, attrs=attrs)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("centered", [False, True])
def test_rmsprop_two_steps_match_the_reference(centered, momentum):
    p, ms, mom, mg = f64(4, 3), np.abs(f64(4, 3)), f64(4, 3), 0.1 * f64(4, 3)
    state = (p, mom, ms, mg)
    reference = state
    attrs = {"decay": 0.8, "epsilon": 1e-6, "momentum": momentum, "centered": centered}
    for _ in range(2):
        g = f64(4, 3)
        out = rmsprop_step(state[0], g, state[2], state[1], state[3], **attrs)
        rp, rmom, rms, rmg = reference
        reference = rmsprop_reference(rp, g, rms, rmom, rmg, centered=centered, decay=0.8, eps=1e-6, momentum=momentum)
        state = (out["ParamOut"], out["MomentOut"], out["MeanSquareOut"], out["MeanGradOut"] if centered else mg)
    for got, want in zip(state, reference, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_rmsprop_uncentered_does_not_write_mean_grad_out():
    out = rmsprop_step(f64(3, 2), f64(3, 2), np.abs(f64(3, 2)), f64(3, 2), f64(3, 2))
    assert out["MeanGradOut"] is None


def test_rmsprop_sparse_updates_every_row_with_zero_grads_for_absent_rows():
    """rmsprop_op.h's SparseRmspropGradFunctor: the merged rows' grads, 0 elsewhere."""
    p, ms, mom, mg = f64(5, 2), np.abs(f64(5, 2)), f64(5, 2), 0.1 * f64(5, 2)
    g = sparse_grad64()
    attrs = {"momentum": 0.9, "centered": True}
    sparse = rmsprop_step(p, g, ms, mom, mg, **attrs)
    dense_g = np.zeros((5, 2))
    dense_g[3] = g.value[0] + g.value[2]
    dense_g[1] = g.value[1]
    expected = rmsprop_reference(p, dense_g, ms, mom, mg, centered=True, momentum=0.9)
    for slot, want in zip(["ParamOut", "MomentOut", "MeanSquareOut", "MeanGradOut"], expected, strict=True):
        np.testing.assert_allclose(sparse[slot], want, rtol=1e-12, atol=1e-15)
    assert not np.array_equal(sparse["ParamOut"][0], p[0])  # an absent row still moves by its momentum


def test_rmsprop_keeps_float32_and_needs_mean_grad_when_centered():
    ins = {
        "Param": f32(3, 2),
        "Grad": f32(3, 2),
        "MeanSquare": np.abs(f32(3, 2)),
        "Moment": f32(3, 2),
        "LearningRate": LR,
    }
    out = run_op("rmsprop", ins, RMSPROP_OUTS[:3])
    assert all(out[k].dtype == np.float32 for k in RMSPROP_OUTS[:3])
    with pytest.raises(ExecutionError, match="centered=True needs a MeanGrad"):
        run_op("rmsprop", ins, RMSPROP_OUTS[:3], attrs={"centered": True})


# ------------------------------------------------------------------------- ftrl

FTRL_OUTS = ["ParamOut", "SquaredAccumOut", "LinearAccumOut"]


def ftrl_reference(p, g, sq, lin, *, lr=0.1, l1=0.0, l2=0.0, lr_power=-0.5):
    """Element by element, as ftrl_op.h's SparseFTRLFunctor writes it."""
    p, sq, lin = p.copy(), sq.copy(), lin.copy()
    l1, l2 = l1 + 1e-10, l2 + 1e-10
    for j in np.ndindex(p.shape):
        new_sq = sq[j] + g[j] * g[j]
        if lr_power == -0.5:
            lin[j] += g[j] - (math.sqrt(new_sq) - math.sqrt(sq[j])) / lr * p[j]
            y = 2 * l2 + math.sqrt(new_sq) / lr
        else:
            lin[j] += g[j] - (new_sq ** -lr_power - sq[j] ** -lr_power) / lr * p[j]
            y = 2 * l2 + new_sq ** -lr_power / lr
        if abs(lin[j]) > l1:
            x = -lin[j] + l1 if lin[j] >= 0 else -lin[j] - l1
            p[j] = x / y
        else:
            p[j] = 0.0
        sq[j] = new_sq
    return p, sq, lin


def ftrl_step(p, g, sq, lin, **attrs):
    ins = {"Param": p, "Grad": g, "SquaredAccumulator": sq, "LinearAccumulator": lin, "LearningRate": LR64}
    return run_op("ftrl", ins, FTRL_OUTS, attrs=attrs)


@pytest.mark.parametrize(
    ("l1", "l2", "lr_power"), [(0.0, 0.0, -0.5), (0.5, 0.2, -0.5), (0.0, 0.0, -0.3), (0.5, 0.2, -0.3), (0.1, 0.1, 0.0)]
)
def test_ftrl_two_steps_match_the_reference(l1, l2, lr_power):
    p, sq, lin = f64(4, 3), np.abs(f64(4, 3)) + 0.1, f64(4, 3)
    attrs = {"l1": l1, "l2": l2, "lr_power": lr_power}
    ref = (p, sq, lin)
    for _ in range(2):
        g = f64(4, 3)
        out = ftrl_step(p, g, sq, lin, **attrs)
        ref = ftrl_reference(ref[0], g, ref[1], ref[2], **attrs)
        p, sq, lin = (out[k] for k in FTRL_OUTS)
    for got, want in zip((p, sq, lin), ref, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_ftrl_from_zero_accumulators_with_l1_makes_exact_zeros():
    """Fluid's Ftrl starts both accumulators at 0; a large l1 zeroes the weights whose
    linear accumulator stays within it."""
    p, g = f64(6, 4), f64(6, 4)
    zeros = np.zeros((6, 4))
    out = ftrl_step(p, g, zeros, zeros, l1=1.0)
    want = ftrl_reference(p, g, zeros, zeros, l1=1.0)
    for slot, w in zip(FTRL_OUTS, want, strict=True):
        np.testing.assert_allclose(out[slot], w, rtol=1e-12, atol=1e-15)
    assert 0 < np.count_nonzero(out["ParamOut"] == 0) < p.size


@pytest.mark.parametrize("lr_power", [-0.5, -0.3])
def test_ftrl_sparse_updates_only_the_merged_rows(lr_power):
    p, sq, lin = f64(5, 2), np.abs(f64(5, 2)) + 0.1, f64(5, 2)
    g = sparse_grad64()
    out = ftrl_step(p, g, sq, lin, l1=0.1, l2=0.2, lr_power=lr_power)
    rows = [1, 3]
    merged = np.stack([g.value[1], g.value[0] + g.value[2]])
    want = ftrl_reference(p[rows], merged, sq[rows], lin[rows], l1=0.1, l2=0.2, lr_power=lr_power)
    for slot, before, w in zip(FTRL_OUTS, (p, sq, lin), want, strict=True):
        np.testing.assert_allclose(out[slot][rows], w, rtol=1e-12, atol=1e-15)
        np.testing.assert_array_equal(out[slot][[0, 2, 4]], before[[0, 2, 4]])


def test_ftrl_keeps_float32():
    ins = {"Param": f32(3, 2), "Grad": f32(3, 2), "SquaredAccumulator": np.abs(f32(3, 2)),
           "LinearAccumulator": f32(3, 2), "LearningRate": LR}
    out = run_op("ftrl", ins, FTRL_OUTS, attrs={"l1": 0.1})
    assert all(out[k].dtype == np.float32 for k in FTRL_OUTS)


# --------------------------------------------------------------- whole programs

# every optimizer `optimizer_model` builds; test_optimizer_model_names keeps this complete
MODEL_OPTIMIZERS = ("sgd", "momentum", "adam", "adagrad", "decayed_adagrad", "ftrl", "rmsprop")


def test_optimizer_model_names():
    with pytest.raises(BuildError) as err:
        nets.optimizer_model("no such optimizer")
    assert err.value.reason.endswith(f"(known: {', '.join(MODEL_OPTIMIZERS)})")


@pytest.mark.parametrize("name", MODEL_OPTIMIZERS)
def test_optimizer_model_trains(name):
    """startup then a few main steps on a fixed batch: finite losses, every param moved,
    and the optimizer op really ran."""
    main, startup = nets.optimizer_model(name)
    block = main.global_block()
    assert name in [op.type for op in block.ops]
    (loss,) = next(op for op in block.ops if op.type == "mean").output("Out")
    exe, scope = Executor(seed=0), Scope()
    exe.run(startup, scope=scope)
    params = [p.name for p in main.all_parameters()]
    before = {n: np.array(scope.find_var(n).array) for n in params}
    rng = np.random.default_rng(0)
    x, y = 0.1 * rng.standard_normal((8, 1000)), rng.standard_normal((8, 1))
    feed = {"x": x.astype(np.float32), "y": y.astype(np.float32)}
    for _ in range(3):
        (value,) = exe.run(main, feed=feed, fetch_list=[loss], scope=scope)
        assert np.isfinite(value).all(), (name, value)
    for n in params:
        after = scope.find_var(n).array
        assert after.dtype == np.float32 and np.isfinite(after).all(), n
        assert not np.array_equal(after, before[n]), f"{name} did not change {n}"


def _sparse_sgd_program(allow_in_place: bool):
    """`sgd` writing `w` back to itself, after an op that sets the run's in-place flag
    as a sync pserver's `listen_and_serv` does."""
    from transpiler.ir import Program

    program = Program.empty()
    block = program.global_block()
    if allow_in_place:
        block.add_op("test_allow_in_place", {}, {}, {})
    block.add_op("sgd", {"Param": ["w"], "Grad": ["g"], "LearningRate": ["lr"]}, {"ParamOut": ["w"]}, {})
    return program


@pytest.mark.parametrize("allowed", [True, False], ids=["sync pserver", "elsewhere"])
def test_sparse_sgd_updates_the_param_in_place_only_where_the_run_allows_it(allowed):
    from ops.kernels import register, unregister
    from ops.tensor import LoDTensor

    @register("test_allow_in_place")
    def allow(ctx) -> None:
        ctx.run.update_in_place = True

    try:
        for param in (f32(5, 2), np.frombuffer(f32(5, 2).tobytes(), np.float32).reshape(5, 2)):  # owned, read-only
            keep, g = param.copy(), sparse_grad().merged()
            scope = Scope()
            scope.set_var("w", LoDTensor(param))
            feed = {"g": g, "lr": np.array([0.1], np.float32)}
            Executor().run(_sparse_sgd_program(allowed), feed=feed, scope=scope)
            out = scope.find_var("w").array
            expected = keep.copy()
            expected[g.rows] -= np.float32(0.1) * g.value
            np.testing.assert_array_equal(out, expected)
            in_place = allowed and param.flags.writeable
            assert np.shares_memory(out, param) == in_place
            if not in_place:
                np.testing.assert_array_equal(param, keep)
    finally:
        unregister("test_allow_in_place")


def test_dense_adam_in_place_gives_the_same_numbers_in_the_same_arrays():
    """Where the run allows it (a sync pserver), Adam writes the param and its moments
    into their own arrays: bit for bit what the copying update gives."""
    from ops.kernels import register, unregister
    from ops.tensor import LoDTensor
    from transpiler.ir import Program

    @register("test_allow_in_place_adam")
    def allow(ctx) -> None:
        ctx.run.update_in_place = True

    def run(allowed: bool):
        program = Program.empty()
        block = program.global_block()
        if allowed:
            block.add_op("test_allow_in_place_adam", {}, {}, {})
        block.add_op("adam", {"Param": ["w"], "Grad": ["g"], "LearningRate": ["lr"], "Moment1": ["m1"],
                              "Moment2": ["m2"], "Beta1Pow": ["b1p"], "Beta2Pow": ["b2p"]},
                     {"ParamOut": ["w"], "Moment1Out": ["m1"], "Moment2Out": ["m2"], "Beta1PowOut": ["b1p"],
                      "Beta2PowOut": ["b2p"]}, {})
        rng = np.random.default_rng(7)
        arrays = {name: rng.standard_normal((4, 3)).astype(np.float32) for name in ("w", "m1", "m2")}
        arrays["m2"] = np.abs(arrays["m2"])
        scope = Scope()
        for name, array in arrays.items():
            scope.set_var(name, LoDTensor(array))
        feed = {"g": rng.standard_normal((4, 3)).astype(np.float32), "lr": np.array([0.01], np.float32),
                "b1p": np.array([0.9], np.float32), "b2p": np.array([0.999], np.float32)}
        Executor().run(program, feed=feed, scope=scope)
        return arrays, {name: scope.find_var(name).array for name in arrays}

    try:
        before, copied = run(False)
        inputs, in_place = run(True)
        for name in ("w", "m1", "m2"):
            np.testing.assert_array_equal(in_place[name], copied[name])
            assert np.shares_memory(in_place[name], inputs[name]) and not np.shares_memory(copied[name], before[name])
    finally:
        unregister("test_allow_in_place_adam")


# A sparse update of the rows it touches alone, on a sync pserver: (op, state inputs -> outputs,
# attrs). Adagrad, FTRL and lazy Adam write those rows into the param and state themselves.
SPARSE_ROW_UPDATES = [
    ("adagrad", {"Moment": "MomentOut"}, {"epsilon": 1e-6}),
    ("ftrl", {"SquaredAccumulator": "SquaredAccumOut", "LinearAccumulator": "LinearAccumOut"},
     {"l1": 0.1, "l2": 0.2, "lr_power": -0.5}),
    ("adam", {"Moment1": "Moment1Out", "Moment2": "Moment2Out"}, {"lazy_mode": True}),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("op", "state", "attrs"), SPARSE_ROW_UPDATES, ids=[case[0] for case in SPARSE_ROW_UPDATES])
def test_sparse_row_updates_in_place_give_the_same_bits_in_the_same_arrays(op, state, attrs, dtype):
    """Where the run allows it (a sync pserver), a sparse Adagrad / FTRL / lazy Adam writes the
    grad's rows (duplicates merged first) into the param and its state, without copying them:
    three steps bit for bit what the copying update gives, rows without a grad untouched."""
    from ops.kernels import register, unregister
    from ops.tensor import LoDTensor
    from transpiler.ir import Program

    @register("test_allow_in_place_rows")
    def allow(ctx) -> None:
        ctx.run.update_in_place = True

    extra_in = {"Beta1Pow": "Beta1PowOut", "Beta2Pow": "Beta2PowOut"} if op == "adam" else {}

    def run(allowed: bool):
        program = Program.empty()
        block = program.global_block()
        if allowed:
            block.add_op("test_allow_in_place_rows", {}, {}, {})
        names = {"Param": "ParamOut", **state, **extra_in}
        inputs = {slot: [slot.lower()] for slot in names} | {"Grad": ["g"], "LearningRate": ["lr"]}
        outputs = {out: [slot.lower()] for slot, out in names.items()}
        block.add_op(op, inputs, outputs, attrs)
        rng = np.random.default_rng(11)
        arrays = {slot.lower(): rng.standard_normal((6, 3)).astype(dtype) for slot in ("Param", *state)}
        for slot in state:
            if slot != "LinearAccumulator" and slot != "Moment1":
                arrays[slot.lower()] = np.abs(arrays[slot.lower()])
        scope = Scope()
        for name, array in arrays.items():
            scope.set_var(name, LoDTensor(array))
        kept = {name: array.copy() for name, array in arrays.items()}
        if op == "adam":
            for name, value in (("beta1pow", 0.9), ("beta2pow", 0.999)):
                scope.set_var(name, LoDTensor(np.array([value], dtype)))
        for step in range(3):
            grad = SelectedRows([4, 1, 4, 0][: 3 + step % 2], rng.standard_normal((3 + step % 2, 3)).astype(dtype), 6)
            Executor().run(program, feed={"g": grad, "lr": np.array([0.1], dtype)}, scope=scope)
        return arrays, kept, {name: scope.find_var(name).array for name in arrays}

    try:
        before, _, copied = run(False)
        inputs, kept, in_place = run(True)
        for name in inputs:
            np.testing.assert_array_equal(in_place[name], copied[name])
            assert in_place[name].dtype == dtype
            assert np.shares_memory(in_place[name], inputs[name]) and not np.shares_memory(copied[name], before[name])
            np.testing.assert_array_equal(in_place[name][[2, 3, 5]], kept[name][[2, 3, 5]])  # no grad: untouched
            assert not np.array_equal(in_place[name][[0, 1, 4]], kept[name][[0, 1, 4]])
    finally:
        unregister("test_allow_in_place_rows")


# -------------------------------------------------------------- adamw, lamb vs Paddle 2.6

PADDLE_STEPS = 3
# (name, op, attrs): every branch of the two kernels (decay on / off with lr_ratio, LAMB's
# ratio with and without weight decay, always_adapt).
# Paddle's float attrs are float32: the cases use float32 values so both sides see the same.
# Paddle's CPU kernel ignores `lr_ratio` (its Python API refuses it off GPU); ours applies
# it as the GPU kernel does (test_adamw_without_decay_is_adam_at_the_scaled_lr).
PADDLE_CASES = [
    (name, op, {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in attrs.items()})
    for name, op, attrs in [
        ("adamw_decay", "adamw", {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "coeff": 0.01, "with_decay": True}),
        ("adamw_decay_strong", "adamw", {"beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6, "coeff": 0.3,
                                         "with_decay": True}),
        ("adamw_no_decay", "adamw", {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "coeff": 0.3,
                                     "with_decay": False}),
        ("lamb_decay", "lamb", {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-6, "weight_decay": 0.01}),
        ("lamb_no_decay", "lamb", {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-6, "weight_decay": 0.0}),
        ("lamb_no_decay_always_adapt", "lamb", {"beta1": 0.85, "beta2": 0.98, "epsilon": 1e-6, "weight_decay": 0.0,
                                                "always_adapt": True}),
    ]
]
STATE_SLOTS = ("Param", "Moment1", "Moment2", "Beta1Pow", "Beta2Pow")


def paddle_case_inputs(name: str, attrs: dict) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(sum(map(ord, name)))
    shape = (6, 5)
    given = {
        "Param": rng.standard_normal(shape),
        "Moment1": np.zeros(shape),
        "Moment2": np.zeros(shape),
        "Beta1Pow": np.array([attrs["beta1"]], np.float64),
        "Beta2Pow": np.array([attrs["beta2"]], np.float64),  # float32 values: see PADDLE_CASES
        "LearningRate": np.array([0.05], np.float64),
    }
    for k in range(PADDLE_STEPS):
        given[f"Grad{k}"] = rng.standard_normal(shape)
    return given


def ours_after_steps(op: str, attrs: dict, given: dict) -> dict[str, np.ndarray]:
    state = {slot: given[slot] for slot in STATE_SLOTS}
    for k in range(PADDLE_STEPS):
        out = run_op(op, {**state, "LearningRate": given["LearningRate"], "Grad": given[f"Grad{k}"]},
                     [f"{slot}Out" for slot in STATE_SLOTS], attrs=attrs)
        state = {slot: np.asarray(out[f"{slot}Out"]) for slot in STATE_SLOTS}
    return state


@pytest.fixture(scope="module")
def paddle_optimizer_results(tmp_path_factory):
    """Paddle 2.6.2's adamw / lamb kernels on every case, in one Paddle subprocess."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tools.paddle_env import installed

    python = installed("2.6.2")
    if python is None:
        pytest.skip("Paddle 2.6.2's venv is not on this machine (python tools/paddle_env.py 2.6.2 makes it)")
    folder = tmp_path_factory.mktemp("paddle_optimizers")
    given = {}
    for name, _, attrs in PADDLE_CASES:
        given.update({f"{name}/{k}": v for k, v in paddle_case_inputs(name, attrs).items()})
    np.savez(folder / "in.npz", **given)
    cases = [{"name": name, "type": op, "attrs": attrs, "steps": PADDLE_STEPS} for name, op, attrs in PADDLE_CASES]
    (folder / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run(
        [str(python), str(Path(__file__).with_name("paddle_optimizer_steps.py")), str(folder / "cases.json"),
         str(folder / "in.npz"), str(folder / "out.npz")],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", "GLOG_minloglevel": "2"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(folder / "out.npz"))


@pytest.mark.parametrize("name, op, attrs", PADDLE_CASES, ids=[c[0] for c in PADDLE_CASES])
def test_adamw_and_lamb_match_paddle_2_6_kernels(name, op, attrs, paddle_optimizer_results):
    """Three float64 steps of our kernel and of Paddle 2.6.2's, state fed back: equal to 1e-14."""
    given = paddle_case_inputs(name, attrs)
    ours = ours_after_steps(op, attrs, given)
    assert np.abs(ours["Param"] - given["Param"]).max() > 1e-3  # the steps moved the param
    for slot in STATE_SLOTS:
        theirs = paddle_optimizer_results[f"{name}/{slot}Out"]
        np.testing.assert_allclose(ours[slot], theirs.reshape(ours[slot].shape), rtol=1e-14, atol=0,
                                   err_msg=f"{name}: {slot}")


def test_adamw_without_decay_is_adam_at_the_scaled_lr():
    p, g = f64(4, 3), f64(4, 3)
    z = np.zeros((4, 3))
    b1p, b2p = np.array([0.9]), np.array([0.999])
    ins = {"Param": p, "Grad": g, "LearningRate": np.array([0.2]), "Moment1": z, "Moment2": z, "Beta1Pow": b1p,
           "Beta2Pow": b2p}
    ours = run_op("adamw", ins, ADAM_OUTS, attrs={"with_decay": False, "lr_ratio": 0.5, "coeff": 0.5})
    expected = adam_reference(p, g, z, z, 0.9, 0.999, lr=0.1)
    np.testing.assert_allclose(ours["ParamOut"], expected[0], rtol=1e-13)
    decayed = run_op("adamw", ins, ADAM_OUTS, attrs={"with_decay": True, "lr_ratio": 0.5, "coeff": 0.5})
    expected = adam_reference(p * (1 - 0.1 * 0.5), g, z, z, 0.9, 0.999, lr=0.1)
    np.testing.assert_allclose(decayed["ParamOut"], expected[0], rtol=1e-13)
    np.testing.assert_array_equal(decayed["Beta1PowOut"], b1p * 0.9)


def test_lamb_trust_ratio_is_one_on_a_zero_norm_and_refuses_sparse_grads():
    z = np.zeros((3, 2))
    ins = {"Param": z, "Grad": f64(3, 2), "LearningRate": np.array([0.1]), "Moment1": z, "Moment2": z,
           "Beta1Pow": np.array([0.9]), "Beta2Pow": np.array([0.999])}
    out = run_op("lamb", ins, ADAM_OUTS, attrs={"weight_decay": 0.01})
    m1 = 0.1 * ins["Grad"]
    m2 = 0.001 * ins["Grad"] ** 2
    update = (m1 / 0.1) / (np.sqrt(m2 / 0.001) + 1e-6)
    np.testing.assert_allclose(out["ParamOut"], -0.1 * update, rtol=1e-13)  # |p| = 0: ratio 1
    with pytest.raises(ExecutionError, match="dense Grad"):
        run_op("lamb", {**ins, "Grad": sparse_grad64(3)}, ADAM_OUTS, attrs={"weight_decay": 0.01})


# ------------------------------------------------- lars / lamb on blocks, with the whole norms


def test_lamb_and_lars_on_blocks_with_the_summed_squared_norms_equal_the_whole_param():
    """What two pservers holding a param's two blocks compute: [|p|^2, |r|^2] per block
    (lamb_squared_norms; LARS: |p|^2, |g|^2), summed, fed back as SquaredNorms."""
    p, g = f64(6, 4), f64(6, 4)
    m1, m2 = f64(6, 4) * 0.1, np.abs(f64(6, 4)) * 0.01
    b1p, b2p = np.array([0.81]), np.array([0.998])
    lamb_attrs = {"weight_decay": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-6}
    whole = run_op("lamb", {"Param": p, "Grad": g, "LearningRate": LR64, "Moment1": m1, "Moment2": m2,
                            "Beta1Pow": b1p, "Beta2Pow": b2p}, ADAM_OUTS, attrs=lamb_attrs)
    rows = (slice(0, 4), slice(4, 6))
    state = [{"Param": p[r], "Grad": g[r], "Moment1": m1[r], "Moment2": m2[r], "Beta1Pow": b1p, "Beta2Pow": b2p}
             for r in rows]
    partials = [run_op("lamb_squared_norms", s, ["Out"], attrs=lamb_attrs)["Out"] for s in state]
    total = partials[0] + partials[1]
    blocks = [run_op("lamb", {**s, "LearningRate": LR64, "SquaredNorms": total}, ADAM_OUTS, attrs=lamb_attrs)
              for s in state]
    np.testing.assert_allclose(np.concatenate([b["ParamOut"] for b in blocks]), whole["ParamOut"], rtol=1e-13)
    alone = run_op("lamb", {**state[0], "LearningRate": LR64}, ADAM_OUTS, attrs=lamb_attrs)["ParamOut"]
    assert np.abs(alone - whole["ParamOut"][rows[0]]).max() > 1e-6  # a block's own norms would not do

    v = f64(6, 4) * 0.1
    lars_attrs = {"mu": 0.9, "lars_coeff": 0.001, "lars_weight_decay": 0.0005}
    whole = run_op("lars_momentum", {"Param": p, "Grad": g, "Velocity": v, "LearningRate": LR64},
                   ["ParamOut", "VelocityOut"], attrs=lars_attrs)
    squared = np.array([np.sum(p * p), np.sum(g * g)])
    blocks = [run_op("lars_momentum", {"Param": p[r], "Grad": g[r], "Velocity": v[r], "LearningRate": LR64,
                                       "SquaredNorms": squared}, ["ParamOut", "VelocityOut"], attrs=lars_attrs)
              for r in rows]
    np.testing.assert_allclose(np.concatenate([b["ParamOut"] for b in blocks]), whole["ParamOut"], rtol=1e-13)


# ------------------------------------------- sparse row updates vs Paddle 2.6, duplicate rows

# (Paddle 2.6's CPU build registers no ftrl kernel: ftrl's sparse rule is checked against
# ftrl_op.h's SparseFTRLFunctor by hand above, `test_ftrl_sparse_updates_only_the_merged_rows`.)
SPARSE_PADDLE_CASES = [
    ("adagrad", "adagrad", {"Param": "ParamOut", "Moment": "MomentOut"}, {"epsilon": 1e-6}),
    ("adam_lazy", "adam", {"Param": "ParamOut", "Moment1": "Moment1Out", "Moment2": "Moment2Out",
                           "Beta1Pow": "Beta1PowOut", "Beta2Pow": "Beta2PowOut"},
     {"lazy_mode": True, "beta1": 0.875, "beta2": 1 - 2**-10, "epsilon": 2**-20}),  # exact in float32 attrs
]
# Paddle 2.6's CPU sparse Adam, its Beta1PowOut the Beta1Pow var itself (as Fluid's `Adam`
# builds it), advances the beta powers before the rows' update reads them (its lr_t is the
# next step's); the dense kernel, and ours both ways, read them first. The comparison gives
# Paddle separate out vars for the powers, so that its rows' rule is what is compared.
SEPARATE_OUTS = {"adam_lazy": ["Beta1Pow", "Beta2Pow"]}
SPARSE_ROWS = ([4, 1, 4, 0], [2, 2, 2], [5, 0, 5, 1, 0])  # a row repeated in every step's grad


def sparse_case_inputs(name: str, state: dict) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(len(name))
    given = {}
    for slot in state:
        if slot in ("Beta1Pow", "Beta2Pow"):
            given[slot] = np.array([0.9 if slot == "Beta1Pow" else 0.999])
        else:
            given[slot] = rng.standard_normal((7, 3))
            if slot in ("Moment", "SquaredAccumulator", "Moment2"):
                given[slot] = np.abs(given[slot]) + 0.1
    given["LearningRate"] = np.array([0.05])
    for k, rows in enumerate(SPARSE_ROWS):
        given[f"rows{k}"] = np.array(rows, np.int64)
        given[f"value{k}"] = rng.standard_normal((len(rows), 3))
    return given


def ours_sparse_in_place(op: str, state: dict, attrs: dict, given: dict) -> dict[str, np.ndarray]:
    """The steps through the executor, the run allowing in-place updates (a sync pserver)."""
    from ops.kernels import register, unregister
    from ops.tensor import LoDTensor
    from transpiler.ir import Program

    @register("test_allow_in_place_paddle")
    def allow(ctx) -> None:
        ctx.run.update_in_place = True

    try:
        program = Program.empty()
        block = program.global_block()
        block.add_op("test_allow_in_place_paddle", {}, {}, {})
        block.add_op(op, {**{slot: [slot] for slot in state}, "Grad": ["g"], "LearningRate": ["lr"]},
                     {out: [slot] for slot, out in state.items()}, attrs)
        scope = Scope()
        for slot in state:
            scope.set_var(slot, LoDTensor(given[slot].copy()))
        for k in range(len(SPARSE_ROWS)):
            grad = SelectedRows(given[f"rows{k}"], given[f"value{k}"], 7)
            Executor().run(program, feed={"g": grad, "lr": given["LearningRate"]}, scope=scope)
        return {slot: scope.find_var(slot).array for slot in state}
    finally:
        unregister("test_allow_in_place_paddle")


@pytest.fixture(scope="module")
def paddle_sparse_results(tmp_path_factory):
    """Paddle 2.6.2's sparse adagrad / lazy adam kernels on every case, in one subprocess."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tools.paddle_env import installed

    python = installed("2.6.2")
    if python is None:
        pytest.skip("Paddle 2.6.2's venv is not on this machine (python tools/paddle_env.py 2.6.2 makes it)")
    folder = tmp_path_factory.mktemp("paddle_sparse_optimizers")
    given = {}
    for name, _, state, _ in SPARSE_PADDLE_CASES:
        given.update({f"{name}/{k}": v for k, v in sparse_case_inputs(name, state).items()})
    np.savez(folder / "in.npz", **given)
    cases = [{"name": name, "type": op, "attrs": attrs, "state": state, "steps": len(SPARSE_ROWS),
              "separate": SEPARATE_OUTS.get(name, [])} for name, op, state, attrs in SPARSE_PADDLE_CASES]
    (folder / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run(
        [str(python), str(Path(__file__).with_name("paddle_sparse_optimizer_steps.py")), str(folder / "cases.json"),
         str(folder / "in.npz"), str(folder / "out.npz")],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", "GLOG_minloglevel": "2"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(folder / "out.npz"))


@pytest.mark.parametrize("name, op, state, attrs", SPARSE_PADDLE_CASES, ids=[c[0] for c in SPARSE_PADDLE_CASES])
def test_sparse_row_updates_in_place_match_paddle_2_6_with_duplicate_rows(name, op, state, attrs,
                                                                          paddle_sparse_results):
    """Three float64 steps of a SelectedRows grad with repeated rows (merged first, as Paddle
    does), written in place: Paddle 2.6.2's kernels give the same state to 1e-14, and the
    rows no grad named (3 and 6) keep their values in both."""
    given = sparse_case_inputs(name, state)
    ours = ours_sparse_in_place(op, state, attrs, given)
    for slot in state:
        theirs = paddle_sparse_results[f"{name}/{slot}"].reshape(ours[slot].shape)
        np.testing.assert_allclose(ours[slot], theirs, rtol=1e-14, atol=1e-15, err_msg=f"{name}: {slot}")
        if ours[slot].shape[0] == 7:
            np.testing.assert_array_equal(theirs[[3, 6]], given[slot][[3, 6]])
            assert not np.allclose(theirs[[0, 1, 2, 4, 5]], given[slot][[0, 1, 2, 4, 5]])
