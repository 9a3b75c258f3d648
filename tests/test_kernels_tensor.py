"""Forward semantics of constants, copies, casts, shape ops, comparisons and logic."""

from __future__ import annotations

import numpy as np
import pytest

from ops.executor import ExecutionError
from ops.testing import run_op
from ops.tensor import LoDTensor, SelectedRows
from transpiler.ir import Attr, AttrType, DType, VarKind

FP32, INT64, BOOL = int(DType.FP32), int(DType.INT64), int(DType.BOOL)


def test_fill_constant_value_dtype_shape():
    out = run_op("fill_constant", attrs={"shape": [2, 3], "dtype": FP32, "value": 0.5})["Out"]
    assert out.dtype == np.float32 and out.shape == (2, 3)
    np.testing.assert_array_equal(out, 0.5)


def test_fill_constant_str_value_wins_and_keeps_int64_precision():
    out = run_op(
        "fill_constant",
        attrs={"shape": [1], "dtype": INT64, "value": 0.0, "str_value": "9007199254740993"},
    )["Out"]
    assert out.dtype == np.int64 and out.tolist() == [9007199254740993]


def test_fill_constant_counter_starts_at_minus_one():
    out = run_op("fill_constant", attrs={"shape": [1], "dtype": INT64, "value": -1.0, "force_cpu": True})["Out"]
    assert out.tolist() == [-1] and out.dtype == np.int64


def test_fill_constant_0d_and_inf():
    out = run_op("fill_constant", attrs={"shape": Attr.of([], AttrType.LONGS), "dtype": FP32, "str_value": "-inf"})["Out"]
    assert out.shape == () and out == -np.inf


def test_fill_constant_value_tensor_and_shape_tensor():
    out = run_op(
        "fill_constant",
        {"ValueTensor": np.array([7.0], np.float32), "ShapeTensor": np.array([2, 2], np.int32)},
        attrs={"shape": [9], "dtype": FP32, "value": 1.0},
    )["Out"]
    np.testing.assert_array_equal(out, np.full((2, 2), 7.0))


def test_fill_constant_into_a_selected_rows_var():
    out = run_op(
        "fill_constant",
        attrs={"shape": [4, 2], "dtype": FP32, "value": 1.0},
        output_kinds={"Out": VarKind.SELECTED_ROWS},
    )["Out"]
    assert isinstance(out, SelectedRows) and out.capacity == 4 and out.rows.size == 0


def test_fill_zeros_like_and_assign_value():
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(run_op("fill_zeros_like", {"X": x})["Out"], np.zeros((2, 3)))
    out = run_op("assign_value", attrs={"shape": [2, 2], "dtype": INT64, "int64_values": [1, 2, 3, 4]})["Out"]
    assert out.dtype == np.int64 and out.tolist() == [[1, 2], [3, 4]]
    with pytest.raises(ExecutionError, match="3 values for shape"):
        run_op("assign_value", attrs={"shape": [2, 2], "dtype": FP32, "fp32_values": [1.0, 2.0, 3.0]})


def test_assign_shares_the_value_without_copying():
    x = LoDTensor(np.arange(4.0), [[0, 1, 4]])
    out = run_op("assign", {"X": x}, raw=True)["Out"]
    assert out is x


def test_cast_int64_counter_to_float():
    out = run_op("cast", {"X": np.array([2100], np.int64)}, attrs={"in_dtype": INT64, "out_dtype": FP32})["Out"]
    assert out.dtype == np.float32 and out.tolist() == [2100.0]
    back = run_op("cast", {"X": np.array([2.7, -2.7], np.float32)}, attrs={"in_dtype": FP32, "out_dtype": INT64})["Out"]
    assert back.tolist() == [2, -2]


def test_increment_keeps_dtype():
    out = run_op("increment", {"X": np.array([41], np.int64)}, attrs={"step": 1.0})["Out"]
    assert out.dtype == np.int64 and out.tolist() == [42]


