"""Forward semantics of softmax, embeddings, sequence_pool (LoD), top_k and accuracy."""

from __future__ import annotations

import numpy as np
import pytest

from ops.executor import ExecutionError
from ops.testing import run_op
from ops.tensor import LoDTensor, SelectedRows

RNG = np.random.default_rng(11)


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def test_softmax_rows_sum_to_one_and_match_reference():
    x = f32(4, 6)
    out = run_op("softmax", {"X": x})["Out"]
    ref = np.exp(x - x.max(1, keepdims=True))
    ref /= ref.sum(1, keepdims=True)
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    np.testing.assert_allclose(out.sum(1), 1, rtol=1e-6)


def test_softmax_is_stable_for_huge_logits():
    out = run_op("softmax", {"X": np.array([[1e4, 0.0, -1e4]], np.float32)})["Out"]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, [[1, 0, 0]], atol=1e-6)


def test_lookup_table_v1_drops_the_trailing_1_and_keeps_lod():
    w = f32(10, 4)
    ids = LoDTensor(np.array([[3], [0], [3], [9]], np.int64), [[0, 1, 4]])
    out = run_op("lookup_table", {"W": w, "Ids": ids}, raw=True)["Out"]
    assert out.shape == (4, 4)
    np.testing.assert_array_equal(out.array, w[[3, 0, 3, 9]])
    assert out.lod_lists() == [[0, 1, 4]]


def test_lookup_table_v2_appends_the_width():
    w = f32(10, 4)
    ids = np.array([[1, 2, 3], [4, 5, 6]], np.int64)
    out = run_op("lookup_table_v2", {"W": w, "Ids": ids})["Out"]
    assert out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, w[ids])


def test_lookup_table_padding_idx_gives_zero_rows():
    w = f32(5, 2)
    out = run_op("lookup_table", {"W": w, "Ids": np.array([[1], [2], [1]], np.int64)}, attrs={"padding_idx": 1})["Out"]
    np.testing.assert_array_equal(out, [[0, 0], w[2], [0, 0]])


def test_lookup_table_out_of_range_id_names_the_op_and_shapes():
    with pytest.raises(ExecutionError) as info:
        run_op("lookup_table", {"W": f32(5, 2), "Ids": np.array([[7]], np.int64)})
    text = str(info.value)
    assert "op 0 (lookup_table)" in text and "id 7" in text and "W=W float32[5, 2]" in text
    assert info.value.op_type == "lookup_table" and info.value.block == 0


def test_lookup_table_grad_sparse_keeps_one_row_per_id():
    ids = np.array([[2], [0], [2]], np.int64)
    dout = np.arange(6, dtype=np.float32).reshape(3, 2)
    got = run_op(
        "lookup_table_grad", {"W": f32(4, 2), "Ids": ids, "Out@GRAD": dout}, ["W@GRAD"], attrs={"is_sparse": True}
    )["W@GRAD"]
    assert isinstance(got, SelectedRows)
    np.testing.assert_array_equal(got.rows, [2, 0, 2])
    assert got.height == 4
    np.testing.assert_array_equal(got.value, dout)


def test_lookup_table_grad_dense_accumulates_duplicates():
    ids = np.array([[2], [0], [2]], np.int64)
    dout = np.arange(6, dtype=np.float32).reshape(3, 2)
    got = run_op("lookup_table_grad", {"W": f32(4, 2), "Ids": ids, "Out@GRAD": dout}, ["W@GRAD"])["W@GRAD"]
    np.testing.assert_array_equal(got, [[2, 3], [0, 0], [4 + 0, 5 + 1], [0, 0]])


def test_lookup_table_grad_needs_only_the_table_shape():
    """On a trainer the distributed table is a fake_init placeholder (no data)."""
    placeholder = np.broadcast_to(np.zeros((), np.float32), (1000, 3))
    got = run_op(
        "lookup_table_grad",
        {"W": placeholder, "Ids": np.array([[5]], np.int64), "Out@GRAD": np.ones((1, 3), np.float32)},
        ["W@GRAD"],
        attrs={"is_sparse": True},
    )["W@GRAD"]
    assert got.height == 1000 and got.rows.tolist() == [5]


# --------------------------------------------------------------- sequence_pool

X = np.arange(14, dtype=np.float32).reshape(7, 2) * np.array([1, -1], np.float32)
LOD = [[0, 2, 2, 5, 7]]  # sequences of 2, 0, 3, 2 rows


