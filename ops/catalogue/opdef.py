"""The shape of a catalogue entry: `OpDef` and the small records it is built from.

An `OpDef` says what Fluid 1.8.5 registers for an op type: its input and output slots
(duplicable / dispensable / intermediate), its attrs with their wire types and defaults,
the role an op of that type plays by default, how to build its grad op(s) (`grad`), how
its outputs' shapes follow from its inputs (`infer_shape`) and, for the few ops whose
output kind is not a plain LoD tensor, which kind (`infer_var_kind`).

Entries are written as tables in the family modules with the helpers below
(`slots("X Y*?")`, `Int(-1)`, `Longs()`, ...), so a new op is one line of data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from transpiler.errors import IRError
from transpiler.ir.types import AttrType, DType, OpRole, VarKind

if TYPE_CHECKING:
    from ops.catalogue.grad import GradContext
    from transpiler.ir import Op


class OpSpecError(IRError):
    """An op built against its catalogue entry with a missing slot, an unknown slot, a
    missing required attr or a value of the wrong type."""


class ShapeError(OpSpecError):
    """Input shapes an op cannot accept (a `mul` whose inner dims differ, ...)."""


class _Required:
    """Marks an attr the caller must give (Paddle's op maker has no default for it)."""

    _instance: _Required | None = None

    def __new__(cls) -> _Required:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


class AttrSpec(NamedTuple):
    """An attr's wire type and default (`REQUIRED` when it has none)."""

    type: AttrType
    default: Any

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclass(frozen=True)
class SlotDef:
    """One input or output slot of an op."""

    name: str
    duplicable: bool = False
    dispensable: bool = False
    intermediate: bool = False


@dataclass(frozen=True)
class TensorInfo:
    """What shape inference knows of a var: kind, element type, dims (-1 = unknown), LoD level."""

    dtype: DType | None
    shape: tuple[int, ...] = ()
    lod_level: int = 0
    kind: VarKind = VarKind.LOD_TENSOR

    def with_(self, **changes: Any) -> TensorInfo:
        values = {"dtype": self.dtype, "shape": self.shape, "lod_level": self.lod_level, "kind": self.kind}
        values.update(changes)
        values["shape"] = tuple(int(d) for d in values["shape"])
        return TensorInfo(**values)


class ShapeContext:
    """The inputs and attrs a shape rule sees; `x(slot)` fetches one input's info."""

    def __init__(self, op_type: str, inputs: Mapping[str, tuple[TensorInfo | None, ...]], attrs: Mapping[str, Any]):
        self.op_type = op_type
        self.inputs = inputs
        self.attrs = attrs

    def has(self, slot: str) -> bool:
        return bool(self.inputs.get(slot))

    def x(self, slot: str, index: int = 0) -> TensorInfo:
        infos = self.inputs.get(slot, ())
        if index >= len(infos) or infos[index] is None:
            raise ShapeError(f"{self.op_type}: input {slot} has no declared shape")
        return infos[index]  # type: ignore[return-value]

    def all(self, slot: str) -> list[TensorInfo]:
        return [self.x(slot, i) for i in range(len(self.inputs.get(slot, ())))]

    def attr(self, name: str) -> Any:
        return self.attrs[name]


# A shape rule maps each output slot it decides to one info per argument (None = leave the var as is).
ShapeRule = Callable[[ShapeContext], Mapping[str, list["TensorInfo | None"]]]
# A var-kind rule gets the op and a lookup of declared var kinds, and names the outputs whose kind it decides.
VarKindRule = Callable[["Op", Callable[[str], "VarKind | None"]], Mapping[str, VarKind]]
GradMaker = Callable[["GradContext"], list["Op"]]


class _Unsupported:
    """`grad=GRAD_UNSUPPORTED`: Paddle differentiates this op (control flow), the builder cannot."""

    def __repr__(self) -> str:
        return "GRAD_UNSUPPORTED"


GRAD_UNSUPPORTED: Any = _Unsupported()


@dataclass(frozen=True)
class OpDef:
    """One op type as Fluid 1.8.5 registers it."""

    type: str
    inputs: tuple[SlotDef, ...] = ()
    outputs: tuple[SlotDef, ...] = ()
    attrs: Mapping[str, AttrSpec] = field(default_factory=lambda: MappingProxyType({}))
    role: OpRole = OpRole.Forward
    grad: GradMaker | None = None
    infer_shape: ShapeRule | None = None
    infer_var_kind: VarKindRule | None = None
    family: str = ""

    def input(self, name: str) -> SlotDef | None:
        return next((s for s in self.inputs if s.name == name), None)

    def output(self, name: str) -> SlotDef | None:
        return next((s for s in self.outputs if s.name == name), None)

    @property
    def differentiable(self) -> bool:
        """True when Paddle registers a grad maker (even one the builder cannot run)."""
        return self.grad is not None

    @property
    def grad_supported(self) -> bool:
        return self.grad is not None and self.grad is not GRAD_UNSUPPORTED

    @property
    def grad_types(self) -> tuple[str, ...]:
        """The op types its grad maker emits (none when the builder cannot differentiate it)."""
        return tuple(self.grad.grad_types) if self.grad_supported else ()  # type: ignore[union-attr]

    def attr_defaults(self) -> dict[str, Any]:
        return {name: spec.default for name, spec in self.attrs.items() if not spec.required}


# ----------------------------------------------------------------- table helpers


def slots(text: str) -> tuple[SlotDef, ...]:
    """`"X Y*? MaxIndex!"`: `*` duplicable, `?` dispensable, `!` intermediate."""
    out = []
    for word in text.split():
        name = word.rstrip("*?!")
        flags = word[len(name):]
        out.append(SlotDef(name, "*" in flags, "?" in flags, "!" in flags))
    return tuple(out)


def _spec(attr_type: AttrType) -> Callable[..., AttrSpec]:
    def make(default: Any = REQUIRED) -> AttrSpec:
        if isinstance(default, list):
            default = tuple(default)
        return AttrSpec(attr_type, default)

    make.__name__ = attr_type.name
    return make


Int = _spec(AttrType.INT)
Long = _spec(AttrType.LONG)
Float = _spec(AttrType.FLOAT)
Bool = _spec(AttrType.BOOLEAN)
Str = _spec(AttrType.STRING)
Ints = _spec(AttrType.INTS)
Longs = _spec(AttrType.LONGS)
Floats = _spec(AttrType.FLOATS)
Strs = _spec(AttrType.STRINGS)
BlockAttr = _spec(AttrType.BLOCK)
BlocksAttr = _spec(AttrType.BLOCKS)


def op(
    op_type: str,
    ins: str = "",
    outs: str = "",
    attrs: Mapping[str, AttrSpec] | None = None,
    *,
    role: OpRole = OpRole.Forward,
    grad: GradMaker | None = None,
    infer: ShapeRule | None = None,
    var_kind: VarKindRule | None = None,
) -> OpDef:
    """One table row."""
    return OpDef(
        type=op_type,
        inputs=slots(ins),
        outputs=slots(outs),
        attrs=MappingProxyType(dict(attrs or {})),
        role=role,
        grad=grad,
        infer_shape=infer,
        infer_var_kind=var_kind,
    )


# The attrs Paddle's OpProtoAndCheckerMaker adds to every op. `op_namescope` and
# `op_callstack` only say where Python built the op; we never emit them.
COMMON_ATTRS: Mapping[str, AttrSpec] = MappingProxyType(
    {
        "op_role": AttrSpec(AttrType.INT, 0),
        "op_role_var": AttrSpec(AttrType.STRINGS, ()),
        "op_device": AttrSpec(AttrType.STRING, ""),
        "op_namescope": AttrSpec(AttrType.STRING, "/"),
        "op_callstack": AttrSpec(AttrType.STRINGS, ()),
    }
)
EMITTED_COMMON_ATTRS = ("op_role", "op_role_var", "op_device")
