"""Optimizers on an auto-grown table (a pserver's shard of the distributed lookup table).

The table (`Param`) is a `SelectedRows` addressed by id (`lookup_index`). Its
param-shaped accumulators (the catalogue's `sliced` slots: moments, velocity, ...) are
`SelectedRows` that follow it (`SelectedRows.follow`): the same id at the same slot, a
row created in the table created in each with the accumulator's own initial value.
Scalar accumulators (Adam's beta powers) stay dense.

The update runs the op's own kernel on dense rows of the table, so it is the rule local
training applies, by construction, on the rows Paddle's sparse kernel updates (the
catalogue's `OptimizerSlots.updates_every_row`):

* the grad's rows (sgd, adagrad, ftrl, adam with `lazy_mode`): the kernel gets them
  gathered into a small dense param and accumulators;
* every row (momentum, rmsprop, adam without `lazy_mode`: absent rows with a zero grad,
  their state decaying): it gets every row the shard has created so far, the grad
  scattered on them. A row not created yet has its initial value and its accumulators'
  initial state, which these rules leave unchanged when the state starts at zero (the
  transpiler refuses other starts): local training does not move it either.

The results are written back in place, under the table's lock (prefetches read the
table concurrently); the outputs are the same `SelectedRows` objects.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ops.catalogue.optimizer_ops import optimizer_slots
from ops.kernels.context import KernelError, OpContext
from ops.tensor import LoDTensor, SelectedRows

KernelFn = Callable[[OpContext], None]


def on_table(kernel: KernelFn) -> KernelFn:
    """Decorate an optimizer kernel so that a `SelectedRows` param is updated as a table."""

    @functools.wraps(kernel)
    def run(ctx: OpContext) -> None:
        if isinstance(ctx.value("Param"), SelectedRows):
            update_table(ctx, kernel, ctx.value("Param"))
        else:
            kernel(ctx)  # holding no reference to the param (see `OpContext.may_update_in_place`)

    return run


def update_table(ctx: OpContext, kernel: KernelFn, table: SelectedRows) -> None:
    grad = ctx.value("Grad")
    if not isinstance(grad, SelectedRows):
        raise KernelError(f"{ctx.type} on a SelectedRows parameter (a table) needs a SelectedRows grad")
    grad = grad.merged()
    slots = optimizer_slots(ctx.type)
    accumulators: dict[str, SelectedRows] = {}
    for slot in slots.sliced:
        if not ctx.has_input(slot):
            continue  # rmsprop's MeanGrad when not centered
        value = ctx.value(slot)
        if not isinstance(value, SelectedRows):
            name = ctx.input_names(slot)[0]
            raise KernelError(
                f"{ctx.type}: the table's accumulator {slot}={name!r} must be a SelectedRows sharing the table's "
                "rows (declare it SELECTED_ROWS)"
            )
        accumulators[slot] = value
    with table.lock:
        at = table.lookup_index(grad.rows, grow=True)
        for value in accumulators.values():
            value.follow(table)
        if slots.updates_every_row(ctx.attr):
            pick: Any = slice(0, table.rows.size)
            sub_grad = SelectedRows(at, grad.value, table.rows.size)
        else:
            pick = at
            sub_grad = SelectedRows(np.arange(at.size, dtype=np.int64), grad.value, at.size)
        inputs = {"Param": table.value[pick], "Grad": sub_grad}
        inputs |= {slot: value.value[pick] for slot, value in accumulators.items()}
        targets = {slots.outputs["Param"]: table} | {slots.outputs[s]: v for s, v in accumulators.items()}
        rows_ctx = _RowsContext(ctx, inputs, frozenset(targets))
        kernel(rows_ctx)
        for slot, out in rows_ctx.captured.items():
            targets[slot].value[pick] = out
    for slot, value in targets.items():
        if slot in rows_ctx.captured:
            ctx.set_output(slot, value)


class _RowsContext(OpContext):
    """The op's context with some inputs replaced by dense rows of the table, and the
    outputs that alias them captured instead of stored."""

    __slots__ = ("replaced", "capture", "captured")

    def __init__(self, ctx: OpContext, replaced: dict[str, Any], capture: frozenset[str]) -> None:
        super().__init__(ctx.op, ctx.frame, ctx.run, ctx.spec)
        self.replaced = replaced
        self.capture = capture
        self.captured: dict[str, np.ndarray] = {}

    def value(self, slot: str, i: int = 0) -> Any:
        if i == 0 and slot in self.replaced:
            return self.replaced[slot]
        return super().value(slot, i)

    def optional_value(self, slot: str, i: int = 0) -> Any:
        if i == 0 and slot in self.replaced:
            return self.replaced[slot]
        return super().optional_value(slot, i)

    def set_output(self, slot: str, value: Any, *, lod: Any = None, i: int = 0) -> None:
        if i == 0 and slot in self.capture:
            self.captured[slot] = value.array if isinstance(value, LoDTensor) else np.asarray(value)
            return
        super().set_output(slot, value, lod=lod, i=i)
