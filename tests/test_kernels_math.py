"""Forward semantics of the math kernels against hand-computed numpy references."""

from __future__ import annotations

import numpy as np
import pytest

from ops.executor import ExecutionError
from ops.testing import run_op
from ops.tensor import LoDTensor, SelectedRows
from transpiler.ir import Attr, AttrType

RNG = np.random.default_rng(7)


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize(
    ("op", "ref"),
    [
        ("elementwise_add", np.add),
        ("elementwise_sub", np.subtract),
        ("elementwise_mul", np.multiply),
        ("elementwise_div", np.divide),
        ("elementwise_max", np.maximum),
        ("elementwise_min", np.minimum),
    ],
)
def test_elementwise_same_shape(op, ref):
    x, y = f32(3, 4), f32(3, 4) + 3
    out = run_op(op, {"X": x, "Y": y})["Out"]
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, ref(x, y))


def test_elementwise_axis_aligns_y_inside_x():
    x, y = f32(2, 3, 4), f32(3)
    out = run_op("elementwise_add", {"X": x, "Y": y}, attrs={"axis": 1})["Out"]
    np.testing.assert_array_equal(out, x + y[None, :, None])


def test_elementwise_axis_trims_trailing_ones_as_paddle18():
    x, y = f32(2, 3, 4), f32(3, 1)
    out = run_op("elementwise_mul", {"X": x, "Y": y}, attrs={"axis": 1})["Out"]
    np.testing.assert_array_equal(out, x * y.reshape(1, 3, 1))


def test_elementwise_sub_broadcasts_label_column_like_square_error_cost():
    pred, label = f32(5, 1000), f32(5, 1)
    out = run_op("elementwise_sub", {"X": pred, "Y": label}, attrs={"axis": -1})["Out"]
    np.testing.assert_array_equal(out, pred - label)


def test_elementwise_bad_axis_is_an_execution_error():
    with pytest.raises(ExecutionError, match=r"elementwise_add.*\n.*X=X float32\[2, 3\]; Y=Y float32\[4\]"):
        run_op("elementwise_add", {"X": f32(2, 3), "Y": f32(4)}, attrs={"axis": 1})


def test_elementwise_integer_div_truncates_toward_zero():
    x, y = np.array([-7, 7, 9], np.int64), np.array([2, 2, -4], np.int64)
    np.testing.assert_array_equal(run_op("elementwise_div", {"X": x, "Y": y})["Out"], [-3, 3, -2])


def test_elementwise_pow_for_exponential_decay():
    base, exponent = np.array([0.1], np.float32), np.array([3.0], np.float32)
    out = run_op("elementwise_pow", {"X": base, "Y": exponent})["Out"]
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [0.001], rtol=1e-6)


def test_elementwise_output_keeps_x_lod():
    x = LoDTensor(f32(5, 2), [[0, 2, 5]])
    out = run_op("elementwise_add", {"X": x, "Y": f32(2)}, raw=True)["Out"]
    assert out.lod_lists() == [[0, 2, 5]]


@pytest.mark.parametrize(
    ("op", "ref"),
    [
        ("relu", lambda x: np.maximum(x, 0)),
        ("tanh", np.tanh),
        ("sigmoid", lambda x: 1 / (1 + np.exp(-x))),
        ("square", np.square),
        ("exp", np.exp),
        ("abs", np.abs),
        ("floor", np.floor),
    ],
)
def test_activations(op, ref):
    x = f32(4, 5)
    out = run_op(op, {"X": x})["Out"]
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, ref(x), rtol=1e-6)


def test_sqrt_and_log():
    x = np.abs(f32(3, 3)) + 0.1
    np.testing.assert_allclose(run_op("sqrt", {"X": x})["Out"], np.sqrt(x), rtol=1e-6)
    np.testing.assert_allclose(run_op("log", {"X": x})["Out"], np.log(x), rtol=1e-6)


def test_relu_grad_reads_out():
    out, dout = np.array([[0.0, 2.0, 0.0, 1.0]], np.float32), np.array([[5.0, 6.0, 7.0, 8.0]], np.float32)
    got = run_op("relu_grad", {"Out": out, "Out@GRAD": dout}, ["X@GRAD"])["X@GRAD"]
    np.testing.assert_array_equal(got, [[0, 6, 0, 8]])


