"""Optimizer kernels against hand-written update rules, dense and SelectedRows grads."""

from __future__ import annotations

import numpy as np
import pytest

from ops.executor import ExecutionError
from ops.kernels.testing import run_op
from ops.tensor import SelectedRows

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


def test_adam_refuses_a_selected_rows_param():
    table = SelectedRows([], np.zeros((4, 2), np.float32), 100)
    with pytest.raises(ExecutionError, match="only sgd"):
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
