"""What a pserver accepts from a trainer, checked before anything is applied.

The pserver program says what each trainer may send (`listen_and_serv`'s `X`, the
per-trainer vars a table's block reads, the declared vars): `Expected` holds, per name,
the kind, shape and dtype of the var and, for a per-trainer var (`<grad>.trainer_<id>`,
or a shard or block of one), the only trainer that may send it. A batch is checked as a
whole before any of it is stored; the first problem refuses it (`Refused`, answered as
INVALID_ARGUMENT) with a message naming the pserver, the trainer, the var and what is
wrong:

* the name: a var the pserver receives (`received`, or a key of `grad_to_block`); a
  `merge_add` send (the async lr-decay step counter) may also name a declared
  per-trainer var; anything else is refused;
* the trainer: a batch's vars carry its trainer id, and a per-trainer var only the
  id in its name;
* a dense tensor: the declared dtype and shape exactly (a -1 dim takes any size);
* a SelectedRows: the declared dtype and row shape, the declared height, and every
  row id in [0, height);
* with `refuse_nonfinite`, a NaN or an Inf anywhere in the value (Paddle accepts them,
  and so does the pserver by default).

A config without `known_vars` (tests, a hand-built `ServeConfig`) accepts any name and
checks only the vars it has a template for.

`max_message(config)` bounds one received message: the largest batch one trainer may
send (every var it may send, at its declared size; a SelectedRows up to one row per id of
its height) plus slack, and never below `MESSAGE_FLOOR` (prefetch ids and SelectedRows
with repeated ids are not bounded by the program). gRPC refuses a bigger message
(RESOURCE_EXHAUSTED) from its length prefix, before the handler runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ops.rpc.wire import WireBatch, WireVar
from ops.tensor import LoDTensor, SelectedRows
from transpiler.naming import trainer_of

MESSAGE_FLOOR = 64 * 1024 * 1024  # bytes: below this no message is refused for its size
MESSAGE_SLACK_PER_VAR = 4096  # bytes of header, name and alignment per var


class Refused(Exception):
    """A received var the pserver program does not expect from that trainer."""


@dataclass(frozen=True)
class VarSpec:
    """What one received var must be."""

    shape: tuple[int, ...] | None  # dense: the shape; SelectedRows: (height, *row shape); None: unknown
    dtype: np.dtype | None
    sparse: bool = False
    trainer: int | None = None  # the only trainer that may send it

    def nbytes(self) -> int:
        """The most bytes a value of this var takes on the wire (0 when unknown)."""
        if self.shape is None or self.dtype is None or any(d < 0 for d in self.shape):
            return 0
        size = math.prod(self.shape) * self.dtype.itemsize
        return size + (self.shape[0] * 8 if self.sparse and self.shape else 0)


def _spec(name: str, templates: Mapping[str, tuple[tuple[int, ...], Any]], sparse: frozenset[str]) -> VarSpec:
    shape, dtype = templates.get(name, (None, None))
    return VarSpec(
        shape=tuple(int(d) for d in shape) if shape is not None else None,
        dtype=np.dtype(dtype) if dtype is not None else None,
        sparse=name in sparse,
        trainer=trainer_of(name),
    )


class Expected:
    """The vars one pserver accepts, and the check of a received batch against them."""

    def __init__(self, config: Any) -> None:
        self.endpoint = config.endpoint
        self.refuse_nonfinite = bool(config.refuse_nonfinite)
        templates, sparse = config.templates, config.sparse_vars
        self.open = config.known_vars is None  # no program: any name goes
        names = (*config.received, *config.grad_to_block)
        self.received = {name: _spec(name, templates, sparse) for name in names}
        counters = (n for n in (config.known_vars or ()) if trainer_of(n) is not None and n not in self.received)
        self.counters = {name: _spec(name, templates, sparse) for name in counters}  # merge_add only
        self.templates = templates
        self.sparse = sparse

    def check(self, batch: WireBatch) -> None:
        """Raise `Refused` at the first var of `batch` the pserver does not expect."""
        for var in batch.vars:
            self.check_var(var, batch.trainer_id)

    def check_var(self, var: WireVar, trainer_id: int) -> None:
        """Raise `Refused` when `trainer_id` may not send `var` as it is. The happy path
        builds no string: a few dict and attribute reads per var."""
        problem = self._problem(var, trainer_id)
        if problem is not None:
            raise Refused(f"pserver {self.endpoint}: trainer {trainer_id}'s send of {var.name!r}: {problem}")

    def _problem(self, var: WireVar, trainer_id: int) -> str | None:
        spec = self.received.get(var.name)
        if spec is None and var.merge_add:
            spec = self.counters.get(var.name)
        if spec is None:
            if not self.open:
                return "the pserver does not receive that var"
            spec = _spec(var.name, self.templates, self.sparse)
        if var.trainer_id != trainer_id:
            return f"the var says it is trainer {var.trainer_id}'s"
        if spec.trainer is not None and spec.trainer != trainer_id:
            return f"that var is trainer {spec.trainer}'s"
        value = var.value
        if type(value) is LoDTensor or isinstance(value, LoDTensor):
            array = value.array
            if spec.sparse:
                return "a dense tensor for a SelectedRows var"
            if spec.shape is not None and array.shape != spec.shape and not _fits(array.shape, spec.shape):
                return f"shape {list(array.shape)} does not match the expected {list(spec.shape)}"
        elif isinstance(value, SelectedRows):
            array = value.value
            problem = _rows_problem(spec, value)
            if problem is not None:
                return problem
        elif value is None:
            return "the message carries no value"
        else:
            return f"a {type(value).__name__} is not a tensor"
        if spec.dtype is not None and array.dtype != spec.dtype:
            return f"dtype {array.dtype} does not match the expected {spec.dtype}"
        if self.refuse_nonfinite and array.dtype.kind in "fc" and not np.isfinite(array).all():
            bad = int(np.count_nonzero(~np.isfinite(array)))
            return f"{bad} NaN or Inf value(s) (the pserver refuses non-finite grads)"
        return None


def _rows_problem(spec: VarSpec, value: SelectedRows) -> str | None:
    if spec.shape is None:
        return None
    if not spec.sparse:
        return f"a SelectedRows for a dense var of shape {list(spec.shape)}"
    height, row = spec.shape[0], spec.shape[1:]
    if not _fits(value.row_shape, row):
        return f"rows of shape {list(value.row_shape)} do not match the expected {list(row)}"
    if height < 0:
        return None
    if value.height != height:
        return f"height {value.height} does not match the expected {height}"
    rows = value.rows
    if rows.size:
        low, high = int(rows.min()), int(rows.max())
        if low < 0 or high >= height:
            return f"row id {low if low < 0 else high} is outside [0, {height})"
    return None


def _fits(shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    return len(shape) == len(expected) and all(e < 0 or s == e for s, e in zip(shape, expected, strict=True))


def max_message(config: Any) -> int:
    """The receive limit for a pserver (bytes; -1: none, for a config without a program)."""
    if config.known_vars is None:
        return -1
    expected = Expected(config)
    specs = {**expected.received, **expected.counters}
    largest = 0
    for trainer in range(config.fanin):
        mine = [s for s in specs.values() if s.trainer in (None, trainer)]
        largest = max(largest, sum(s.nbytes() + MESSAGE_SLACK_PER_VAR for s in mine))
    return max(MESSAGE_FLOOR, largest + MESSAGE_FLOOR // 4)


__all__ = ["MESSAGE_FLOOR", "Expected", "Refused", "VarSpec", "max_message"]