def test_concat_and_negative_axis():
    a, b = np.ones((2, 1), np.float32), np.zeros((2, 3), np.float32)
    out = run_op("concat", {"X": [a, b]}, attrs={"axis": -1})["Out"]
    np.testing.assert_array_equal(out, np.concatenate([a, b], axis=1))


def test_concat_axis_0_joins_param_blocks():
    blocks = [np.full((2, 3), i, np.float32) for i in range(3)]
    out = run_op("concat", {"X": blocks}, attrs={"axis": 0})["Out"]
    assert out.shape == (6, 3) and out[:, 0].tolist() == [0, 0, 1, 1, 2, 2]


def test_concat_grad_splits_by_input_widths():
    a, b = np.ones((2, 1), np.float32), np.ones((2, 3), np.float32)
    dout = np.arange(8, dtype=np.float32).reshape(2, 4)
    got = run_op("concat_grad", {"X": [a, b], "Out@GRAD": dout}, {"X@GRAD": 2}, attrs={"axis": 1})["X@GRAD"]
    np.testing.assert_array_equal(got[0], dout[:, :1])
    np.testing.assert_array_equal(got[1], dout[:, 1:])


def test_reshape2_copies_zero_dims_and_infers_minus_one():
    x = np.arange(24.0).reshape(2, 3, 4)
    out = run_op("reshape2", {"X": x}, ["Out", "XShape"], attrs={"shape": [0, -1]})
    assert out["Out"].shape == (2, 12)
    assert out["XShape"].shape == (0, 2, 3, 4)
    assert np.shares_memory(out["Out"], x)


def test_transpose2():
    x = np.arange(6.0).reshape(1, 2, 3)
    out = run_op("transpose2", {"X": x}, ["Out", "XShape"], attrs={"axis": [2, 0, 1]})["Out"]
    np.testing.assert_array_equal(out, x.transpose(2, 0, 1))
    with pytest.raises(ExecutionError, match="not a permutation"):
        run_op("transpose2", {"X": x}, ["Out", "XShape"], attrs={"axis": [0, 0, 1]})


@pytest.mark.parametrize(
    ("op", "ref"),
    [
        ("less_than", np.less),
        ("less_equal", np.less_equal),
        ("greater_than", np.greater),
        ("greater_equal", np.greater_equal),
        ("equal", np.equal),
        ("not_equal", np.not_equal),
    ],
)
def test_comparisons(op, ref):
    x = np.array([1.0, 2.0, 3.0], np.float32)
    y = np.array([2.0], np.float32)
    out = run_op(op, {"X": x, "Y": y})["Out"]
    assert out.dtype == np.bool_
    np.testing.assert_array_equal(out, ref(x, y))


def test_logical_ops():
    x, y = np.array([True, True, False]), np.array([True, False, False])
    assert run_op("logical_and", {"X": x, "Y": y})["Out"].tolist() == [True, False, False]
    assert run_op("logical_or", {"X": x, "Y": y})["Out"].tolist() == [True, True, False]
    assert run_op("logical_xor", {"X": x, "Y": y})["Out"].tolist() == [False, True, False]
    assert run_op("logical_not", {"X": x})["Out"].tolist() == [False, False, True]


# ---------------------------------------------------------------- ref_by_trainer_id


def test_ref_by_trainer_id_picks_the_trainers_input():
    xs = [np.full((2, 3), float(i), np.float32) for i in range(3)]
    out = run_op("ref_by_trainer_id", {"X": xs, "TrainerId": np.array([2], np.int64)})["Out"]
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, xs[2])


def test_ref_by_trainer_id_rejects_an_id_out_of_range_or_not_an_integer():
    xs = [np.zeros(2), np.ones(2)]
    with pytest.raises(ExecutionError, match="TrainerId 2 is out of range for 2 X inputs"):
        run_op("ref_by_trainer_id", {"X": xs, "TrainerId": np.array([2], np.int64)})
    with pytest.raises(ExecutionError, match="TrainerId must be an integer"):
        run_op("ref_by_trainer_id", {"X": xs, "TrainerId": np.array([1.0])})
