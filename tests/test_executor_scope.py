"""The values the executor keeps (`LoDTensor`, `SelectedRows`) and where it keeps them
(`Scope`)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows, describe

# ------------------------------------------------------------------------ Scope


def test_lookups_walk_up_and_writes_stay_local():
    root = Scope()
    root.set_var("w", 1)
    child = root.new_scope()
    assert child.find_var("w") == 1 and child.find_scope("w") is root
    child.set_var("w", 2)
    assert child.find_var("w") == 2 and root.find_var("w") == 1
    assert child.has_var("w", local=True) and not root.new_scope().has_var("w", local=True)
    child.erase("w", "absent")
    assert child.find_var("w") == 1
    assert root.find_var("nothing", default="d") == "d"


def test_var_creates_once_even_under_contention():
    scope = Scope()
    made: list[object] = []

    def worker() -> None:
        made.append(scope.var("table", factory=object))

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(m) for m in made}) == 1


def test_concurrent_writers_and_readers_see_whole_values():
    scope = Scope()
    scope.set_var("p", LoDTensor(np.zeros(1000, np.float32)))
    stop = threading.Event()
    torn: list[float] = []

    def writer() -> None:
        for k in range(1, 300):
            scope.set_var("p", LoDTensor(np.full(1000, k, np.float32)))
        stop.set()

    def reader() -> None:
        while not stop.is_set():
            array = scope.find_var("p").array
            if array.min() != array.max():
                torn.append(float(array.min()))

    threads = [threading.Thread(target=writer), threading.Thread(target=reader), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not torn
    assert scope.find_var("p").array[0] == 299


def test_local_names_and_contains():
    scope = Scope()
    scope.set_var("a", 1)
    scope.set_var("b", 2)
    assert scope.local_names() == ["a", "b"] and "a" in scope.new_scope()


# -------------------------------------------------------------------- LoDTensor


def test_lod_from_lengths_and_back():
    t = LoDTensor.from_lengths(np.zeros((5, 2)), [[2, 0, 3]])
    assert t.lod_lists() == [[0, 2, 2, 5]] and t.sequence_lengths() == [[2, 0, 3]]
    assert "lod_levels=1" in describe(t)


@pytest.mark.parametrize(
    ("lod", "message"),
    [
        ([[1, 3]], "must start at 0"),
        ([[0, 3, 2]], "must not decrease"),
        ([[0, 2, 4]], "the tensor has 5 rows"),
        ([[0, 1, 3], [0, 2, 5]], "ends at 3 but level 1 has 2 items"),
    ],
)
def test_bad_lod_is_rejected(lod, message):
    with pytest.raises(ValueError, match=message):
        LoDTensor(np.zeros((5, 1)), lod)


def test_from_buffer_wraps_bytes_without_copying():
    raw = bytearray(np.arange(6, dtype=np.float32).tobytes())
    t = LoDTensor.from_buffer(raw, np.float32, [3, 2], [[0, 1, 3]])
    assert t.array.tolist() == [[0, 1], [2, 3], [4, 5]]
    raw[0:4] = np.float32(9).tobytes()
    assert t.array[0, 0] == 9  # a view of the buffer


# ----------------------------------------------------------------- SelectedRows


def test_selected_rows_dense_and_merged():
    sr = SelectedRows([3, 0, 3], np.array([[1.0, 1.0], [2.0, 2.0], [4.0, 4.0]], np.float32), 5)
    dense = sr.to_dense()
    assert dense.shape == (5, 2) and dense[3].tolist() == [5, 5] and dense[0].tolist() == [2, 2]
    merged = sr.merged()
    assert merged.rows.tolist() == [0, 3] and merged.value[:, 0].tolist() == [2, 5]
    assert describe(sr) == "selected_rows float32[5, 2] rows=3"


def test_selected_rows_needs_a_value_row_per_row():
    with pytest.raises(ValueError, match="3 rows but its value only 2"):
        SelectedRows([1, 2, 3], np.zeros((2, 4)), 10)


def test_table_lookup_index_is_thread_safe_and_consistent():
    """Threads growing one table concurrently: every id gets exactly one slot, and the
    slot each thread was given maps back to the id it asked for."""
    table = SelectedRows([], np.zeros((4000, 1), np.float32), 1 << 20)
    asked: list[np.ndarray] = []
    answers: list[np.ndarray] = []
    lock = threading.Lock()
    ids = np.arange(1000, dtype=np.int64) * 7

    def worker(offset: int) -> None:
        mine = np.roll(ids, offset)
        slots = table.lookup_index(mine, grow=True)
        with lock:
            asked.append(mine)
            answers.append(slots)

    threads = [threading.Thread(target=worker, args=(k * 100,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert table.rows.size == 1000 and len(np.unique(table.rows)) == 1000
    for mine, slots in zip(asked, answers, strict=True):
        np.testing.assert_array_equal(table.rows[slots], mine)
