"""Forward semantics of the loss kernels."""

from __future__ import annotations

import numpy as np
import pytest

from ops.executor import ExecutionError
from ops.testing import run_op

RNG = np.random.default_rng(3)


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_softmax_with_cross_entropy_hard_label():
    logits = RNG.standard_normal((4, 5)).astype(np.float32)
    label = np.array([[1], [0], [4], [2]], np.int64)
    out = run_op("softmax_with_cross_entropy", {"Logits": logits, "Label": label}, ["Softmax", "Loss"])
    sm = softmax(logits.astype(np.float64))
    assert out["Loss"].shape == (4, 1) and out["Loss"].dtype == np.float32
    np.testing.assert_allclose(out["Softmax"], sm, rtol=1e-5)
    np.testing.assert_allclose(out["Loss"][:, 0], -np.log(sm[np.arange(4), label[:, 0]]), rtol=1e-5)


def test_softmax_with_cross_entropy_ignore_index_rows_are_zero():
    logits = RNG.standard_normal((3, 4)).astype(np.float32)
    label = np.array([[1], [-100], [2]], np.int64)
    out = run_op("softmax_with_cross_entropy", {"Logits": logits, "Label": label}, ["Softmax", "Loss"])
    assert out["Loss"][1, 0] == 0
    grad = run_op(
        "softmax_with_cross_entropy_grad",
        {"Label": label, "Softmax": out["Softmax"], "Loss@GRAD": np.ones((3, 1), np.float32)},
        ["Logits@GRAD"],
    )["Logits@GRAD"]
    np.testing.assert_array_equal(grad[1], 0)
    expected = out["Softmax"][0].copy()
    expected[1] -= 1
    np.testing.assert_allclose(grad[0], expected, rtol=1e-6)


def test_softmax_with_cross_entropy_soft_label():
    logits = RNG.standard_normal((2, 3))
    label = np.array([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    out = run_op(
        "softmax_with_cross_entropy", {"Logits": logits, "Label": label}, ["Softmax", "Loss"], attrs={"soft_label": True}
    )
    np.testing.assert_allclose(out["Loss"][:, 0], -(label * np.log(softmax(logits))).sum(1), rtol=1e-10)


def test_softmax_with_cross_entropy_label_out_of_range():
    with pytest.raises(ExecutionError, match="label 7 is out of range"):
        run_op(
            "softmax_with_cross_entropy",
            {"Logits": np.zeros((1, 3), np.float32), "Label": np.array([[7]], np.int64)},
            ["Softmax", "Loss"],
        )


def test_cross_entropy_v1_hard_and_tolerable_log():
    x = np.array([[0.2, 0.8], [1.0, 0.0]], np.float32)
    y = run_op("cross_entropy", {"X": x, "Label": np.array([[1], [1]], np.int64)}, ["Y"])["Y"]
    np.testing.assert_allclose(y[:, 0], [-np.log(0.8), 1e20], rtol=1e-6)


def test_cross_entropy2_outputs_match_x_and_xshape():
    x = np.array([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25]], np.float32)
    label = np.array([[1], [0]], np.int64)
    out = run_op("cross_entropy2", {"X": x, "Label": label}, ["Y", "MatchX", "XShape"])
    np.testing.assert_allclose(out["MatchX"][:, 0], [0.6, 0.5])
    np.testing.assert_allclose(out["Y"][:, 0], -np.log([0.6, 0.5]), rtol=1e-6)
    assert out["XShape"].shape == (2, 3, 0)  # Paddle: X's dims + [0]
    grad = run_op(
        "cross_entropy_grad2",
        {"Label": label, "MatchX": out["MatchX"], "XShape": out["XShape"], "Y@GRAD": np.ones((2, 1), np.float32)},
        ["X@GRAD"],
    )["X@GRAD"]
    np.testing.assert_allclose(grad, [[0, -1 / 0.6, 0], [-2, 0, 0]], rtol=1e-6)