def test_mul_flattens_by_num_col_dims():
    x, y = f32(2, 3, 4), f32(4, 5)
    out = run_op("mul", {"X": x, "Y": y}, attrs={"x_num_col_dims": 2, "y_num_col_dims": 1})["Out"]
    assert out.shape == (2, 3, 5)
    np.testing.assert_allclose(out, (x.reshape(6, 4) @ y).reshape(2, 3, 5), rtol=1e-6)


def test_mul_defaults_to_num_col_dims_1():
    x, y = f32(2, 3, 4), f32(12, 2)
    out = run_op("mul", {"X": x, "Y": y})["Out"]
    np.testing.assert_allclose(out, x.reshape(2, 12) @ y, rtol=1e-5)


def test_mul_grad_skips_absent_x_grad():
    x, y, dout = f32(3, 4), f32(4, 2), f32(3, 2)
    got = run_op("mul_grad", {"X": x, "Y": y, "Out@GRAD": dout}, ["Y@GRAD"])
    np.testing.assert_allclose(got["Y@GRAD"], x.T @ dout, rtol=1e-5)


def test_mean_is_shape_1_by_default_and_0d_when_declared():
    x = f32(4, 3)
    old = run_op("mean", {"X": x})["Out"]
    assert old.shape == (1,)
    np.testing.assert_allclose(old, [x.mean()], rtol=1e-6)
    new = run_op("mean", {"X": x}, output_shapes={"Out": ()})["Out"]
    assert new.shape == ()


def test_mean_grad_spreads_evenly():
    x = f32(2, 5)
    got = run_op("mean_grad", {"X": x, "Out@GRAD": np.array([2.0], np.float32)}, ["X@GRAD"])["X@GRAD"]
    np.testing.assert_allclose(got, np.full((2, 5), 0.2), rtol=1e-6)


@pytest.mark.parametrize(
    ("attrs", "ref"),
    [
        ({"dim": [1], "keep_dim": False}, lambda x: x.mean(axis=1)),
        ({"dim": [-1], "keep_dim": True}, lambda x: x.mean(axis=-1, keepdims=True)),
        ({"dim": [0, 2]}, lambda x: x.mean(axis=(0, 2))),
        ({"dim": Attr.of([], AttrType.INTS), "reduce_all": False}, lambda x: np.asarray([x.mean()])),  # Paddle 2.x: empty dim = all
        ({"reduce_all": True}, lambda x: np.asarray([x.mean()])),
    ],
)
def test_reduce_mean(attrs, ref):
    x = f32(2, 3, 4)
    np.testing.assert_allclose(run_op("reduce_mean", {"X": x}, attrs=attrs)["Out"], ref(x), rtol=1e-5)


def test_reduce_sum_all_follows_declared_0d_shape():
    x = f32(3, 4)
    out = run_op("reduce_sum", {"X": x}, attrs={"reduce_all": True}, output_shapes={"Out": ()})["Out"]
    assert out.shape == ()
    np.testing.assert_allclose(out, x.sum(), rtol=1e-5)


def test_scale_bias_after_and_before():
    x = f32(3)
    after = run_op("scale", {"X": x}, attrs={"scale": 2.0, "bias": 1.0})["Out"]
    before = run_op("scale", {"X": x}, attrs={"scale": 2.0, "bias": 1.0, "bias_after_scale": False})["Out"]
    np.testing.assert_allclose(after, 2 * x + 1, rtol=1e-6)
    np.testing.assert_allclose(before, 2 * (x + 1), rtol=1e-6)
    assert after.dtype == np.float32


def test_scale_tensor_overrides_attr():
    x = f32(3)
    out = run_op("scale", {"X": x, "ScaleTensor": np.array([3.0], np.float32)}, attrs={"scale": 2.0})["Out"]
    np.testing.assert_allclose(out, 3 * x, rtol=1e-6)


