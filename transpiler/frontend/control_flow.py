"""Comparisons, logic, and the `Switch` / `ConditionalBlock` that `piecewise_decay` builds.

A `ConditionalBlock` opens a sub-block (parent: the current block); the ops built inside
go there, and on leaving, one `conditional_block` op is appended to the parent with
`sub_block` pointing at it, `Input` = the vars the sub-block reads from outside, `Out` =
the outer vars it writes, and a fresh `STEP_SCOPES` var as `Scope`. Fluid collects
those with Python sets; here they keep first-use order, so the op is deterministic.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from transpiler.frontend.errors import BuildError
from transpiler.frontend.framework import Variable, append_op, create_var, default_main_program
from transpiler.frontend.layer_helper import LayerHelper
from transpiler.ir import DType, VarKind


def _compare(op_type: str, x: Variable, y: Variable, force_cpu: bool | None, cond: Variable | None) -> Variable:
    helper = LayerHelper(op_type, x=x, y=y)
    helper.check_variable(x, "x")
    helper.check_variable(y, "y")
    if cond is None:
        cond = helper.create_variable_for_type_inference(DType.BOOL)
        cond.stop_gradient = True
    attrs = {} if force_cpu is None else {"force_cpu": force_cpu}
    helper.append_op(op_type, {"X": [x], "Y": [y]}, {"Out": [cond]}, attrs)
    return cond


def less_than(x, y, force_cpu=None, cond=None):
    return _compare("less_than", x, y, force_cpu, cond)


def less_equal(x, y, cond=None):
    return _compare("less_equal", x, y, None, cond)


def greater_than(x, y, cond=None):
    return _compare("greater_than", x, y, None, cond)


def greater_equal(x, y, cond=None):
    return _compare("greater_equal", x, y, None, cond)


def equal(x, y, cond=None):
    return _compare("equal", x, y, None, cond)


def not_equal(x, y, cond=None):
    return _compare("not_equal", x, y, None, cond)


def _logical(op_type: str, x: Variable, y: Variable | None, out: Variable | None, name: str | None) -> Variable:
    helper = LayerHelper(op_type, x=x, y=y, name=name)
    helper.check_variable(x, "x")
    for var, what in ((x, "x"), (y, "y")):
        if var is not None and var.dtype != DType.BOOL:
            raise helper.error(f"{what} {var.name!r} is {var.dtype.short}; {op_type} needs bool inputs")
    if out is None:
        out = helper.create_variable_for_type_inference(x.dtype) if name is None else helper.create_variable(
            name=name, dtype=x.dtype, persistable=False
        )
    inputs = {"X": x} if y is None else {"X": x, "Y": y}
    helper.append_op(op_type, inputs, {"Out": out})
    return out


def logical_and(x, y, out=None, name=None):
    return _logical("logical_and", x, y, out, name)


def logical_or(x, y, out=None, name=None):
    return _logical("logical_or", x, y, out, name)


def logical_xor(x, y, out=None, name=None):
    return _logical("logical_xor", x, y, out, name)


def logical_not(x, out=None, name=None):
    return _logical("logical_not", x, None, out, name)


class ConditionalBlock:
    """Runs the ops built under `block()` when `inputs[0]` holds (`is_scalar_condition`)."""

    def __init__(self, inputs: Sequence[Variable], is_scalar_condition: bool = False, name: str | None = None) -> None:
        for var in inputs:
            if not isinstance(var, Variable):
                raise BuildError("conditional_block", f"conditions must be Variables, got {type(var).__name__}")
        self.inputs = list(inputs)
        self.is_scalar_condition = is_scalar_condition
        self.helper = LayerHelper("conditional_block", name=name)

    @contextmanager
    def block(self) -> Iterator[None]:
        program = default_main_program()
        program._create_block()
        try:
            yield
            self.complete()
        finally:
            program._rollback()

    def complete(self) -> None:
        program = default_main_program()
        inside = program.current_block()
        parent = program.block(inside.parent_idx)
        params: dict[str, None] = {}
        written: dict[str, None] = {}
        for op in inside.ops:
            for name in op.input_names:
                if name not in written:
                    params[name] = None
            for name in op.output_names:
                written[name] = None
        missing = [n for n in params if parent.find_var(n) is None and not inside.has_var(n)]
        if missing:
            raise BuildError(self.helper.name, f"the sub-block reads {missing}, which no enclosing block declares")
        inputs = [n for n in params if parent.find_var(n) is not None]
        outputs = [n for n in written if parent.find_var(n) is not None]
        scope = create_var(parent, kind=VarKind.STEP_SCOPES, layer=self.helper.name)
        append_op(
            parent,
            "conditional_block",
            {"Cond": self.inputs, "Input": inputs},
            {"Out": outputs, "Scope": [scope]},
            {"sub_block": inside, "is_scalar_condition": self.is_scalar_condition},
            layer=self.helper.name,
        )


class Switch:
    """`with Switch() as s: with s.case(cond): ...; with s.default(): ...` — each case a
    `conditional_block` guarded by "this condition and none before"."""

    def __init__(self, name: str | None = None) -> None:
        self.helper = LayerHelper("switch", name=name)
        self.inside_scope = False
        self.pre_not_conditions: list[Variable] = []

    def case(self, condition: Variable):
        if not self.inside_scope:
            raise BuildError(self.helper.name, "case() must be used inside `with Switch() as switch:`")
        if not isinstance(condition, Variable) or condition.dtype != DType.BOOL:
            raise BuildError(self.helper.name, f"a case needs a bool condition, got {condition!r}")
        if not self.pre_not_conditions:
            cond_block = ConditionalBlock([condition], is_scalar_condition=True)
            self.pre_not_conditions.append(logical_not(x=condition))
        else:
            previous = self.pre_not_conditions[-1]
            self.pre_not_conditions.append(logical_and(x=previous, y=logical_not(x=condition)))
            cond_block = ConditionalBlock([logical_and(x=previous, y=condition)], is_scalar_condition=True)
        return cond_block.block()

    def default(self):
        if not self.pre_not_conditions:
            raise BuildError(self.helper.name, "default() needs at least one case() before it")
        return ConditionalBlock([self.pre_not_conditions[-1]], is_scalar_condition=True).block()

    def __enter__(self) -> Switch:
        self.inside_scope = True
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.inside_scope = False
        return False