def pool(pooltype: str, pad: float = 0.0):
    return run_op(
        "sequence_pool",
        {"X": LoDTensor(X, LOD)},
        ["Out", "MaxIndex"],
        attrs={"pooltype": pooltype, "pad_value": pad},
        raw=True,
    )


@pytest.mark.parametrize(
    ("pooltype", "rows"),
    [
        ("SUM", lambda s: s.sum(0)),
        ("AVERAGE", lambda s: s.mean(0)),
        ("SQRT", lambda s: s.sum(0) / np.sqrt(len(s))),
        ("MAX", lambda s: s.max(0)),
        ("FIRST", lambda s: s[0]),
        ("LAST", lambda s: s[-1]),
    ],
)
def test_sequence_pool(pooltype, rows):
    out = pool(pooltype, pad=-9.0)["Out"]
    seqs = [X[a:b] for a, b in zip(LOD[0][:-1], LOD[0][1:], strict=True)]
    expected = np.stack([rows(s) if len(s) else np.full(2, -9.0, np.float32) for s in seqs])
    np.testing.assert_allclose(out.array, expected, rtol=1e-6)
    assert out.lod == ()


def test_sequence_pool_max_index_is_the_absolute_row():
    index = pool("MAX")["MaxIndex"].array
    # column 0 grows with the row, column 1 shrinks: max at the last / first row
    np.testing.assert_array_equal(index, [[1, 0], [-1, -1], [4, 2], [6, 5]])


def test_sequence_pool_keeps_the_outer_lod_levels():
    x = LoDTensor(np.ones((5, 1), np.float32), [[0, 2, 3], [0, 1, 3, 5]])
    out = run_op("sequence_pool", {"X": x}, attrs={"pooltype": "SUM"}, raw=True)["Out"]
    np.testing.assert_array_equal(out.array[:, 0], [1, 2, 2])
    assert out.lod_lists() == [[0, 2, 3]]


def test_sequence_pool_grad_average_spreads_over_each_sequence():
    dout = np.array([[1, 2], [9, 9], [3, 6], [4, 4]], np.float32)
    got = run_op(
        "sequence_pool_grad", {"X": LoDTensor(X, LOD), "Out@GRAD": dout}, ["X@GRAD"], attrs={"pooltype": "AVERAGE"}
    )["X@GRAD"]
    expected = np.array([[0.5, 1], [0.5, 1], [1, 2], [1, 2], [1, 2], [2, 2], [2, 2]], np.float32)
    np.testing.assert_allclose(got, expected)


def test_sequence_pool_without_lod_is_an_error():
    with pytest.raises(ExecutionError, match="needs X with a LoD"):
        run_op("sequence_pool", {"X": X}, attrs={"pooltype": "SUM"})


def test_sequence_pool_unknown_pooltype():
    with pytest.raises(ExecutionError, match="pooltype 'MEDIAN'"):
        run_op("sequence_pool", {"X": LoDTensor(X, LOD)}, attrs={"pooltype": "MEDIAN"})


# ------------------------------------------------------------- top_k, accuracy


def test_top_k_and_accuracy():
    x = np.array([[0.1, 0.7, 0.2], [0.5, 0.2, 0.3], [0.3, 0.3, 0.4]], np.float32)
    top = run_op("top_k", {"X": x}, ["Out", "Indices"], attrs={"k": 2})
    np.testing.assert_array_equal(top["Indices"], [[1, 2], [0, 2], [2, 0]])
    np.testing.assert_allclose(top["Out"], [[0.7, 0.2], [0.5, 0.3], [0.4, 0.3]])
    label = np.array([[2], [1], [0]], np.int64)
    acc = run_op(
        "accuracy", {"Out": top["Out"], "Indices": top["Indices"], "Label": label}, ["Accuracy", "Correct", "Total"]
    )
    np.testing.assert_allclose(acc["Accuracy"], [2 / 3], rtol=1e-6)
    assert acc["Correct"].tolist() == [2] and acc["Total"].tolist() == [3]


def test_top_k_v2_smallest_along_axis_0():
    x = np.array([[3.0, 1.0], [2.0, 5.0], [1.0, 4.0]], np.float32)
    top = run_op("top_k_v2", {"X": x}, ["Out", "Indices"], attrs={"k": 1, "axis": 0, "largest": False})
    np.testing.assert_array_equal(top["Indices"], [[2, 0]])
