"""ops/tensor.py: SelectedRows helpers."""

from __future__ import annotations

import numpy as np
import pytest

from ops.tensor import SelectedRows


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scatter_add_rows_gives_np_add_at_s_bits(dtype):
    """The flat-index fast path adds each element's repeats in np.add.at's order: the
    same bits, -0.0 and all (Zipf rows repeating up to hundreds of times)."""
    from ops.tensor import scatter_add_rows

    rng = np.random.default_rng(3)
    for shape, count in (((50, 8), 3000), ((7, 2, 3), 200), ((30,), 100), ((5, 1), 40)):
        rows = ((rng.zipf(1.1, count) - 1) % shape[0]).astype(np.int64)
        rows[::11] -= shape[0]  # negative rows count from the end, as in np.add.at
        values = rng.standard_normal((count, *shape[1:])).astype(dtype)
        values[::5] = -0.0
        want = rng.standard_normal(shape).astype(dtype)
        got = want.copy()
        np.add.at(want, rows, values)
        scatter_add_rows(got, rows, values)
        assert got.tobytes() == want.tobytes(), shape
    # SelectedRows.merged (a sync pserver's and a trainer's `sum` of sparse grads): as before
    rows = ((rng.zipf(1.1, 3000) - 1) % 50).astype(np.int64)
    values = rng.standard_normal((3000, 8)).astype(dtype)
    merged = SelectedRows(rows, values, 50).merged()
    unique, inverse = np.unique(rows, return_inverse=True)
    want = np.zeros((unique.size, 8), dtype)
    np.add.at(want, inverse, values)
    assert merged.rows.tolist() == unique.tolist() and merged.value.tobytes() == want.tobytes()
    dense = np.zeros((50, 8), dtype)
    np.add.at(dense, rows, values)
    assert SelectedRows(rows, values, 50).to_dense().tobytes() == dense.tobytes()
