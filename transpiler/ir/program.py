"""The program IR: `Program` → `Block` → `Op` / `Var`.

A `ProgramDesc` is not SSA (`ParamOut` aliases `Param`), so a block's op order is
explicit: ops live in a doubly linked list (each op links to the next; the block keeps the
links back), which makes `insert_after`, `insert_before` and `remove_op` O(1) however
large the block. Reads of order (`block.ops`,
`block.index_of`) are cached and rebuilt in O(n) after an edit, so a pass should
analyse first and then edit, as the passes in `transpiler/passes/` do.

Each block also keeps which ops read and which write each var name, so `readers(name)` /
`writers(name)` cost O(uses), not O(ops). The index is built at the first question, in
one pass, and kept up to date by every edit from then on: most blocks a transpile builds
(every pserver's) are never asked, and indexing them op by op was a tenth of the work.

The IR holds no reference cycle: a program owns its blocks, a block its vars and ops, and
the links back up (`Var.block`, `Op.block`, `Block.program`) are weak. So a program nobody
holds any more is freed at once by reference counting, not by the cyclic GC rescanning it
(and all its ops) until some later full collection finds it; and `gc_pause` can hand a
just-built program straight to the oldest generation. Hold the program while you work on
its blocks: a block of a dropped program has `program` None, an op or var of a freed block
has `block` None (`tests/test_ir_acyclic.py`).

The IR owns its invariants: ops and vars are changed through these classes' methods
(`add_op`, `insert_after`, `remove_op`, `replace_uses`, `rename_var`, `Op.set_input`,
`Op.set_attr`, ...), never by reaching into their fields.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Union

from transpiler.errors import IRError
from transpiler.fileio import write_bytes_atomic
from transpiler.ir.attrs import Attr, AttrType, sound_on_its_own
from transpiler.ir.types import (
    OP_ROLE_ATTR,
    OP_ROLE_VAR_ATTR,
    DType,
    OpRole,
    VarKind,
)

if TYPE_CHECKING:
    from transpiler.ir.graph import BlockGraph


class FrozenProgramError(IRError):
    """An edit of a frozen program: once a pass has analysed a program, later passes
    hold its ops, so it must stay as it was (see `Program.freeze`)."""

_MISSING: Any = object()

SlotArgs = Union[str, "Var", Iterable[Union[str, "Var"]]]


_STR_ONLY = {str}
_NOTHING_EXPLICIT: frozenset[str] = frozenset()


def _arg_names(args: SlotArgs | None) -> tuple[str, ...]:
    """Normalise one slot's arguments (a name, a Var, or an iterable of either) to names."""
    if (args.__class__ is list or args.__class__ is tuple) and set(map(type, args)) <= _STR_ONLY:
        return tuple(args)  # names already: the common case, checked first and at C speed
    if args is None:
        return ()
    if isinstance(args, (str, Var)):
        args = (args,)
    names = []
    for arg in args:
        name = arg.name if isinstance(arg, Var) else arg
        if not isinstance(name, str):
            raise IRError(f"a slot argument must be a var name or a Var, got {arg!r}")
        names.append(name)
    return tuple(names)


def _slots(slots: Mapping[str, SlotArgs] | None) -> dict[str, tuple[str, ...]]:
    if not slots:
        return {}
    return {str(slot): _arg_names(args) for slot, args in slots.items()}


# --------------------------------------------------------------------------- Var


