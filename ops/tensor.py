"""The values a `Scope` holds: `LoDTensor` and `SelectedRows`.

Both are thin wrappers over numpy arrays, never copies: a `LoDTensor` is an array plus
its LoD (level-of-detail offsets, Paddle's variable-length sequence marks), a
`SelectedRows` is a sparse set of rows of a `[height, ...]` tensor (`rows` int64,
`value` with one row per entry of `rows`).

Kernels treat the values they read as immutable and put new values in the scope, so a
thread that holds a value (an RPC answering a `get`) always sees a whole, consistent
tensor. The one exception is the auto-grown sparse table (a `SelectedRows` used as a
parameter on a pserver, see `SelectedRows.lookup_index`): it is shared mutable state by
design, and every change to it happens under its `lock`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

Lod = tuple[np.ndarray, ...]


def _as_lod(lod: Iterable[Iterable[int]] | None) -> Lod:
    """Normalise a LoD (a list of offset lists) to a tuple of read-only int64 arrays."""
    if lod is None or (type(lod) is tuple and not lod):  # most outputs: their input's ()
        return ()
    levels = []
    for level in lod:
        arr = np.asarray(level, dtype=np.int64).reshape(-1)
        arr.flags.writeable = False
        levels.append(arr)
    return tuple(levels)


def scatter_add_rows(out: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
    """`np.add.at(out, rows, values)`: row `rows[i]` of `out` += `values[i]`, repeated rows
    added in their order; the same bits, 4-6x faster for rows of several elements: numpy's
    `ufunc.at` runs its fast path on 1-D operands only, so the rows become flat indices
    (each element then gets the same additions in the same order). `out` must be
    C-contiguous and `values` of its dtype for that; anything else goes to `np.add.at`."""
    width = int(np.prod(out.shape[1:], dtype=np.int64)) if out.ndim > 1 else 1
    if (out.ndim < 2 or width < 2 or not out.flags.c_contiguous or values.dtype != out.dtype
            or values.shape != (rows.size, *out.shape[1:]) or rows.ndim != 1):
        np.add.at(out, rows, values)
        return
    flat = (rows.astype(np.int64, copy=False)[:, None] * width + np.arange(width, dtype=np.int64)).reshape(-1)
    np.add.at(out.reshape(-1), flat, values.reshape(-1))


def check_lod(lod: Lod, rows: int) -> None:
    """Raise `ValueError` unless `lod` is a valid LoD over `rows` rows (Paddle's CheckLoD)."""
    for i, level in enumerate(lod):
        if level.size < 1 or level[0] != 0:
            raise ValueError(f"LoD level {i} must start at 0, got {level.tolist()[:8]}")
        if level.size > 1 and np.any(np.diff(level) < 0):
            raise ValueError(f"LoD level {i} offsets must not decrease: {level.tolist()[:8]}")
        if i + 1 < len(lod) and level[-1] != lod[i + 1].size - 1:
            items = lod[i + 1].size - 1
            raise ValueError(f"LoD level {i} ends at {int(level[-1])} but level {i + 1} has {items} items")
    if lod and lod[-1][-1] != rows:
        raise ValueError(f"the last LoD level ends at {int(lod[-1][-1])} but the tensor has {rows} rows")


def lengths_to_lod(lengths: Sequence[Sequence[int]]) -> Lod:
    """Recursive sequence lengths (`[[2, 3]]`) to offsets (`[[0, 2, 5]]`)."""
    return _as_lod(np.concatenate(([0], np.cumsum(np.asarray(level, dtype=np.int64)))) for level in lengths)


class LoDTensor:
    """A dense numpy array and its LoD (a tuple of int64 offset arrays, outermost first)."""

    __slots__ = ("array", "lod")

    def __init__(self, array: Any, lod: Iterable[Iterable[int]] | None = None) -> None:
        self.array: np.ndarray = np.asarray(array)
        self.lod: Lod = _as_lod(lod)
        if self.lod:
            if self.array.ndim == 0:
                raise ValueError("a 0-d tensor cannot carry a LoD")
            check_lod(self.lod, self.array.shape[0])

    @classmethod
    def from_lengths(cls, array: Any, lengths: Sequence[Sequence[int]]) -> LoDTensor:
        return cls(array, lengths_to_lod(lengths))

    @classmethod
    def from_buffer(
        cls, buffer: Any, dtype: Any, dims: Sequence[int], lod: Iterable[Iterable[int]] | None = None
    ) -> LoDTensor:
        """Wrap raw bytes without copying (the RPC layer's receive path)."""
        return cls(np.frombuffer(buffer, dtype=dtype).reshape(tuple(dims)), lod)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    def numel(self) -> int:
        return int(self.array.size)

    def lod_lists(self) -> list[list[int]]:
        return [level.tolist() for level in self.lod]

    def sequence_lengths(self) -> list[list[int]]:
        """Paddle's `recursive_sequence_lengths()`."""
        return [np.diff(level).tolist() for level in self.lod]

    def __repr__(self) -> str:
        lod = f", lod={self.lod_lists()}" if self.lod else ""
        return f"LoDTensor({self.array.dtype}{list(self.array.shape)}{lod})"


RowInitializer = Callable[[int], np.ndarray]


class SelectedRows:
    """Rows `rows` of a `[height, ...]` tensor; `value[i]` is row `rows[i]`.

    Rows may repeat (a lookup's grad has one entry per looked-up id); `merged()` sums
    duplicates and `to_dense()` scatters with addition, as Paddle's functors do.

    Used as a parameter (the pserver side of a distributed lookup table) it is an
    auto-grown table: `value` is preallocated with `capacity` rows (filled by the
    table's initializer), `rows[slot]` is the id stored in `value[slot]`, and
    `lookup_index` maps ids to slots, adding unseen ids in first-touch order. When the
    capacity is used up the table grows with `initializer` (set by the kernel that
    initialised it), or raises like Paddle's "selected rows is full" when it has none.
    """

    __slots__ = ("rows", "height", "value", "initializer", "lock", "_index", "_rows_buf")

    def __init__(
        self,
        rows: Any,
        value: Any,
        height: int,
        *,
        initializer: RowInitializer | None = None,
    ) -> None:
        self.rows: np.ndarray = np.asarray(rows, dtype=np.int64).reshape(-1)
        self.value: np.ndarray = np.asarray(value)
        self.height = int(height)
        if self.value.ndim == 0:
            raise ValueError("a SelectedRows value needs at least one dimension (its rows)")
        if self.value.shape[0] < self.rows.size:
            raise ValueError(f"SelectedRows has {self.rows.size} rows but its value only {self.value.shape[0]}")
        self.initializer = initializer
        self.lock = threading.RLock()
        self._index: _RowIndex | None = None
        self._rows_buf: np.ndarray | None = None

    @classmethod
    def from_buffer(cls, buffer: Any, dtype: Any, dims: Sequence[int], rows: Any, height: int) -> SelectedRows:
        """Wrap raw value bytes (and raw int64 row bytes, or a row sequence) without copying."""
        if isinstance(rows, (bytes, bytearray, memoryview)):
            rows = np.frombuffer(rows, dtype=np.int64)
        return cls(rows, np.frombuffer(buffer, dtype=dtype).reshape(tuple(dims)), height)

    @classmethod
    def empty(cls, height: int, row_shape: Sequence[int], dtype: Any = np.float32) -> SelectedRows:
        return cls(np.zeros(0, np.int64), np.zeros((0, *row_shape), dtype), height)

    @property
    def dtype(self) -> np.dtype:
        return self.value.dtype

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.value.shape[1:]

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense shape it stands for: `[height, *row_shape]`."""
        return (self.height, *self.row_shape)

    @property
    def capacity(self) -> int:
        return int(self.value.shape[0])

    def active_value(self) -> np.ndarray:
        """`value` without a table's unused capacity rows."""
        return self.value[: self.rows.size]

    def to_dense(self) -> np.ndarray:
        dense = np.zeros(self.shape, dtype=self.value.dtype)
        scatter_add_rows(dense, self.rows, self.active_value())
        return dense

    def merged(self) -> SelectedRows:
        """Duplicate rows summed (in their original order, as `np.add.at` adds), rows
        sorted ascending (Paddle's MergeAdd). Rows that are already unique are only
        reordered: no scatter-add."""
        rows, value = self.rows, self.active_value()
        if rows.size < 2 or bool((rows[1:] > rows[:-1]).all()):
            return SelectedRows(rows, value, self.height)
        order = np.argsort(rows, kind="stable")
        sorted_rows = rows[order]
        is_start = np.concatenate(([True], sorted_rows[1:] != sorted_rows[:-1]))
        if is_start.all():
            return SelectedRows(sorted_rows, value[order], self.height)
        run = np.cumsum(is_start) - 1
        inverse = np.empty_like(run)
        inverse[order] = run
        summed = np.zeros((int(run[-1]) + 1, *self.row_shape), dtype=value.dtype)
        scatter_add_rows(summed, inverse, value)
        return SelectedRows(sorted_rows[is_start], summed, self.height)

    # -- the auto-grown table
    def lookup_index(self, ids: Any, *, grow: bool) -> np.ndarray:
        """Slot of each id in `value` (int64, shaped like `ids` flattened); -1 for an
        unknown id when `grow` is False. Unseen ids are added in first-touch order.
        Thread-safe; vectorised (see `_RowIndex`: no Python loop over ids or rows)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        with self.lock:
            slots = self._row_index().find(ids)
            missing = slots < 0
            if grow and missing.any():
                slots[missing] = self._add(ids[missing])
            return slots

    def follow(self, table: SelectedRows) -> None:
        """Give this table (an accumulator of `table`: a moment, a velocity) `table`'s
        id -> slot map: the ids `table` created since the last call are appended here in
        the same order, so they land at the same slots, with this table's own initial
        values. Its rows must be a prefix of `table`'s (only `follow` adds rows to it).
        Call it holding `table.lock`."""
        with self.lock:
            have, want = self.rows.size, table.rows.size
            if have > want or (have and self.rows[have - 1] != table.rows[have - 1]):
                raise ValueError(f"an accumulator's {have} rows are not a prefix of its table's {want} rows")
            if have < want:
                self._add(table.rows[have:want])

    def _row_index(self) -> _RowIndex:
        index = self._index
        if index is None or index.count != self.rows.size:
            index = self._index = _RowIndex(self.rows, max(self.capacity, self.height))
        return index

    def _add(self, new_ids: np.ndarray) -> np.ndarray:
        """Append the distinct ids of `new_ids` (none is in the table yet) in first-touch
        order, as Paddle inserts; return the slot of each entry of `new_ids`."""
        uniq, first, inverse = np.unique(new_ids, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")
        fresh = uniq[order]
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        base = self.rows.size
        need = base + fresh.size
        if need > self.capacity:
            if self.initializer is None:
                raise ValueError(
                    f"the sparse table is full ({self.capacity} rows) and has no initializer to grow with"
                )
            extra = self.initializer(need - self.capacity).astype(self.value.dtype, copy=False)
            self.value = np.concatenate([self.value, extra.reshape(-1, *self.row_shape)])
        index = self._row_index()
        self._append_rows(fresh)
        index.add(fresh, base + np.arange(fresh.size, dtype=np.int64))
        return base + rank[inverse.reshape(-1)]

    def _append_rows(self, fresh: np.ndarray) -> None:
        """`rows` is a view of a buffer grown by doubling, so appending is amortised O(new):
        a reader holding the old `rows` keeps a consistent prefix."""
        n, k = self.rows.size, fresh.size
        buf = self._rows_buf
        if buf is None or self.rows.base is not buf or buf.size < n + k:
            buf = np.empty(max(2 * (n + k), 1024), np.int64)
            buf[:n] = self.rows
            self._rows_buf = buf
        buf[n : n + k] = fresh
        self.rows = buf[: n + k]

    def __repr__(self) -> str:
        value = f"{self.value.dtype}{list(self.value.shape)}"
        return f"SelectedRows(rows={self.rows.size}, height={self.height}, value={value})"


class _RowIndex:
    """id -> slot of an auto-grown table, without a Python dict.

    Ids in `[0, limit)` (every id of a table whose ids are row numbers, the usual case)
    live in a direct-address array, `direct[id] = slot` (int32 while slots fit, -1 for absent), grown by
    doubling up to the largest id seen: a lookup is one gather, as fast as indexing the
    table itself. Other ids (negative, or hashed feature ids far beyond the table's size)
    live in a big sorted run plus a small sorted run of recent inserts, searched by
    binary search; the small run is folded into the big one when it passes 1/8 of it,
    so inserting costs amortised O(ids inserted) copies, never a re-sort of the table.
    """

    __slots__ = ("count", "limit", "direct", "ids", "slots", "recent_ids", "recent_slots")
    MIN_LIMIT = 1 << 22  # ids below this are always direct (16 MB of int32 at most)
    MIN_RECENT = 4096

    def __init__(self, rows: np.ndarray, size_hint: int) -> None:
        self.count = 0
        self.limit = max(self.MIN_LIMIT, 4 * size_hint)
        self.direct = np.zeros(0, np.int32)
        empty = np.zeros(0, np.int64)
        self.ids, self.slots, self.recent_ids, self.recent_slots = empty, empty, empty, empty
        if rows.size:
            self.add(rows, np.arange(rows.size, dtype=np.int64))

    def find(self, ids: np.ndarray) -> np.ndarray:
        if ids.size == 0:
            return np.zeros(0, np.int64)
        lo, hi = int(ids.min()), int(ids.max())
        if lo >= 0 and hi < self.direct.size:
            return self.direct[ids].astype(np.int64)
        slots = np.full(ids.shape, -1, np.int64)
        near = (ids >= 0) & (ids < self.direct.size)
        slots[near] = self.direct[ids[near]]
        far = (ids < 0) | (ids >= self.limit)
        if far.any() and (self.ids.size or self.recent_ids.size):
            far_ids = ids[far]
            found = _search(self.ids, self.slots, far_ids)
            if self.recent_ids.size:
                missing = found < 0
                found[missing] = _search(self.recent_ids, self.recent_slots, far_ids[missing])
            slots[far] = found
        return slots

    def add(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Index distinct `ids` (none present yet) at `slots`."""
        self.count += int(ids.size)
        near = (ids >= 0) & (ids < self.limit)
        if near.any():
            near_ids = ids[near]
            need = int(near_ids.max()) + 1
            wide = self.direct.dtype == np.int64 or int(slots.max()) > np.iinfo(np.int32).max
            if need > self.direct.size or (wide and self.direct.dtype != np.int64):
                size = max(self.direct.size, min(self.limit, max(need, 2 * self.direct.size)))
                grown = np.full(size, -1, np.int64 if wide else np.int32)
                grown[: self.direct.size] = self.direct
                self.direct = grown
            self.direct[near_ids] = slots[near]
        if near.all():
            return
        far = ~near
        order = np.argsort(ids[far], kind="stable")
        far_ids, far_slots = ids[far][order], slots[far][order]
        at = np.searchsorted(self.recent_ids, far_ids)
        self.recent_ids = np.insert(self.recent_ids, at, far_ids)
        self.recent_slots = np.insert(self.recent_slots, at, far_slots)
        if self.recent_ids.size > max(self.MIN_RECENT, self.ids.size // 8):
            at = np.searchsorted(self.ids, self.recent_ids)
            self.ids = np.insert(self.ids, at, self.recent_ids)
            self.slots = np.insert(self.slots, at, self.recent_slots)
            self.recent_ids = self.recent_ids[:0]
            self.recent_slots = self.recent_slots[:0]


def _search(sorted_ids: np.ndarray, slots: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """`slots[j]` where `sorted_ids[j] == id`, else -1, for each id."""
    if sorted_ids.size == 0:
        return np.full(ids.shape, -1, np.int64)
    pos = np.searchsorted(sorted_ids, ids)
    np.minimum(pos, sorted_ids.size - 1, out=pos)
    return np.where(sorted_ids[pos] == ids, slots[pos], -1).astype(np.int64, copy=False)


def shape_of(value: Any) -> tuple[int, ...] | None:
    """The shape of a scope value (the dense shape for SelectedRows), None if it has none."""
    if isinstance(value, (LoDTensor, SelectedRows)):
        return tuple(value.shape)
    if isinstance(value, np.ndarray):
        return value.shape
    return None


def dtype_of(value: Any) -> np.dtype | None:
    if isinstance(value, (LoDTensor, SelectedRows)):
        return value.dtype
    if isinstance(value, np.ndarray):
        return value.dtype
    return None


def describe(value: Any) -> str:
    """`fp32[4, 5]`, `selected_rows fp32[100, 16] rows=7`, ... for error messages."""
    if value is None:
        return "missing"
    shape, dtype = shape_of(value), dtype_of(value)
    if shape is None or dtype is None:
        return type(value).__name__
    text = f"{dtype}{list(shape)}"
    if isinstance(value, SelectedRows):
        return f"selected_rows {text} rows={value.rows.size}"
    if isinstance(value, LoDTensor) and value.lod:
        text += f" lod_levels={len(value.lod)}"
    return text
