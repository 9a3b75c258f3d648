"""`run_op`: run one op on given values, for tests and quick experiments.

    out = run_op("mul", {"X": x, "Y": w}, attrs={"x_num_col_dims": 1})["Out"]

Builds a one-op program (inputs declared with their dtype and shape, outputs as plain
LoD tensors unless `output_kinds` says otherwise), runs it with an `Executor` and
returns each output slot's value: a numpy array for a LoDTensor (`raw=True` keeps the
LoDTensor), a SelectedRows as is, a list for multi-arg slots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ops.executor import Executor
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows
from transpiler.ir import DType, Program, VarKind


def _arg_names(slot: str, count: int, multi: bool) -> list[str]:
    return [f"{slot}_{i}" for i in range(count)] if multi else [slot]


def run_op(
    op_type: str,
    inputs: Mapping[str, Any] | None = None,
    outputs: Sequence[str] | Mapping[str, int] = ("Out",),
    attrs: Mapping[str, Any] | None = None,
    *,
    output_kinds: Mapping[str, VarKind] | None = None,
    output_shapes: Mapping[str, Sequence[int]] | None = None,
    scope: Scope | None = None,
    executor: Executor | None = None,
    raw: bool = False,
) -> dict[str, Any]:
    """Run `op_type` once. `inputs` maps a slot to a value or a list of values;
    `outputs` names single-arg slots, or maps a slot to its number of args."""
    program = Program.empty()
    block = program.global_block()
    feed: dict[str, Any] = {}
    in_slots: dict[str, list[str]] = {}
    for slot, value in (inputs or {}).items():
        multi = isinstance(value, (list, tuple))
        values = list(value) if multi else [value]
        names = _arg_names(slot, len(values), multi)
        in_slots[slot] = names
        for name, v in zip(names, values, strict=True):
            feed[name] = v
            _declare_input(block, name, v)
    counts = dict(outputs) if isinstance(outputs, Mapping) else {slot: 1 for slot in outputs}
    out_slots: dict[str, list[str]] = {}
    for slot, count in counts.items():
        multi = isinstance(outputs, Mapping)
        names = [f"out.{n}" for n in _arg_names(slot, count, multi)]
        out_slots[slot] = names
        kind = (output_kinds or {}).get(slot, VarKind.LOD_TENSOR)
        shape = (output_shapes or {}).get(slot)
        for name in names:
            block.create_var(name, kind, DType.FP32 if shape is not None else None, shape)
    block.add_op(op_type, in_slots, out_slots, dict(attrs or {}))
    scope = Scope() if scope is None else scope
    exe = Executor() if executor is None else executor
    exe.run(program, feed=feed, scope=scope)
    result: dict[str, Any] = {}
    for slot, names in out_slots.items():
        values = [_unwrap(scope.find_var(n), raw) for n in names]
        result[slot] = values if isinstance(outputs, Mapping) else values[0]
    return result


def _declare_input(block, name: str, value: Any) -> None:
    if isinstance(value, SelectedRows):
        block.create_var(name, VarKind.SELECTED_ROWS, DType.from_any(value.dtype), value.shape)
        return
    array = value.array if isinstance(value, LoDTensor) else np.asarray(value)
    try:
        dtype = DType.from_any(array.dtype)
    except ValueError:
        dtype = None
    lod_level = len(value.lod) if isinstance(value, LoDTensor) else 0
    block.create_var(name, VarKind.LOD_TENSOR, dtype, array.shape if dtype is not None else None, lod_level=lod_level)


def _unwrap(value: Any, raw: bool) -> Any:
    if isinstance(value, LoDTensor) and not raw:
        return value.array
    return value
