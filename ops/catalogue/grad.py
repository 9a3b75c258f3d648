"""Grad makers: how the grad op(s) of a forward op are built, as Paddle's C++ makers do.

`GradSpec` is the table form of Paddle's `GradOpDescMaker`s: which forward inputs and
outputs the grad op reads, which output grads (`Out@GRAD`) it takes and which input
grads (`X@GRAD`) it writes, and whether it copies the forward op's attrs. The few
makers that build other op types (`sum` → `scale`s, `cast` → `cast`) are functions.

Input grads follow Paddle's `InputGrad(slot, drop_empty_grad)`: a grad in the no-grad
set becomes `@EMPTY@`, and for non-duplicable slots the empties are dropped, which is
why Fluid's `mul_grad` of a data input shows `X@GRAD=[]`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ops.catalogue.opdef import OpDef, SlotDef
from transpiler.ir import Attr, AttrType, Op
from transpiler.ir.types import EMPTY_VAR_NAME, GRAD_SUFFIX, OpRole


def grad_name(name: str) -> str:
    return name + GRAD_SUFFIX


class GradContext:
    """The forward op and the no-grad set a grad maker works from.

    `grad_to_var` records, for every grad name a maker hands out as an output, the
    forward var it is the grad of (backward uses it to find each param's grad).
    """

    def __init__(self, forward: Op, no_grad: Collection[str] = ()) -> None:
        self.forward = forward
        self.no_grad = no_grad
        self.grad_to_var: dict[str, str] = {}

    def input(self, slot: str) -> list[str]:
        return list(self.forward.input(slot))

    def output(self, slot: str) -> list[str]:
        return list(self.forward.output(slot))

    def output_grad(self, slot: str) -> list[str]:
        return [grad_name(n) for n in self.forward.output(slot)]

    def input_grad(self, slot: str, drop_empty: bool = True) -> list[str]:
        grads = []
        for name in self.forward.input(slot):
            grad = grad_name(name)
            if grad in self.no_grad:
                grads.append(EMPTY_VAR_NAME)
            else:
                self.grad_to_var[grad] = name
                grads.append(grad)
        if drop_empty:
            grads = [g for g in grads if g != EMPTY_VAR_NAME]
        return grads

    def attrs(self) -> dict[str, Attr]:
        return dict(self.forward.attrs)

    def attr(self, name: str, default: Any = None) -> Any:
        return self.forward.attr(name, default)


def new_op(op_type: str, inputs: dict[str, list[str]], outputs: dict[str, list[str]], attrs: dict[str, Attr]) -> Op:
    """A detached op with slots in the order Paddle's C++ `OpDesc` keeps them (sorted)."""
    return Op(op_type, dict(sorted(inputs.items())), dict(sorted(outputs.items())), attrs)


@dataclass(frozen=True)
class GradSpec:
    """A grad maker as a table row.

    The grad op reads forward `inputs` and `outputs` as they are, the grads of
    `out_grads`, and writes the grads of `in_grads`. `keep_empty` keeps `@EMPTY@`
    placeholders in duplicable input-grad slots (Paddle's `InputGrad(slot, false)`);
    `outputs_if` adds a forward output only when an attr has a value (sequence_pool's
    `MaxIndex` under `pooltype=MAX`).
    """

    type: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    out_grads: tuple[str, ...] = ("Out",)
    in_grads: tuple[str, ...] = ("X",)
    keep_empty: bool = False
    copy_attrs: bool = True
    outputs_if: tuple[tuple[str, str, Any], ...] = ()

    def __call__(self, ctx: GradContext) -> list[Op]:
        ins: dict[str, list[str]] = {}
        for slot in self.inputs:
            ins[slot] = ctx.input(slot)
        for slot in self.outputs:
            ins[slot] = ctx.output(slot)
        for slot, attr, value in self.outputs_if:
            if ctx.attr(attr) == value:
                ins[slot] = ctx.output(slot)
        for slot in self.out_grads:
            ins[grad_name(slot)] = ctx.output_grad(slot)
        outs = {grad_name(slot): ctx.input_grad(slot, drop_empty=not self.keep_empty) for slot in self.in_grads}
        return [new_op(self.type, ins, outs, ctx.attrs() if self.copy_attrs else {})]

    @property
    def grad_types(self) -> tuple[str, ...]:
        return (self.type,)

    def grad_def(self, forward: OpDef) -> OpDef:
        """The catalogue entry of the grad op this spec builds (slot flags follow the forward slots)."""

        def flags(slot: SlotDef | None, name: str, *, dispensable: bool = False) -> SlotDef:
            dup = slot.duplicable if slot is not None else False
            return SlotDef(name, dup, dispensable or (slot.dispensable if slot is not None else False))

        ins = [flags(forward.input(s), s) for s in self.inputs]
        ins += [flags(forward.output(s), s) for s in self.outputs]
        ins += [flags(forward.output(s), s, dispensable=True) for s, _, _ in self.outputs_if]
        ins += [flags(forward.output(s), grad_name(s)) for s in self.out_grads]
        outs = [flags(forward.input(s), grad_name(s), dispensable=True) for s in self.in_grads]
        return OpDef(
            type=self.type,
            inputs=tuple(sorted(ins, key=lambda s: s.name)),
            outputs=tuple(sorted(outs, key=lambda s: s.name)),
            attrs=forward.attrs if self.copy_attrs else MappingProxyType({}),
            role=OpRole.Backward,
        )


def _float(value: float) -> Attr:
    return Attr.of(float(value), AttrType.FLOAT)


def sum_grad(ctx: GradContext) -> list[Op]:
    """Paddle's `SumGradMaker`: one `scale(X=Out@GRAD, scale=1)` per input with a grad."""
    out_grad = ctx.output_grad("Out")
    return [
        new_op("scale", {"X": out_grad}, {"Out": [g]}, {"scale": _float(1.0)})
        for g in ctx.input_grad("X", drop_empty=False)
        if g != EMPTY_VAR_NAME
    ]


sum_grad.grad_types = ("scale",)  # type: ignore[attr-defined]


def scale_grad(ctx: GradContext) -> list[Op]:
    """Paddle's `ScaleGradMaker`: `scale` by the same factor, no bias."""
    return [
        new_op(
            "scale",
            {"X": ctx.output_grad("Out")},
            {"Out": ctx.input_grad("X")},
            {
                "scale": ctx.forward.attrs.get("scale", _float(1.0)),
                "bias": _float(0.0),
                "bias_after_scale": Attr.of(True, AttrType.BOOLEAN),
            },
        )
    ]


scale_grad.grad_types = ("scale",)  # type: ignore[attr-defined]


def assign_grad(ctx: GradContext) -> list[Op]:
    """Paddle's `AssignGradMaker`: assign the output grad back."""
    return [new_op("assign", {"X": ctx.output_grad("Out")}, {"Out": ctx.input_grad("X")}, {})]


assign_grad.grad_types = ("assign",)  # type: ignore[attr-defined]


def cast_grad(ctx: GradContext) -> list[Op]:
    """Paddle's `CastOpGradMaker`: cast the output grad back to the input's type."""
    forward = ctx.forward.attrs
    return [
        new_op(
            "cast",
            {"X": ctx.output_grad("Out")},
            {"Out": ctx.input_grad("X")},
            {"in_dtype": forward["out_dtype"], "out_dtype": forward["in_dtype"]},
        )
    ]


cast_grad.grad_types = ("cast",)  # type: ignore[attr-defined]
