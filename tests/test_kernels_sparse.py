"""The transpiler's local kernels: split_byref, split, split_selected_rows,
split_selected_rows_by_columns, split_ids /
merge_ids, lookup_sparse_table (auto-grown table), fake_init."""

from __future__ import annotations

import numpy as np
import pytest

from ops.executor import ExecutionError
from ops.testing import run_op
from ops.tensor import LoDTensor, SelectedRows
from transpiler.ir import VarKind

RNG = np.random.default_rng(9)


def test_split_byref_gives_row_views():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    outs = run_op("split_byref", {"X": x}, {"Out": 3}, attrs={"sections": [3, 3, 4]})["Out"]
    assert [o.shape for o in outs] == [(3, 2), (3, 2), (4, 2)]
    np.testing.assert_array_equal(np.concatenate(outs), x)
    assert all(np.shares_memory(o, x) for o in outs)


def test_split_byref_num_and_bad_sections():
    x = np.zeros((6, 1), np.float32)
    outs = run_op("split_byref", {"X": x}, {"Out": 2}, attrs={"num": 2})["Out"]
    assert [o.shape[0] for o in outs] == [3, 3]
    with pytest.raises(ExecutionError, match="do not add up to 6 rows"):
        run_op("split_byref", {"X": x}, {"Out": 2}, attrs={"sections": [2, 2]})


def test_split_cuts_along_an_axis_into_views():
    x = np.arange(24, dtype=np.float64).reshape(4, 6)
    outs = run_op("split", {"X": x}, {"Out": 3}, attrs={"axis": 1, "sections": [3, 2, 1]})["Out"]
    assert [o.shape for o in outs] == [(4, 3), (4, 2), (4, 1)]
    np.testing.assert_array_equal(np.concatenate(outs, axis=1), x)
    assert all(np.shares_memory(o, x) for o in outs)
    outs = run_op("split", {"X": x}, {"Out": 2}, attrs={"axis": -1, "num": 2})["Out"]
    assert [o.shape for o in outs] == [(4, 3), (4, 3)]
    with pytest.raises(ExecutionError, match="do not add up to 6"):
        run_op("split", {"X": x}, {"Out": 2}, attrs={"axis": 1, "sections": [2, 2]})


def test_split_selected_rows_by_columns_keeps_rows_and_cuts_values():
    x = SelectedRows([4, 1, 4], np.arange(15, dtype=np.float32).reshape(3, 5), 6)
    outs = run_op("split_selected_rows_by_columns", {"X": x}, {"Out": 2}, attrs={"sections": [2, 3]})["Out"]
    assert [o.rows.tolist() for o in outs] == [[4, 1, 4], [4, 1, 4]] and [o.height for o in outs] == [6, 6]
    np.testing.assert_array_equal(np.concatenate([o.to_dense() for o in outs], axis=1), x.to_dense())
    with pytest.raises(ExecutionError, match="do not add up to 5 columns"):
        run_op("split_selected_rows_by_columns", {"X": x}, {"Out": 2}, attrs={"sections": [2, 2]})


def test_split_selected_rows_rebases_rows_to_each_block():
    x = SelectedRows([0, 7, 3, 5, 9], np.arange(10, dtype=np.float32).reshape(5, 2), 10)
    outs = run_op("split_selected_rows", {"X": x}, {"Out": 3}, attrs={"height_sections": [4, 4, 2]})["Out"]
    assert [o.height for o in outs] == [4, 4, 2]
    assert [o.rows.tolist() for o in outs] == [[0, 3], [3, 1], [1]]
    np.testing.assert_array_equal(outs[1].value, [[2, 3], [6, 7]])
    # gluing the blocks back gives the same dense grad
    dense = np.concatenate([o.to_dense() for o in outs])
    np.testing.assert_array_equal(dense, x.to_dense())


def test_split_selected_rows_empty_block():
    x = SelectedRows([1], np.ones((1, 3), np.float32), 6)
    outs = run_op("split_selected_rows", {"X": x}, {"Out": 2}, attrs={"height_sections": [3, 3]})["Out"]
    assert outs[1].rows.size == 0 and outs[1].value.shape == (0, 3) and outs[1].height == 3


def test_split_ids_dedups_sorts_and_shards_by_modulo():
    a = np.array([[5], [2], [5], [8]], np.int64)
    b = np.array([[3], [2], [0]], np.int64)
    outs = run_op("split_ids", {"Ids": [a, b]}, {"Out": 3})["Out"]
    assert [o.reshape(-1).tolist() for o in outs] == [[0, 3], [], [2, 5, 8]]
    assert all(o.shape[1:] == (1,) and o.dtype == np.int64 for o in outs)


def test_split_ids_selected_rows_shards_rows_with_values_and_merges_duplicates():
    grad = SelectedRows([4, 1, 4, 3], np.array([[1.0], [2.0], [3.0], [4.0]], np.float32), 10)
    outs = run_op("split_ids", {"Ids": grad}, {"Out": 2})["Out"]
    assert [o.rows.tolist() for o in outs] == [[4], [1, 3]]
    np.testing.assert_array_equal(outs[0].value, [[4.0]])
    np.testing.assert_array_equal(outs[1].value, [[2.0], [4.0]])
    assert all(o.height == 10 for o in outs)


