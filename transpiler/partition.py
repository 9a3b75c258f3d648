"""Partitioners: how each parameter is cut into rectangles and which pserver holds each.

A parameter of shape `[d0, d1, ...]` is seen as a matrix of `rows = d0` and
`cols = d1 * d2 * ...` (a rank-1 param has one column, a 0-d one is 1 x 1). A
`Partition(start_row, end_row, start_col, end_col)` is a rectangle of that matrix; a
param's partitions must tile it exactly. Today's axis-0 blocks are the case with one
column range (`paddle`, the default, which keeps Paddle's slicing and dispatchers).

Write your own as in Angel (`PSPartitioner`): subclass `Partitioner`, implement
`partitions(param) -> list[Partition]` and optionally `assign(partitions) -> list[int]`
(a pserver index per partition; each `Partition` handed to `assign` carries its
`param`), and pass the class (or an instance) as `transpile(..., partitioner=...)`,
`DistributeTranspilerConfig.partitioner` or `--partitioner module:Class`. The transpiler
sets `self.servers` (the pserver count) and calls `reset()` before the first param, then
`partitions` and `assign` once per param in program order. The result must depend only on
the params and the server count (every trainer computes it on its own).

Built in: `paddle` (Paddle's `slice_variable` + `split_method`), `angel` (Angel 1.x's
default PSPartitioner), `column` (every partition holds all rows and a column range,
TorchRec's column-wise sharding).

Trainers cut a grad by row bands (`split_byref`) and each band by columns (`split`, axis
1), and join the param back the other way (`concat` axis 1, then axis 0), so a param's
partitions must form row bands: the partitions with the same row range cover all its
columns. Column ranges are supported on dense params of any rank and `is_sparse` ones (whose
SelectedRows grads are cut by column ranges of their values: `split_selected_rows_by_columns`;
a prefetched table's rows are fetched from every column piece and joined). The distributed
table (`is_distributed`) is cut like any param by every partitioner but `paddle` (which keeps
`id % M`): its pieces are auto-grown tables (`ParamInfo.distributed`). A dense rank-3+
param cut by columns is a `[d0, d1 * d2 * ...]` matrix in every block: the trainer
`reshape2`s its grad to that before cutting it and joins its param as that before
`reshape2`ing it back (`<var>.flat`); a rank-3+ sparse table is cut by rows only.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from transpiler.errors import TranspileError
from transpiler.ir.types import DType


@dataclass(frozen=True)
class ParamInfo:
    """What a partitioner sees of a parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    optimizer: str
    sparse: bool = False  # an is_sparse embedding (SelectedRows grads)
    table: bool = False  # trainers prefetch its rows (a remote-prefetch sparse table, or the distributed one)
    distributed: bool = False  # the distributed lookup table (`is_distributed`: auto-grown pieces)
    row_cuts_only: bool = False  # a pserver op needs its whole rows (a norm): no column cut
    merged_grad: bool = False  # the trainer sends a row per distinct id (it merges its lookups' grads)

    @property
    def rows(self) -> int:
        return int(self.shape[0]) if self.shape else 1

    @property
    def cols(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) >= 2 else 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Partition:
    """Rows `[start_row, end_row)` x columns `[start_col, end_col)` of a param."""

    start_row: int
    end_row: int
    start_col: int
    end_col: int
    param: ParamInfo | None = None  # set by the transpiler before `assign`

    @property
    def rows(self) -> int:
        return self.end_row - self.start_row

    @property
    def cols(self) -> int:
        return self.end_col - self.start_col

    @property
    def numel(self) -> int:
        return self.rows * self.cols


class Partitioner:
    """Base class. `partitions(param)` cuts a param; `assign(partitions)` places them
    (default: round robin over the servers, continuing from param to param)."""

    name = "custom"

    def __init__(self) -> None:
        self.servers = 1
        self.trainers = 1  # set by the transpiler, as `servers`
        self.sync_mode = True
        self._next = 0

    def reset(self) -> None:
        self._next = 0

    def prepare(self, params: Sequence[ParamInfo]) -> None:
        """Called once with every param (program order) after `reset`, before the first
        `partitions`: a partitioner that plans globally (`plan`) searches here."""

    def partitions(self, param: ParamInfo) -> list[Partition]:
        raise NotImplementedError

    def assign(self, partitions: Sequence[Partition]) -> list[int]:
        out = []
        for _ in partitions:
            out.append(self._next)
            self._next = (self._next + 1) % self.servers
        return out


class PaddlePartitioner(Partitioner):
    """Paddle's slicing (`slice_variable`: whole-row blocks of at least `min_block_size`
    elements, at most one per pserver) placed by the `split_method` dispatcher. The
    transpiler runs it as it always has (`passes/slice_vars.py`); this class names it."""

    name = "paddle"

    def partitions(self, param: ParamInfo) -> list[Partition]:  # pragma: no cover - the pass slices itself
        raise TranspileError("the paddle partitioner is run by the slice_vars pass itself")