class Var:
    """A variable declaration in a block: kind, element type, shape, flags.

    `dtype` and `shape` are None for kinds that carry no tensor description
    (`FEED_MINIBATCH`, `FETCH_LIST`, `RAW`, ...). `-1` in `shape` is a dimension known
    only at run time (the batch).
    """

    __slots__ = (
        "_name",
        "_block",  # a weak reference to the block (see the module docstring), or None
        "kind",
        "dtype",
        "shape",
        "lod_level",
        "persistable",
        "need_check_feed",
        "is_parameter",
        "stop_gradient",
        "attrs",
        "reader",
        "tuple_types",
        "_explicit",
    )

    def __init__(
        self,
        name: str,
        kind: VarKind = VarKind.LOD_TENSOR,
        dtype: DType | str | None = None,
        shape: Iterable[int] | None = None,
        *,
        lod_level: int = 0,
        persistable: bool = False,
        need_check_feed: bool = False,
        is_parameter: bool = False,
        stop_gradient: bool = False,
        attrs: Mapping[str, Attr] | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise IRError(f"a var needs a non-empty name, got {name!r}")
        self._name = name
        self._block: weakref.ref[Block] | None = None
        self.kind = kind if kind.__class__ is VarKind else VarKind(kind)  # the enum call costs a microsecond
        self.dtype = None if dtype is None else DType.from_any(dtype)
        self.shape = None if shape is None else tuple(int(d) for d in shape)
        if self.dtype is not None and self.shape is None:
            self.shape = ()
        self.lod_level = int(lod_level)
        self.persistable = bool(persistable)
        self.need_check_feed = bool(need_check_feed)
        self.is_parameter = bool(is_parameter)
        self.stop_gradient = bool(stop_gradient)
        # VarDesc.Attr entries (INT / STRING / INTS only in Paddle's schema).
        self.attrs: dict[str, Attr] = dict(attrs or {})
        # READER and TUPLE kinds: ((dtype, shape, lod_level), ...) and (element type number, ...).
        self.reader: tuple[tuple[DType, tuple[int, ...], int], ...] = ()
        self.tuple_types: tuple[int, ...] = ()
        # Optional proto fields that were present on the wire even at their default value:
        # serde writes a field when it differs from its default or is named here, which is
        # what makes load -> save byte-identical.
        self._explicit: frozenset[str] = _NOTHING_EXPLICIT  # shared: immutable, and one less object per item

    @classmethod
    def _loaded(cls, name: str, type_desc: tuple, flags: Mapping[str, bool], attrs: dict[str, Attr]) -> Var:
        """A var as serde's fast reader decoded it: `type_desc` is (kind, dtype, shape,
        lod_level, reader, tuple_types, explicit type fields), shared by every var of that
        type; `flags` the optional bools that were on the wire. Skips `__init__`'s
        conversions: the values are already of their types."""
        kind, dtype, shape, lod_level, reader, tuple_types, explicit = type_desc
        var = cls.__new__(cls)
        var._name = name
        var._block = None
        var.kind = kind
        var.dtype = dtype
        var.shape = shape
        var.lod_level = lod_level
        var.persistable = flags.get("persistable", False)
        var.need_check_feed = flags.get("need_check_feed", False)
        var.is_parameter = flags.get("is_parameter", False)
        var.stop_gradient = flags.get("stop_gradient", False)
        var.attrs = attrs
        var.reader = reader
        var.tuple_types = tuple_types
        var._explicit = explicit.union(flags) if flags else explicit
        return var

    @property
    def name(self) -> str:
        return self._name

    @property
    def block(self) -> Block | None:
        """The block declaring this var (None when detached, or when that block is gone)."""
        ref = self._block
        return None if ref is None else ref()

    def numel(self) -> int:
        """Number of elements; raises `IRError` for unknown (-1) or missing dimensions."""
        if self.shape is None or any(d < 0 for d in self.shape):
            raise IRError(f"var {self.name!r} has no static shape ({self.shape})")
        return math.prod(self.shape)

    def copy(self, name: str | None = None) -> Var:
        """A detached copy, optionally under a new name."""
        # Field by field rather than a loop over __slots__: clones copy every var, so this is hot.
        new = Var.__new__(Var)
        new._name = self._name if name is None else name
        new._block = None
        new.kind = self.kind
        new.dtype = self.dtype
        new.shape = self.shape
        new.lod_level = self.lod_level
        new.persistable = self.persistable
        new.need_check_feed = self.need_check_feed
        new.is_parameter = self.is_parameter
        new.stop_gradient = self.stop_gradient
        new.attrs = dict(self.attrs) if self.attrs else {}  # nearly always empty: skip the copy call
        new.reader = self.reader
        new.tuple_types = self.tuple_types
        new._explicit = self._explicit
        return new

    def __repr__(self) -> str:
        dtype = self.dtype.short if self.dtype is not None else "-"
        return f"Var({self.name!r}, {self.kind.name}, {dtype}, {list(self.shape) if self.shape is not None else None})"


# ---------------------------------------------------------------------------- Op


class Op:
    """One operator: a type, named input/output slots of var names, and typed attrs.

    Slots and attrs keep the order they were given (and the order they had on the
    wire). Read them through `inputs` / `outputs` / `attrs` (read-only views) or the
    accessors; change them through the setters so the block's indices stay right.

    Paddle 2.6 writes some attrs twice (`use_mkldnn`, ... of `reshape2`) and its `OpDesc`
    keeps the last value. `attrs` holds that value (at the name's first place); the entries
    as they were on the wire stay in `_wire_attrs` so that saving writes them again
    (`None` when no name repeats). Setting or removing an attr drops its stale entries.

    Once an op is built, its slot and attr dicts are never changed in place: every edit
    puts a new dict in their place. That is what lets `clone` (and `make_op`'s defaults)
    share them instead of copying three dicts per op.
    """

    # `_block`: a weak reference to the block (see the module docstring); `_next`: the next op
    # of the block (the block keeps the links back, in `Block._prevs`).
    __slots__ = ("type", "_inputs", "_outputs", "_attrs", "_wire_attrs", "is_target", "_explicit", "_block",
                 "_next", "_verified_attrs")

    def __init__(
        self,
        type: str,
        inputs: Mapping[str, SlotArgs] | None = None,
        outputs: Mapping[str, SlotArgs] | None = None,
        attrs: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(type, str) or not type:
            raise IRError(f"an op needs a non-empty type, got {type!r}")
        self.type = type
        self._inputs = _slots(inputs)
        self._outputs = _slots(outputs)
        self._attrs: dict[str, Attr] = {}
        for name, value in (attrs or {}).items():
            self._attrs[name] = value if value.__class__ is Attr else Attr.of(value)
        self._wire_attrs: tuple[tuple[str, Attr], ...] | None = None
        self.is_target = False
        self._explicit: frozenset[str] = _NOTHING_EXPLICIT  # shared: immutable, and one less object per item
        self._block: weakref.ref[Block] | None = None
        self._next: Op | None = None
        # `_attrs` again when every attr in it is known sound on its own (`attrs.sound_on_its_own`):
        # found so by the verifier, or built so (make_op, set_attr, clone). The verifier skips
        # such attrs; an edit that brings in one that is not leaves None here, to be checked.
        self._verified_attrs: dict[str, Attr] | None = None

    @classmethod
    def _built(
        cls, type: str, inputs: dict[str, tuple[str, ...]], outputs: dict[str, tuple[str, ...]], attrs: dict[str, Attr],
        *, sound: bool = False,
    ) -> Op:
        """An op from slots and attrs that are already normalised (the catalogue's
        `make_op` checked and typed them): the dicts are taken as they are, not copied.
        `sound`: every attr is sound on its own (`attrs.sound_on_its_own`)."""
        op = cls.__new__(cls)
        op.type = type
        op._inputs = inputs
        op._outputs = outputs
        op._attrs = attrs
        op._wire_attrs = None
        op.is_target = False
        op._explicit = _NOTHING_EXPLICIT
        op._block = op._next = None
        op._verified_attrs = attrs if sound else None
        return op

    @classmethod
    def _loaded(
        cls,
        type: str,
        inputs: dict[str, tuple[str, ...]],
        outputs: dict[str, tuple[str, ...]],
        wire_attrs: list[tuple[str, Attr]],
        is_target: bool | None,
    ) -> Op:
        """An op as serde's fast reader decoded it (`is_target` None when the wire had no
        such field). A repeated attr name keeps the last value at its first place, as
        Paddle's OpDesc reads it, and the wire entries are kept for saving."""
        op = cls.__new__(cls)
        op.type = type
        op._inputs = inputs
        op._outputs = outputs
        op._attrs = attrs = dict(wire_attrs)
        op._wire_attrs = tuple(wire_attrs) if len(attrs) < len(wire_attrs) else None
        if is_target is None:
            op.is_target = False
            op._explicit = _NOTHING_EXPLICIT
        else:
            op.is_target = is_target
            op._explicit = _IS_TARGET_EXPLICIT
        op._block = op._next = None
        op._verified_attrs = None
        return op

    @property
    def block(self) -> Block | None:
        """The block holding this op (None when detached, or when that block is gone)."""
        ref = self._block
        return None if ref is None else ref()

    # -- slots
    @property
    def inputs(self) -> Mapping[str, tuple[str, ...]]:
        return MappingProxyType(self._inputs)

    @property
    def outputs(self) -> Mapping[str, tuple[str, ...]]:
        return MappingProxyType(self._outputs)

    def input(self, slot: str) -> tuple[str, ...]:
        """The args of input slot `slot` (empty when the op has no such slot)."""
        return self._inputs.get(slot, ())

    def output(self, slot: str) -> tuple[str, ...]:
        return self._outputs.get(slot, ())

    @property
    def input_names(self) -> list[str]:
        """Every input arg, slot by slot, duplicates kept."""
        return [name for args in self._inputs.values() for name in args]

    @property
    def output_names(self) -> list[str]:
        return [name for args in self._outputs.values() for name in args]

    def set_input(self, slot: str, args: SlotArgs) -> None:
        self._edit_slots(inputs={**self._inputs, slot: _arg_names(args)})

    def set_output(self, slot: str, args: SlotArgs) -> None:
        self._edit_slots(outputs={**self._outputs, slot: _arg_names(args)})

    def remove_input(self, slot: str) -> None:
        self._edit_slots(inputs=_without(self._inputs, slot))

    def remove_output(self, slot: str) -> None:
        self._edit_slots(outputs=_without(self._outputs, slot))

    def rename_input(self, old: str, new: str) -> None:
        """Rename every input arg `old` to `new`."""
        self._edit_slots(inputs=_renamed(self._inputs, {old: new}))

    def rename_output(self, old: str, new: str) -> None:
        self._edit_slots(outputs=_renamed(self._outputs, {old: new}))

    def _edit_slots(self, *, inputs: dict[str, tuple[str, ...]] | None = None,
                    outputs: dict[str, tuple[str, ...]] | None = None) -> None:
        """Put new slot dicts in place (see the class docstring: never edited in place)."""
        block = self.block
        self._check_mutable()
        if block is not None:
            block._unindex(self)
        if inputs is not None:
            self._inputs = inputs
        if outputs is not None:
            self._outputs = outputs
        if block is not None:
            block._index(self)
            block._changed(structure=False)

    # -- attrs
    @property
    def attrs(self) -> Mapping[str, Attr]:
        return MappingProxyType(self._attrs)

    def has_attr(self, name: str) -> bool:
        return name in self._attrs

    def attr(self, name: str, default: Any = _MISSING) -> Any:
        """The attr's value; `default` if absent (or `IRError` when no default is given)."""
        attr = self._attrs.get(name)
        if attr is None:
            if default is _MISSING:
                raise IRError(f"op {self.type!r} has no attr {name!r}")
            return default
        return attr.value

    def attr_type(self, name: str) -> AttrType:
        if name not in self._attrs:
            raise IRError(f"op {self.type!r} has no attr {name!r}")
        return self._attrs[name].type

    def set_attr(self, name: str, value: Any, type: AttrType | None = None) -> None:
        """Set an attr. The type is inferred from `value` unless given; an existing attr
        keeps its wire type when no type is given, so `set_attr("axis", 1)` on a LONG
        attr stays LONG."""
        self._check_mutable()
        attr = self._typed_attr(name, value, type)
        self._replace_attrs({**self._attrs, name: attr}, still_sound=sound_on_its_own(name, attr))
        if self._wire_attrs is not None:
            self._drop_stale_entries(name)

    def _replace_attrs(self, attrs: dict[str, Attr], *, still_sound: bool) -> None:
        """Put a new attr dict in place (clones may share the old one). It counts as
        verified when the old one did and every attr that changed is sound on its own."""
        self._verified_attrs = attrs if still_sound and self._verified_attrs is self._attrs else None
        self._attrs = attrs

    def _typed_attr(self, name: str, value: Any, type: AttrType | None = None) -> Attr:
        """`value` as the attr `name` would hold it: typed by `type`, else by the type the
        attr has now (a LONG stays LONG), else by the value."""
        if type is None and name in self._attrs and not isinstance(value, Attr):
            type = self._attrs[name].type
        return Attr.of(value, type)

    def remove_attr(self, name: str) -> None:
        self._check_mutable()
        self._replace_attrs(_without(self._attrs, name), still_sound=True)
        if self._wire_attrs is not None:
            self._drop_stale_entries(name)

    def repeated_attrs(self) -> dict[str, int]:
        """Attr names the wire held more than once, with how many entries each had."""
        if self._wire_attrs is None:
            return {}
        counts: dict[str, int] = {}
        for name, _ in self._wire_attrs:
            counts[name] = counts.get(name, 0) + 1
        return {name: n for name, n in counts.items() if n > 1}

    def _drop_stale_entries(self, name: str) -> None:
        """`name` changed: its wire entries become its one current entry at its first place."""
        wire: list[tuple[str, Attr]] = []
        for entry_name, attr in self._wire_attrs or ():
            if entry_name != name:
                wire.append((entry_name, attr))
            elif name in self._attrs and all(n != name for n, _ in wire):
                wire.append((name, self._attrs[name]))
        if name in self._attrs and all(n != name for n, _ in wire):
            wire.append((name, self._attrs[name]))
        self._wire_attrs = tuple(wire) if len({n for n, _ in wire}) < len(wire) else None

    def attr_values(self) -> dict[str, Any]:
        return {name: attr.value for name, attr in self._attrs.items()}

    def block_attr(self, name: str) -> Block:
        """Resolve a BLOCK attr to its Block (the op must be in a program)."""
        if self.attr_type(name) != AttrType.BLOCK:
            raise IRError(f"attr {name!r} of op {self.type!r} is {self.attr_type(name).name}, not BLOCK")
        return self._program().block(self.attr(name))

    def blocks_attr(self, name: str) -> list[Block]:
        if self.attr_type(name) != AttrType.BLOCKS:
            raise IRError(f"attr {name!r} of op {self.type!r} is {self.attr_type(name).name}, not BLOCKS")
        program = self._program()
        return [program.block(i) for i in self.attr(name)]

    def sub_block_indices(self) -> list[int]:
        """Every block index this op's BLOCK / BLOCKS attrs name, in attr order."""
        found: list[int] = []
        for attr in self._attrs.values():
            if attr.type == AttrType.BLOCK:
                found.append(attr.value)
            elif attr.type == AttrType.BLOCKS:
                found.extend(attr.value)
        return found

    def _check_mutable(self) -> None:
        block = self.block
        if block is not None:
            block._check_mutable()

    def _program(self) -> Program:
        block = self.block
        program = None if block is None else block.program
        if program is None:
            raise IRError(f"op {self.type!r} is not in a program")
        return program

    # -- roles
    @property
    def role(self) -> OpRole:
        """The `op_role` attr as an `OpRole` (Forward when absent)."""
        number = int(self.attr(OP_ROLE_ATTR, 0)) & 0xFFFF_FFFF
        role = _ROLE_OF_NUMBER.get(number)
        if role is None:  # building a flag enum member costs microseconds; a program uses a handful
            role = OpRole(number)
            if len(_ROLE_OF_NUMBER) < 1024:
                _ROLE_OF_NUMBER[number] = role
        return role

    def has_role(self, role: OpRole) -> bool:
        """Whether `op_role` has any bit of `role`: `bool(op.role & role)` as an int test
        (flag arithmetic costs a microsecond, and the analysis asks this of every op;
        so does `int()` of a flag, hence the role's bits looked up)."""
        attr = self._attrs.get(OP_ROLE_ATTR)
        if attr is None:
            return False
        bits = _BITS_OF_ROLE.get(role)
        if bits is None:
            bits = int(role)
            if len(_BITS_OF_ROLE) < 1024:
                _BITS_OF_ROLE[role] = bits
        return bool(int(attr.value) & bits)

    @property
    def role_vars(self) -> tuple[str, ...]:
        return tuple(self.attr(OP_ROLE_VAR_ATTR, ()))

    # -- position
    @property
    def index(self) -> int:
        """Position in its block (O(1) after the first call since the last edit)."""
        block = self.block
        if block is None:
            raise IRError(f"op {self.type!r} is not in a block")
        return block.index_of(self)

    def clone(
        self, *, inputs: Mapping[str, SlotArgs] | None = None, outputs: Mapping[str, SlotArgs] | None = None,
        attrs: Mapping[str, Any] | None = None,
    ) -> Op:
        """A detached copy with the same slots and attrs. The slots named in `inputs` /
        `outputs` and the attrs named in `attrs` are replaced (each attr typed as `set_attr`
        types it): one new op, cheaper than a copy edited setter by setter."""
        new = Op.__new__(Op)
        new.type = self.type
        # Shared unless replaced: edits replace these dicts, never change them in place.
        new._inputs = {**self._inputs, **_slots(inputs)} if inputs else self._inputs
        new._outputs = {**self._outputs, **_slots(outputs)} if outputs else self._outputs
        new._attrs = self._attrs
        new._wire_attrs = self._wire_attrs
        new.is_target = self.is_target
        new._explicit = self._explicit
        new._block = new._next = None
        new._verified_attrs = self._verified_attrs  # the same attr dict: what was sound still is
        if attrs:
            changed = {name: self._typed_attr(name, value) for name, value in attrs.items()}
            new._replace_attrs({**self._attrs, **changed},
                               still_sound=all(map(sound_on_its_own, changed.keys(), changed.values())))
            if new._wire_attrs is not None:
                for name in attrs:
                    new._drop_stale_entries(name)
        return new

    def _derived(
        self, inputs: dict[str, tuple[str, ...]] | None = None, outputs: dict[str, tuple[str, ...]] | None = None,
        attrs: dict[str, Attr] | None = None, *, sound: bool = False,
    ) -> Op:
        """`clone(inputs=, outputs=, attrs=)` for a pass whose values are normalised
        already (slot -> tuple of names; attr name -> `Attr`): merged in as they are, not
        re-typed. `sound`: every attr in `attrs` is sound on its own. The pserver passes
        copy thousands of ops this way; `clone`'s normalising (and a caller merging into
        the read-only views, which `**` walks key by key) was most of their cost."""
        if attrs and self._wire_attrs is not None:  # stale wire entries to drop: the general path
            return self.clone(inputs=inputs, outputs=outputs, attrs=attrs)
        new = Op.__new__(Op)
        new.type = self.type
        new._inputs = {**self._inputs, **inputs} if inputs else self._inputs
        new._outputs = {**self._outputs, **outputs} if outputs else self._outputs
        new._wire_attrs = self._wire_attrs
        new.is_target = self.is_target
        new._explicit = self._explicit
        new._block = new._next = None
        if attrs:
            new._attrs = {**self._attrs, **attrs}
            new._verified_attrs = new._attrs if sound and self._verified_attrs is self._attrs else None
        else:
            new._attrs = self._attrs
            new._verified_attrs = self._verified_attrs
        return new

    def __repr__(self) -> str:
        ins = ", ".join(f"{k}={list(v)}" for k, v in self._inputs.items())
        outs = ", ".join(f"{k}={list(v)}" for k, v in self._outputs.items())
        return f"Op({self.type}: {ins} -> {outs})"


_ROLE_OF_NUMBER: dict[int, OpRole] = {}
_BITS_OF_ROLE: dict[OpRole | int, int] = {}
_IS_TARGET_EXPLICIT = frozenset({"is_target"})


def _index_into(readers: dict[str, dict[Op, None]], writers: dict[str, dict[Op, None]], op: Op) -> None:
    """Add `op` to a block's reader / writer index."""
    # get-then-insert rather than setdefault(name, {}): that builds a dict per arg even
    # when the name has users already, and indexing runs for every op of an indexed block.
    for table, slots in ((readers, op._inputs), (writers, op._outputs)):
        for args in slots.values():
            for name in args:
                users = table.get(name)
                if users is None:
                    table[name] = {op: None}
                else:
                    users[op] = None


_inputs_of, _outputs_of = attrgetter("_inputs"), attrgetter("_outputs")


def _renamed(slots: dict[str, tuple[str, ...]], renames: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """`slots` with every arg `renames` names renamed, all at once (a new dict; the same
    one when no arg is renamed)."""
    old = renames.keys()
    if old.isdisjoint(chain.from_iterable(slots.values())):  # the common case, at C speed
        return slots
    return {slot: args if old.isdisjoint(args) else tuple([renames.get(a, a) for a in args])
            for slot, args in slots.items()}


def _check_detached(item: Op | Var, what: str, name: str) -> None:
    """Refuse to add an op or var that is in a block already. (One whose block is gone
    holds a dead reference: it is detached, and the caller links it anew.)"""
    block = item.block
    if block is not None:
        advice = "; remove it or clone it first" if what == "op" else ""
        raise IRError(f"{what} {name!r} already belongs to block {block.idx}{advice}")


def _without(mapping: dict, key: str) -> dict:
    """`mapping` without `key` (a new dict; the same one when it has no such key)."""
    if key not in mapping:
        return mapping
    return {k: v for k, v in mapping.items() if k != key}


def var_bytes(var: Var) -> int:
    """Bytes of a var's declared shape (0 for no shape or a -1 dimension)."""
    if var.shape is None or var.dtype is None:
        return 0
    if any(int(d) < 0 for d in var.shape):
        return 0
    return math.prod(int(d) for d in var.shape) * DType(var.dtype).itemsize


# ------------------------------------------------------------------------- Block


class Block:
    """An ordered list of ops and a table of var declarations, with a parent block."""

    def __init__(self, program: Program | None, idx: int, parent_idx: int = -1, forward_block_idx: int = -1) -> None:
        # What its ops and vars hold instead of the block itself (see the module docstring);
        # one per block, so linking an op costs no new object.
        self._ref = weakref.ref(self)
        self.program = program
        self.idx = idx
        self.parent_idx = parent_idx
        self.forward_block_idx = forward_block_idx
        self._explicit: frozenset[str] = _NOTHING_EXPLICIT  # shared: immutable, and one less object per item
        self._vars: dict[str, Var] = {}
        self._head: Op | None = None
        self._tail: Op | None = None
        self._prevs: dict[Op, Op | None] = {}  # op -> the op before it: the list's links back
        self._num_ops = 0
        # name -> the ops reading / writing it (dicts as ordered sets); None until asked (`_index_built`).
        self._readers: dict[str, dict[Op, None]] | None = None
        self._writers: dict[str, dict[Op, None]] | None = None
        self._ops_cache: tuple[Op, ...] | None = None
        self._pos_cache: dict[Op, int] | None = None
        self._graph_cache: BlockGraph | None = None
        self.version = 0  # bumped by every op edit: caches of a block's ops (the executor's) check it

    @property
    def program(self) -> Program | None:
        """The program holding this block (None when detached, or when it is gone)."""
        ref = self._program_ref
        return None if ref is None else ref()

    @program.setter
    def program(self, program: Program | None) -> None:
        self._program_ref = None if program is None else weakref.ref(program)

    # -- vars
    @property
    def vars(self) -> Mapping[str, Var]:
        """Var declarations of this block, in declaration order (read-only view)."""
        return MappingProxyType(self._vars)

    def has_var(self, name: str) -> bool:
        return name in self._vars

    def var(self, name: str) -> Var:
        try:
            return self._vars[name]
        except KeyError:
            raise IRError(f"block {self.idx} declares no var {name!r}") from None

    def find_var(self, name: str) -> Var | None:
        """The var declared here or in the nearest ancestor block, else (a control-flow grad
        block) in a block whose scope it runs in (`visible_blocks`), or None."""
        block: Block | None = self
        while block is not None:
            var = block._vars.get(name)
            if var is not None:
                return var
            block = block.parent
        # Not declared up the parent chain: a grad block (or one inside it) also sees
        # what its forward block sees. Asked only on a miss, so a hit costs what it did.
        block = self
        while block is not None and block.forward_block_idx < 0:
            block = block.parent
        if block is None:
            return None
        for block in self.visible_blocks():
            var = block._vars.get(name)
            if var is not None:
                return var
        return None

    def visible_blocks(self) -> list[Block]:
        """The blocks whose vars an op of this block may name, nearest first: itself, then
        what its forward block sees (a `conditional_block_grad` / `while_grad` sub-block
        runs in the scope its forward sub-block ran in: Paddle's executor lets it read the
        forward's vars), then what its parent sees. Without forward blocks: this block and
        its ancestors. Each block once; a forward link that loops back is not followed."""
        seen: dict[int, Block] = {self.idx: self}
        order = [self]
        for block in order:  # breadth first (nearest scope first), forward before parent
            program = block.program
            forward = block.forward_block_idx
            nexts = [block.parent]
            if program is not None and 0 <= forward < len(program._blocks):
                nexts.insert(0, program._blocks[forward])
            for nxt in nexts:
                if nxt is not None and nxt.idx not in seen:
                    seen[nxt.idx] = nxt
                    order.append(nxt)
        return order

    def create_var(self, name: str, kind: VarKind = VarKind.LOD_TENSOR, dtype=None, shape=None, **flags) -> Var:
        """Declare a new var (IRError if the name is taken in this block)."""
        return self.add_var(Var(name, kind, dtype, shape, **flags))

    def add_var(self, var: Var) -> Var:
        self._check_mutable()
        name = var._name  # not the property: passes add thousands of vars
        if var._block is not None:
            _check_detached(var, "var", name)
        if name in self._vars:
            raise IRError(f"block {self.idx} already declares var {name!r}")
        var._block = self._ref
        self._vars[name] = var
        return var

    def add_vars(self, variables: Iterable[Var]) -> None:
        """`add_var` each of `variables`, in one pass (a startup program declares every var
        of its main program)."""
        self._check_mutable()
        table, ref = self._vars, self._ref
        for var in variables:
            if var._block is not None:
                _check_detached(var, "var", var._name)
            if var._name in table:
                raise IRError(f"block {self.idx} already declares var {var.name!r}")
            var._block = ref
            table[var._name] = var

    def _add_loaded(self, variables: list[Var], ops: list[Op]) -> None:
        """Fill a new, empty block with what serde decoded or a clone copied: the vars
        (distinct names, detached) and the ops in order. One pass instead of `add_var` / `add_op` per item,
        which re-check and re-invalidate for each."""
        table, ref, prevs = self._vars, self._ref, self._prevs
        for var in variables:
            var._block = ref
            table[var._name] = var
        prev = self._tail
        for op in ops:
            op._block = ref
            prevs[op] = prev
            if prev is None:
                self._head = op
            else:
                prev._next = op
            prev = op
        self._tail = prev
        self._num_ops += len(ops)
        self._changed(structure=True)
        if self._readers is not None:  # asked before it was filled: keep the index whole
            for op in ops:
                self._index(op)

    def remove_var(self, name: str) -> Var:
        self._check_mutable()
        var = self.var(name)
        del self._vars[name]
        var._block = None
        return var

    def rename_var(self, old: str, new: str) -> Var:
        """Rename a declared var and every read and write of it in this block's ops."""
        self.rename_vars({old: new})
        return self.var(new)

    def rename_vars(self, renames: Mapping[str, str]) -> None:
        """Rename several declared vars at once (one O(vars) pass however many), keeping
        each declaration's position, and every read and write of them in this block (all
        at once too: `{"a": "b", "b": "a"}` swaps them)."""
        self._check_mutable()
        for old, new in renames.items():
            self.var(old)
            if new in self._vars and new not in renames:
                raise IRError(f"block {self.idx} already declares var {new!r}")
        if len(set(renames.values())) != len(renames):
            raise IRError(f"renames of block {self.idx} give two vars the same name")
        self._vars = {renames.get(name, name): var for name, var in self._vars.items()}
        for new in renames.values():
            self._vars[new]._name = new
        if self._readers is None:  # one pass over the ops rather than building the index for this
            users: Iterable[Op] = self.ops
        else:
            users = dict.fromkeys(op for old in renames for table in (self._readers, self._writers)
                                  for op in table.get(old, ()))
        old = renames.keys()
        for op in users:
            ins, outs = op._inputs, op._outputs
            # Most ops use none of the names: asked here at C speed, without a call per op.
            if old.isdisjoint(chain.from_iterable(ins.values())) and old.isdisjoint(chain.from_iterable(outs.values())):
                continue
            op._edit_slots(inputs=_renamed(ins, renames), outputs=_renamed(outs, renames))

    # -- ops: reads
    @property
    def ops(self) -> tuple[Op, ...]:
        """The ops in order (a cached tuple, rebuilt after edits)."""
        if self._ops_cache is None:
            ops = []
            op = self._head
            while op is not None:
                ops.append(op)
                op = op._next
            self._ops_cache = tuple(ops)
        return self._ops_cache

    def __len__(self) -> int:
        return self._num_ops

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def index_of(self, op: Op) -> int:
        if op._block is not self._ref:
            raise IRError(f"op {op.type!r} is not in block {self.idx}")
        if self._pos_cache is None:
            self._pos_cache = {o: i for i, o in enumerate(self.ops)}
        return self._pos_cache[op]

    def readers(self, name: str) -> list[Op]:
        """Ops of this block with `name` among their inputs, in op order."""
        return self._in_order(self._index_built()[0].get(name, ()))

    def writers(self, name: str) -> list[Op]:
        """Ops of this block with `name` among their outputs, in op order."""
        return self._in_order(self._index_built()[1].get(name, ()))

    def names_read(self) -> frozenset[str]:
        """Every var name some op of this block reads (from the index when it is built:
        O(names), not O(ops); else from the ops, without building it, as `names_used`)."""
        if self._readers is not None:
            return frozenset(self._readers)
        names: set[str] = set()
        for op in self.ops:
            names.update(*op._inputs.values())
        return frozenset(names)

    def var_names_used(self) -> list[str]:
        """Every var name some op of this block reads or writes, in first-seen index order."""
        readers, writers = self._index_built()
        return list(dict.fromkeys([*readers, *writers]))

    def names_used(self) -> set[str]:
        """Every var name some op of this block reads or writes: from the index when it is
        built, else straight from the ops, without building it (the verifier asks this of
        every block, most of which nothing else asks)."""
        if self._readers is not None:
            return set(self._readers).union(self._writers)
        ops = self.ops
        if len(ops) > 16:  # chained iterators, at C speed: 15% faster on a large block, slower on a small one
            names = set(chain.from_iterable(chain.from_iterable(map(dict.values, map(_inputs_of, ops)))))
            names.update(chain.from_iterable(chain.from_iterable(map(dict.values, map(_outputs_of, ops)))))
            return names
        names = set()
        for op in ops:
            names.update(*op._inputs.values(), *op._outputs.values())
        return names

    def _in_order(self, ops: Iterable[Op]) -> list[Op]:
        ops = list(ops)
        if len(ops) <= 1:
            return ops
        self.index_of(ops[0])  # builds the position cache once
        assert self._pos_cache is not None
        return sorted(ops, key=self._pos_cache.__getitem__)

    def graph(self) -> BlockGraph:
        """The dependency graph of this block's ops (cached until the next edit)."""
        if self._graph_cache is None:
            from transpiler.ir.graph import BlockGraph

            self._graph_cache = BlockGraph(self)
        return self._graph_cache

    @property
    def parent(self) -> Block | None:
        program = self.program
        blocks = None if program is None else program._blocks
        if blocks is None or not 0 <= self.parent_idx < len(blocks) or self.parent_idx == self.idx:
            return None
        return blocks[self.parent_idx]

    # -- ops: edits
    def add_op(
        self,
        op: str | Op,
        inputs: Mapping[str, SlotArgs] | None = None,
        outputs: Mapping[str, SlotArgs] | None = None,
        attrs: Mapping[str, Any] | None = None,
        *,
        index: int | None = None,
    ) -> Op:
        """Append an op (or insert it at `index`). `op` is an op type or a detached `Op`."""
        new = self._make_op(op, inputs, outputs, attrs)
        if index is None or index >= self._num_ops:
            self._link_after(self._tail, new)
        elif index <= 0:
            self._link_after(None, new)
        else:
            self._link_after(self.ops[index - 1], new)
        return new

    def add_ops(self, ops: Iterable[Op]) -> None:
        """Append detached ops in order: `add_op` for each, with one check and one cache
        invalidation for all of them (the pserver passes fill hundreds of small blocks)."""
        self._check_mutable()
        ops = list(ops)
        for op in ops:
            if not isinstance(op, Op):
                raise IRError(f"add_ops takes Op objects, got {op!r}")
            if op._block is not None:
                _check_detached(op, "op", op.type)
        if len(set(map(id, ops))) != len(ops):
            raise IRError("add_ops got the same op twice")
        self._add_loaded((), ops)

    def insert_after(self, anchor: Op, op: str | Op, inputs=None, outputs=None, attrs=None) -> Op:
        self._check_member(anchor)
        new = self._make_op(op, inputs, outputs, attrs)
        self._link_after(anchor, new)
        return new

    def insert_before(self, anchor: Op, op: str | Op, inputs=None, outputs=None, attrs=None) -> Op:
        self._check_member(anchor)
        new = self._make_op(op, inputs, outputs, attrs)
        self._link_after(self._prevs[anchor], new)
        return new

    def remove_op(self, op: Op) -> Op:
        """Unlink `op` from this block; it comes back detached and can be added elsewhere."""
        self._check_mutable()
        self._check_member(op)
        self._unindex(op)
        prevs = self._prevs
        prev, nxt = prevs.pop(op), op._next
        if prev is None:
            self._head = nxt
        else:
            prev._next = nxt
        if nxt is None:
            self._tail = prev
        else:
            prevs[nxt] = prev
        op._block = op._next = None
        self._num_ops -= 1
        self._changed(structure=True)
        return op

    def remove_ops(self, ops: Iterable[Op]) -> None:
        for op in list(ops):
            self.remove_op(op)

    def clear_ops(self) -> None:
        self.remove_ops(self.ops)

    def reorder(self, order: Iterable[Op]) -> None:
        """Put the ops in `order`, typically `self.graph().topological_order(key=...)`;
        raises `IRError` unless it is a permutation that respects every dependency."""
        from transpiler.ir.graph import reorder_block

        reorder_block(self, order)

    def _relink(self, order: list[Op]) -> None:
        self._check_mutable()
        prevs = self._prevs
        prev: Op | None = None
        for op in order:
            prevs[op] = prev
            if prev is not None:
                prev._next = op
            prev = op
        if prev is not None:
            prev._next = None
        self._head = order[0] if order else None
        self._tail = prev
        self._changed(structure=True)

    def replace_uses(self, old: str, new: str, ops: Iterable[Op] | None = None) -> int:
        """Make ops read `new` where they read `old` (all readers in this block, or just
        `ops`); returns how many ops changed. Writes of `old` are left alone."""
        targets = self.readers(old) if ops is None else [op for op in ops if old in op.input_names]
        for op in targets:
            self._check_member(op)
            op.rename_input(old, new)
        return len(targets)

    def _make_op(self, op, inputs, outputs, attrs) -> Op:
        if isinstance(op, Op):
            if inputs or outputs or attrs:
                raise IRError("pass either an Op or a type with slots and attrs, not both")
            if op._block is not None:
                _check_detached(op, "op", op.type)
            return op
        return Op(op, inputs, outputs, attrs)

    def _check_mutable(self) -> None:
        program = self.program
        if program is not None and program.frozen:
            raise FrozenProgramError(
                f"block {self.idx} belongs to a frozen program (analysed, so later passes hold its ops); "
                "clone it to edit"
            )

    def _check_member(self, op: Op) -> None:
        if op._block is not self._ref:
            block = op.block
            where = "no block" if block is None else f"block {block.idx}"
            raise IRError(f"op {op.type!r} is in {where}, not in block {self.idx}")

    def _link_after(self, prev: Op | None, op: Op) -> None:
        self._check_mutable()
        nxt = self._head if prev is None else prev._next
        op._next = nxt
        self._prevs[op] = prev
        if prev is None:
            self._head = op
        else:
            prev._next = op
        if nxt is None:
            self._tail = op
        else:
            self._prevs[nxt] = op
        op._block = self._ref
        self._num_ops += 1
        self._index(op)
        self._changed(structure=True)

    def _index_built(self) -> tuple[dict[str, dict[Op, None]], dict[str, dict[Op, None]]]:
        """The reader and writer index, built from the ops at the first call: whole before
        it is set (writers first, readers last, as readers says whether it is built), so a
        thread reading the block meanwhile never sees half of it."""
        if self._readers is None:
            readers: dict[str, dict[Op, None]] = {}
            writers: dict[str, dict[Op, None]] = {}
            for op in self.ops:
                _index_into(readers, writers, op)
            self._writers = writers
            self._readers = readers
        return self._readers, self._writers

    def _index(self, op: Op) -> None:
        if self._readers is not None:  # else not built yet: `_index_built` will see the op then
            _index_into(self._readers, self._writers, op)

    def _unindex(self, op: Op) -> None:
        if self._readers is None:
            return
        for table, names in ((self._readers, op.input_names), (self._writers, op.output_names)):
            for name in names:
                users = table.get(name)
                if users is not None:
                    users.pop(op, None)
                    if not users:
                        del table[name]

    def _changed(self, *, structure: bool) -> None:
        self.version += 1
        self._graph_cache = None
        if structure:
            self._ops_cache = None
            self._pos_cache = None

    def __repr__(self) -> str:
        return f"Block(idx={self.idx}, parent={self.parent_idx}, ops={self._num_ops}, vars={len(self._vars)})"


# ----------------------------------------------------------------------- Program


class Program:
    """A whole `ProgramDesc`: blocks (block 0 is the global block), version info."""

    def __init__(self) -> None:
        self._blocks: list[Block] = []
        self._blocks_cache: tuple[Block, ...] | None = None
        self.version: int | None = None
        self.frozen = False
        # Paddle 2.x records the op versions a program was built with; None when absent.
        self.op_version_map: dict[str, int] | None = None

    @classmethod
    def empty(cls) -> Program:
        """A program with just an empty global block."""
        program = cls()
        program.append_block(Block(program, 0, -1))
        return program

    # -- blocks
    @property
    def blocks(self) -> tuple[Block, ...]:
        """The blocks in index order (a cached tuple; O(1) until blocks are added or dropped)."""
        if self._blocks_cache is None:
            self._blocks_cache = tuple(self._blocks)
        return self._blocks_cache

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def block(self, idx: int) -> Block:
        if not isinstance(idx, int) or not 0 <= idx < len(self._blocks):
            raise IRError(f"block index {idx} out of range (the program has {len(self._blocks)} blocks)")
        return self._blocks[idx]

    def global_block(self) -> Block:
        if self._blocks:  # called everywhere: skip `block`'s checks when block 0 exists
            return self._blocks[0]
        return self.block(0)

    def create_block(self, parent_idx: int = 0) -> Block:
        """Append a new empty block whose parent is `parent_idx`."""
        if self._blocks:
            self.block(parent_idx)  # range check
        return self.append_block(Block(self, len(self._blocks), parent_idx))

    def append_block(self, block: Block) -> Block:
        if self.frozen:
            raise FrozenProgramError("cannot add a block to a frozen program; clone it to edit")
        block.program = self
        self._blocks.append(block)
        self._blocks_cache = None
        return block

    def reachable_blocks(self) -> list[int]:
        """Indices of block 0 and every block an op reaches through BLOCK / BLOCKS attrs
        (transitively), in index order."""
        seen = {0}
        stack = [0]
        while stack:
            for op in self._blocks[stack.pop()].ops:
                for target in op.sub_block_indices():
                    if 0 <= target < len(self._blocks) and target not in seen:
                        seen.add(target)
                        stack.append(target)
        return sorted(seen)

    def drop_blocks(self, indices: Iterable[int]) -> None:
        """Remove blocks and renumber the rest, rewriting `idx`, `parent_idx`,
        `forward_block_idx` and every BLOCK / BLOCKS attr. Raises `IRError` if a kept
        op or block still refers to a dropped block."""
        if self.frozen:
            raise FrozenProgramError("cannot drop blocks of a frozen program; clone it to edit")
        drop = set(indices)
        if not drop:
            return  # nothing to renumber: skip the walk over every attr of every op
        if 0 in drop:
            raise IRError("the global block (0) cannot be dropped")
        for idx in drop:
            self.block(idx)
        kept = [b for b in self._blocks if b.idx not in drop]
        new_index = {b.idx: i for i, b in enumerate(kept)}

        def remap(idx: int, what: str) -> int:
            if idx in drop:
                raise IRError(f"cannot drop block {idx}: {what} refers to it")
            return new_index.get(idx, idx)

        for block in kept:
            for op in block.ops:
                for name, attr in list(op.attrs.items()):
                    if attr.type == AttrType.BLOCK:
                        op.set_attr(name, remap(attr.value, f"op {op.type} in block {block.idx}"))
                    elif attr.type == AttrType.BLOCKS:
                        op.set_attr(name, [remap(v, f"op {op.type} in block {block.idx}") for v in attr.value])
            if block.parent_idx >= 0:
                block.parent_idx = remap(block.parent_idx, f"block {block.idx} (its parent)")
            if block.forward_block_idx >= 0:
                block.forward_block_idx = remap(block.forward_block_idx, f"block {block.idx} (forward_block_idx)")
        for block in kept:
            block.idx = new_index[block.idx]
        self._blocks = kept
        self._blocks_cache = None

    def all_ops(self) -> Iterator[tuple[Block, Op]]:
        for block in self._blocks:
            for op in block.ops:
                yield block, op

    def num_ops(self) -> int:
        return sum(len(block) for block in self._blocks)

    # -- bytes and files
    @classmethod
    def from_bytes(cls, data: bytes) -> Program:
        """Decode `ProgramDesc` bytes (raises `ProgramFormatError` on bad bytes)."""
        from transpiler.ir import serde

        return serde.program_from_bytes(data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Program:
        from transpiler.ir import serde

        return serde.program_from_bytes(serde.read_file(path), source=str(path))

    def to_bytes(self) -> bytes:
        from transpiler.ir import serde

        return serde.program_to_bytes(self)

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a reader never sees a half-written file."""
        write_bytes_atomic(path, self.to_bytes())

    def freeze(self) -> Program:
        """Forbid every edit of this program from now on (`FrozenProgramError`): passes
        after the analysis hold its ops, which must not move or change under them.
        Clones of a frozen program are not frozen."""
        self.frozen = True
        return self

    def clone(self) -> Program:
        """A deep copy; editing it never touches this program."""
        return self.clone_with_map()[0]

    def clone_with_map(self) -> tuple[Program, CloneMap]:
        """A deep copy, and the map from this program's ops and vars to their copies, so
        a pass that analysed this program can find what it found in the copy."""
        new = Program()
        copies = CloneMap()
        new.version = self.version
        new.op_version_map = None if self.op_version_map is None else dict(self.op_version_map)
        var_copies, op_copies = copies.vars, copies.ops
        for block in self._blocks:
            copy = Block(new, block.idx, block.parent_idx, block.forward_block_idx)
            copy._explicit = block._explicit
            variables = [var.copy() for var in block._vars.values()]
            ops = [op.clone() for op in block.ops]
            var_copies.update(zip(block._vars.values(), variables))
            op_copies.update(zip(block.ops, ops))
            copy._add_loaded(variables, ops)  # in one pass: a clone's items are detached and distinct
            new.append_block(copy)
        return new, copies

    def __repr__(self) -> str:
        return f"Program(blocks={len(self._blocks)}, ops={self.num_ops()})"


@dataclass
class CloneMap:
    """Original op / var → its copy, from `Program.clone_with_map` (torch.fx's value map)."""

    ops: dict[Op, Op] = field(default_factory=dict)
    vars: dict[Var, Var] = field(default_factory=dict)

    def op(self, original: Op) -> Op:
        """The copy of `original` (IRError if it is not an op of the cloned program)."""
        try:
            return self.ops[original]
        except KeyError:
            raise IRError(f"op {original.type!r} is not an op of the cloned program") from None

    def var(self, original: Var) -> Var:
        try:
            return self.vars[original]
        except KeyError:
            raise IRError(f"var {original.name!r} is not a var of the cloned program") from None