def test_split_ids_then_merge_ids_round_trip():
    """What the trainer does for a distributed table: shard the ids, let each shard
    answer its rows (here: a plain table lookup), merge back per input."""
    table = RNG.standard_normal((50, 4)).astype(np.float32)
    ids = [
        LoDTensor(np.array([[3], [17], [3]], np.int64), [[0, 1, 3]]),
        LoDTensor(np.array([[44], [0]], np.int64), [[0, 2]]),
    ]
    shards = run_op("split_ids", {"Ids": ids}, {"Out": 3})["Out"]
    answers = [table[s.reshape(-1)] for s in shards]
    merged = run_op("merge_ids", {"Ids": ids, "Rows": shards, "X": answers}, {"Out": 2}, raw=True)["Out"]
    for tensor, out in zip(ids, merged, strict=True):
        np.testing.assert_array_equal(out.array, table[tensor.array.reshape(-1)])
        assert out.lod_lists() == tensor.lod_lists()


def test_merge_ids_names_an_id_no_shard_answered():
    with pytest.raises(ExecutionError, match="id 9 of 'out.Out_0' is in no shard"):
        run_op(
            "merge_ids",
            {"Ids": [np.array([[9]], np.int64)], "Rows": [np.array([[1]], np.int64)], "X": [np.zeros((1, 2), np.float32)]},
            {"Out": 1},
        )


def table(capacity: int = 6, width: int = 2, *, grow: bool = False) -> SelectedRows:
    value = np.arange(capacity * width, dtype=np.float32).reshape(capacity, width)
    init = (lambda n: np.full((n, width), -1.0, np.float32)) if grow else None
    return SelectedRows([], value, 100, initializer=init)


def test_lookup_sparse_table_grows_in_first_touch_order():
    t = table()
    out = run_op("lookup_sparse_table", {"W": t, "Ids": np.array([[70], [5], [70]], np.int64)})["Out"]
    assert t.rows.tolist() == [70, 5]
    np.testing.assert_array_equal(out, [[0, 1], [2, 3], [0, 1]])
    again = run_op("lookup_sparse_table", {"W": t, "Ids": np.array([[5], [9]], np.int64)})["Out"]
    assert t.rows.tolist() == [70, 5, 9]
    np.testing.assert_array_equal(again, [[2, 3], [4, 5]])


def test_lookup_sparse_table_is_test_reads_zeros_and_does_not_grow():
    t = table()
    run_op("lookup_sparse_table", {"W": t, "Ids": np.array([[1]], np.int64)})
    out = run_op("lookup_sparse_table", {"W": t, "Ids": np.array([[1], [2]], np.int64)}, attrs={"is_test": True})["Out"]
    np.testing.assert_array_equal(out, [[0, 1], [0, 0]])
    assert t.rows.tolist() == [1]


def test_lookup_sparse_table_beyond_capacity_uses_the_initializer():
    t = table(capacity=2, grow=True)
    out = run_op("lookup_sparse_table", {"W": t, "Ids": np.array([[1], [2], [3]], np.int64)})["Out"]
    np.testing.assert_array_equal(out, [[0, 1], [2, 3], [-1, -1]])
    assert t.capacity == 3


def test_lookup_sparse_table_full_without_initializer_is_an_error():
    t = table(capacity=1)
    with pytest.raises(ExecutionError, match="sparse table is full"):
        run_op("lookup_sparse_table", {"W": t, "Ids": np.array([[1], [2]], np.int64)})


def test_initializer_into_selected_rows_var_makes_a_growable_table():
    t = run_op(
        "uniform_random",
        attrs={"shape": [3, 2], "min": -1.0, "max": 1.0, "seed": 5},
        output_kinds={"Out": VarKind.SELECTED_ROWS},
    )["Out"]
    assert isinstance(t, SelectedRows) and t.capacity == 3 and t.height == 3
    out = run_op("lookup_sparse_table", {"W": t, "Ids": np.arange(5, dtype=np.int64).reshape(5, 1)})["Out"]
    assert t.capacity == 5 and np.all(np.abs(out) <= 1) and len(np.unique(out[:, 0])) == 5


def test_fake_init_creates_the_shape_without_memory():
    out = run_op("fake_init", attrs={"shape": [100000, 16]})["Out"]
    assert out.shape == (100000, 16) and out.strides == (0, 0)
    assert not out.flags.writeable
    sr = run_op("fake_init", attrs={"shape": [50, 4]}, output_kinds={"Out": VarKind.SELECTED_ROWS})["Out"]
    assert isinstance(sr, SelectedRows) and sr.height == 50 and sr.rows.size == 0


def test_merge_ids_accepts_an_empty_shard():
    out = run_op(
        "merge_ids",
        {
            "Ids": [np.array([[4], [2]], np.int64)],
            "Rows": [np.array([[2], [4]], np.int64), np.zeros((0, 1), np.int64)],
            "X": [np.array([[2.0, 2.0], [4.0, 4.0]], np.float32), np.zeros((0,), np.float32)],
        },
        {"Out": 1},
    )["Out"][0]
    np.testing.assert_array_equal(out, [[4, 4], [2, 2]])


@pytest.mark.parametrize("declared, ids_shape", [((-1, 3, 4), (2, 3, 1)), ((-1, 3, 4), (2, 3))])
def test_merge_ids_gives_a_3d_lookup_its_declared_shape(declared, ids_shape):
    """A lookup of [N, 3, 1] ids (`lookup_table`) or [N, 3] ids (`lookup_table_v2`) is
    declared [N, 3, width]: the merged rows come back in that shape, not [N * 3, width]."""
    table = RNG.standard_normal((20, 4))
    ids = np.array([5, 1, 7, 1, 19, 0], np.int64).reshape(ids_shape)
    out = run_op("merge_ids", {"Ids": [ids], "Rows": [np.unique(ids).reshape(-1, 1)], "X": [table[np.unique(ids)]]},
                 {"Out": 1}, output_shapes={"Out": declared})["Out"][0]
    np.testing.assert_array_equal(out, table[ids.reshape(-1)].reshape(2, 3, 4))
