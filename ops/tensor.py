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
    if lod is None:
        return ()
    levels = []
    for level in lod:
        arr = np.asarray(level, dtype=np.int64).reshape(-1)
        arr.flags.writeable = False
        levels.append(arr)
    return tuple(levels)


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

    __slots__ = ("rows", "height", "value", "initializer", "lock", "_sorted_ids", "_sorted_slots")

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
        self._sorted_ids: np.ndarray | None = None
        self._sorted_slots: np.ndarray | None = None

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
        np.add.at(dense, self.rows, self.active_value())
        return dense

    def merged(self) -> SelectedRows:
        """Duplicate rows summed, rows sorted ascending (Paddle's MergeAdd)."""
        uniq, inverse = np.unique(self.rows, return_inverse=True)
        if uniq.size == self.rows.size and np.array_equal(uniq, self.rows):
            return SelectedRows(self.rows, self.active_value(), self.height)
        value = np.zeros((uniq.size, *self.row_shape), dtype=self.value.dtype)
        np.add.at(value, inverse.reshape(-1), self.active_value())
        return SelectedRows(uniq, value, self.height)

    # -- the auto-grown table
    def lookup_index(self, ids: Any, *, grow: bool) -> np.ndarray:
        """Slot of each id in `value` (int64, shaped like `ids` flattened); -1 for an
        unknown id when `grow` is False. Thread-safe."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        with self.lock:
            slots = self._find(ids)
            missing = slots < 0
            if grow and missing.any():
                self._add(ids[missing])
                slots = self._find(ids)
            return slots

    def _find(self, ids: np.ndarray) -> np.ndarray:
        if self._sorted_ids is None or self._sorted_ids.size != self.rows.size:
            order = np.argsort(self.rows, kind="stable")
            self._sorted_ids, self._sorted_slots = self.rows[order], order
        sorted_ids, sorted_slots = self._sorted_ids, self._sorted_slots
        if sorted_ids.size == 0:
            return np.full(ids.shape, -1, np.int64)
        pos = np.minimum(np.searchsorted(sorted_ids, ids), sorted_ids.size - 1)
        found = sorted_ids[pos] == ids
        return np.where(found, sorted_slots[pos], -1).astype(np.int64)

    def _add(self, new_ids: np.ndarray) -> None:
        uniq, first = np.unique(new_ids, return_index=True)
        fresh = uniq[np.argsort(first, kind="stable")]  # first-touch order, as Paddle inserts
        need = self.rows.size + fresh.size
        if need > self.capacity:
            if self.initializer is None:
                raise ValueError(
                    f"the sparse table is full ({self.capacity} rows) and has no initializer to grow with"
                )
            extra = self.initializer(need - self.capacity).astype(self.value.dtype, copy=False)
            self.value = np.concatenate([self.value, extra.reshape(-1, *self.row_shape)])
        self.rows = np.concatenate([self.rows, fresh])
        self._sorted_ids = None

    def __repr__(self) -> str:
        value = f"{self.value.dtype}{list(self.value.shape)}"
        return f"SelectedRows(rows={self.rows.size}, height={self.height}, value={value})"


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