class ColumnPartitioner(Partitioner):
    """Every partition holds all rows and a column range: `min(servers, cols)` ranges of
    near-equal width (the first `cols % n` one wider). A param with one column (rank 1)
    stays whole; a rank-3+ param is cut as its `[d0, d1 * d2 * ...]` matrix (a sparse one
    stays whole)."""

    name = "column"

    def __init__(self, parts: int | None = None) -> None:
        super().__init__()
        self.parts = parts

    def partitions(self, param: ParamInfo) -> list[Partition]:
        rows, cols = param.rows, param.cols
        if len(param.shape) > 2 and (param.sparse or param.table):
            return [Partition(0, rows, 0, cols)]
        count = max(1, min(self.parts or self.servers, cols))
        base, extra = divmod(cols, count)
        out, start = [], 0
        for i in range(count):
            width = base + (1 if i < extra else 0)
            out.append(Partition(0, rows, start, start + width))
            start += width
        return out


class AngelPartitioner(Partitioner):
    """Angel 1.x's default `PSPartitioner`: S servers, at most P elements a partition
    (`max_elements`, 5,000,000 by default).

    rows >= S: `blockRow = min(rows / S, max(1, P / cols))`, `blockCol = min(P / blockRow, cols)`;
    rows <  S: `blockRow = rows`, `blockCol = min(P / rows, max(100, cols / S))`;
    (integer divisions) partitions laid out row-major, the last row and column ranges
    shorter, partition i of a param on server `i % S`. A rank-3+ sparse table, which cannot
    be cut by columns, gets `blockCol = cols`.
    """

    name = "angel"

    def __init__(self, max_elements: int = 5_000_000) -> None:
        super().__init__()
        if max_elements < 1:
            raise TranspileError(f"angel: max_elements must be >= 1, got {max_elements}")
        self.max_elements = max_elements

    def partitions(self, param: ParamInfo) -> list[Partition]:
        rows, cols, s, p = param.rows, param.cols, self.servers, self.max_elements
        if rows >= s:
            block_row = max(1, min(rows // s, max(1, p // max(cols, 1))))
            block_col = max(1, min(p // block_row, cols))
        else:
            block_row = max(rows, 1)
            block_col = max(1, min(p // block_row, max(100, cols // s)))
        if len(param.shape) > 2 and (param.sparse or param.table):
            block_col = cols
        out = []
        for r in range(0, rows, block_row):
            for c in range(0, max(cols, 1), block_col):
                out.append(Partition(r, min(r + block_row, rows), c, min(c + block_col, cols)))
        return out or [Partition(0, rows, 0, cols)]

    def assign(self, partitions: Sequence[Partition]) -> list[int]:
        return [i % self.servers for i in range(len(partitions))]


PARTITIONERS: dict[str, type[Partitioner]] = {
    "paddle": PaddlePartitioner,
    "angel": AngelPartitioner,
    "column": ColumnPartitioner,
}


# `plan`'s `--pserver-cores` for every process (a count, or `off`): `launch` sets this machine's
# core count when its pservers outnumber the cores (every process of a local launch on one host).
PSERVER_CORES_ENV = "PSTRANSPILE_PSERVER_CORES"


def _plan_partitioner() -> Partitioner:
    """`plan` with its defaults, and the cores the pservers share from `PSTRANSPILE_PSERVER_CORES`
    (a count, or `off`; what `launch --partitioner plan` sets on a host with fewer cores than
    pservers)."""
    import os

    from transpiler.planner import PlanPartitioner  # the cost model imports numpy: only when asked for

    value = os.environ.get(PSERVER_CORES_ENV, "").strip()
    cores = None
    if value and value.lower() != "off":
        try:
            cores = int(value)
        except ValueError:
            raise TranspileError(f"{PSERVER_CORES_ENV}={value!r}: give a core count >= 1, or off") from None
    return PlanPartitioner(cores=cores)


def resolve_partitioner(spec: str | type[Partitioner] | Partitioner | None) -> Partitioner:
    """A partitioner instance from an instance, a class, a built-in name or
    `module:Class` (imported); None is `paddle`."""
    if spec is None:
        return PaddlePartitioner()
    if isinstance(spec, Partitioner):
        return spec
    if isinstance(spec, type) and issubclass(spec, Partitioner):
        return spec()
    if isinstance(spec, str):
        key = spec.strip()
        if key.lower() in PARTITIONERS:
            return PARTITIONERS[key.lower()]()
        if key.lower() == "plan":
            return _plan_partitioner()
        if ":" in key:
            module_name, _, attr = key.partition(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                raise TranspileError(f"partitioner {spec!r}: cannot import {module_name!r}: {exc}") from None
            found = getattr(module, attr, None)
            if isinstance(found, type) and issubclass(found, Partitioner):
                return found()
            raise TranspileError(f"partitioner {spec!r}: {module_name}.{attr} is not a Partitioner subclass")
        raise TranspileError(f"unknown partitioner {spec!r} (known: {', '.join(PARTITIONERS)}, plan, or module:Class)")
    raise TranspileError(f"partitioner must be a Partitioner (class or instance), a name or module:Class, got {spec!r}")


def partitioner_name(partitioner: Partitioner) -> str:
    cls = type(partitioner)
    return partitioner.name if partitioner.name != "custom" else f"{cls.__module__}.{cls.__qualname__}"


def checked_partitions(param: ParamInfo, partitions: Sequence[Partition], who: str) -> list[Partition]:
    """`partitions` of `param` in row-major order, checked: each in range and non-empty,
    together tiling the param exactly, in row bands (the partitions of one row range cover
    every column). Anything else is one `TranspileError` naming the param and the problem."""
    rows, cols = param.rows, param.cols
    where = f"partitioner {who}: param {param.name!r} {list(param.shape)} ({rows} rows x {cols} columns)"
    if not partitions:
        raise TranspileError(f"{where}: no partitions")
    for p in partitions:
        if not isinstance(p, Partition):
            raise TranspileError(f"{where}: {p!r} is not a Partition")
        if not (0 <= p.start_row < p.end_row <= rows and 0 <= p.start_col < p.end_col <= cols):
            raise TranspileError(f"{where}: partition rows [{p.start_row}, {p.end_row}) x columns "
                                 f"[{p.start_col}, {p.end_col}) is empty or out of range")
    ordered = sorted(partitions, key=lambda p: (p.start_row, p.start_col, p.end_row, p.end_col))
    bands: list[list[Partition]] = []
    for p in ordered:
        if bands and bands[-1][0].start_row == p.start_row:
            bands[-1].append(p)
        else:
            bands.append([p])
    expected_row = 0
    for band in bands:
        first = band[0]
        if first.start_row > expected_row:
            raise TranspileError(f"{where}: rows [{expected_row}, {first.start_row}) are in no partition (a gap)")
        if first.start_row < expected_row:
            raise TranspileError(f"{where}: partitions overlap at row {first.start_row}")
        expected_col = 0
        for p in band:
            if p.end_row != first.end_row:
                raise TranspileError(f"{where}: partitions starting at row {p.start_row} end at rows "
                                     f"{first.end_row} and {p.end_row}: they overlap, or are not laid out in row bands "
                                     "(the partitions of one row range must cover every column)")
            if p.start_col > expected_col:
                raise TranspileError(f"{where}: columns [{expected_col}, {p.start_col}) of rows "
                                     f"[{p.start_row}, {p.end_row}) are in no partition (a gap)")
            if p.start_col < expected_col:
                raise TranspileError(f"{where}: partitions overlap at rows [{p.start_row}, {p.end_row}) "
                                     f"column {p.start_col}")
            expected_col = p.end_col
        if expected_col != cols:
            raise TranspileError(f"{where}: columns [{expected_col}, {cols}) of rows [{first.start_row}, "
                                 f"{first.end_row}) are in no partition (a gap)")
        expected_row = first.end_row
    if expected_row != rows:
        raise TranspileError(f"{where}: rows [{expected_row}, {rows}) are in no partition (a gap)")
    cut_columns = any(p.cols != cols for p in ordered)
    if cut_columns and len(param.shape) > 2 and (param.sparse or param.table):
        raise TranspileError(f"{where}: cuts columns of a rank-{len(param.shape)} sparse table; a table's rows are "
                             "cut by columns only when they are vectors (rank 2): cut its rows only")
    return [replace(p, param=param) for p in ordered]


def checked_assignment(param: ParamInfo, partitions: Sequence[Partition], servers: Sequence[int], who: str,
                       count: int) -> list[int]:
    try:
        servers = [int(s) for s in servers]
    except (TypeError, ValueError):
        raise TranspileError(f"partitioner {who}: assign for param {param.name!r} returned {servers!r}, "
                             "not a list of pserver indices") from None
    if len(servers) != len(partitions):
        raise TranspileError(f"partitioner {who}: assign for param {param.name!r} returned {len(servers)} pserver "
                             f"indices for {len(partitions)} partitions")
    bad = [s for s in servers if not 0 <= s < count]
    if bad:
        raise TranspileError(f"partitioner {who}: assign for param {param.name!r} returned pserver index {bad[0]}, "
                             f"out of range for {count} pserver(s)")
    return servers