def test_scale_keeps_selected_rows():
    sr = SelectedRows([4, 1], np.ones((2, 3), np.float32), 10)
    out = run_op("scale", {"X": sr}, attrs={"scale": 0.5})["Out"]
    assert isinstance(out, SelectedRows)
    np.testing.assert_array_equal(out.rows, [4, 1])
    assert out.height == 10
    np.testing.assert_array_equal(out.value, np.full((2, 3), 0.5))


def test_scale_on_integers_casts_the_factor():
    out = run_op("scale", {"X": np.array([3, 4], np.int64)}, attrs={"scale": 2.0, "bias": 1.0})["Out"]
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, [7, 9])


def test_sum_dense():
    a, b, c = f32(2, 3), f32(2, 3), f32(2, 3)
    out = run_op("sum", {"X": [a, b, c]})["Out"]
    np.testing.assert_allclose(out, a + b + c, rtol=1e-6)


def test_sum_dense_does_not_write_into_its_first_input():
    a, b = f32(2, 2), f32(2, 2)
    keep = a.copy()
    run_op("sum", {"X": [a, b]})
    np.testing.assert_array_equal(a, keep)


def test_sum_selected_rows_merges_duplicates_and_sorts_rows():
    a = SelectedRows([5, 1, 5], np.array([[1.0], [2.0], [3.0]], np.float32), 8)
    b = SelectedRows([1, 7], np.array([[10.0], [20.0]], np.float32), 8)
    out = run_op("sum", {"X": [a, b]})["Out"]
    assert isinstance(out, SelectedRows)
    np.testing.assert_array_equal(out.rows, [1, 5, 7])
    np.testing.assert_array_equal(out.value[:, 0], [12.0, 4.0, 20.0])
    assert out.height == 8
    np.testing.assert_array_equal(out.to_dense(), a.to_dense() + b.to_dense())


def test_sum_mixed_dense_and_selected_rows_is_dense():
    dense = f32(4, 2)
    sr = SelectedRows([3, 3], np.ones((2, 2), np.float32), 4)
    out = run_op("sum", {"X": [dense, sr]})["Out"]
    expected = dense.copy()
    expected[3] += 2
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_clip():
    x = np.array([-2.0, -0.5, 0.3, 4.0], np.float32)
    np.testing.assert_array_equal(run_op("clip", {"X": x}, attrs={"min": -1.0, "max": 1.0})["Out"], np.float32([-1, -0.5, 0.3, 1]))


def test_clip_by_norm_scales_down_only_above_the_norm():
    x = np.array([[3.0, 4.0]], np.float32)  # norm 5
    assert np.allclose(run_op("clip_by_norm", {"X": x}, attrs={"max_norm": 1.0})["Out"], [[0.6, 0.8]])
    out = run_op("clip_by_norm", {"X": x}, attrs={"max_norm": 5.0})["Out"]
    assert np.array_equal(out, x) and out.dtype == np.float32


def test_clip_by_norm_of_a_block_with_the_whole_grads_squared_norm():
    """A pserver's block of a grad clips by the whole grad's norm (SquaredNorm, summed
    across the pservers): the blocks, concatenated, are the whole grad clipped."""
    rng = np.random.default_rng(2)
    g = rng.standard_normal((6, 3))
    whole = run_op("clip_by_norm", {"X": g}, ["Out"], attrs={"max_norm": 0.5})["Out"]
    squared = np.array([np.sum(g * g)])
    blocks = [run_op("clip_by_norm", {"X": g[r], "SquaredNorm": squared}, ["Out"], attrs={"max_norm": 0.5})["Out"]
              for r in (slice(0, 2), slice(2, 6))]
    np.testing.assert_allclose(np.concatenate(blocks), whole, rtol=1e-14)
    own = run_op("clip_by_norm", {"X": g[:2]}, ["Out"], attrs={"max_norm": 0.5})["Out"]
    assert np.abs(own - whole[:2]).max() > 1e-3  # the block's own norm would not do
    unclipped = run_op("clip_by_norm", {"X": g[:2], "SquaredNorm": np.array([0.01])}, ["Out"],
                       attrs={"max_norm": 0.5})["Out"]
    np.testing.assert_array_equal(unclipped, g[:2])  # the whole norm 0.1 is below max_norm
