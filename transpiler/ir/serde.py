"""Protobuf bytes <-> IR. The only module that touches the generated `framework_pb2`.

Load -> save is byte-identical for every program Paddle writes: slot, attr, var and
block order are kept, and optional fields that were present at their default value are
remembered (`_explicit`) and written again; an attr written twice (Paddle 2.6 does it) is
read as Paddle reads it, last value wins, and written again as it came (`Op._wire_attrs`).

Fields outside Paddle 2.6's schema (from a newer Paddle) cannot be represented in the IR;
`program_from_bytes` warns with `UnknownFieldsWarning` when it drops any.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from transpiler.errors import IRError, ProgramFormatError
from transpiler.ir.attrs import Attr, AttrType
from transpiler.ir.gc_pause import gc_paused
from transpiler.ir.program import Block, Op, Program, Var
from transpiler.ir.wire import Reader, Unusual, Writer
from transpiler.ir.types import LOD_FIELDS, TENSOR_FIELD_OF_KIND, DType, VarKind


if TYPE_CHECKING:
    from proto import framework_pb2 as pb


def _pb():
    """protobuf's generated classes, imported on first use: the fast reader and writer
    handle the common pieces themselves, so a plain load -> transpile -> save (the whole of
    `pstranspile transpile`) may never need them, and importing them costs ~15 ms."""
    from proto import framework_pb2

    return framework_pb2


class UnknownFieldsWarning(UserWarning):
    """The bytes carried fields that Paddle 2.6's schema does not know; they were dropped."""


# The protobuf field that holds each attr type's value.
ATTR_FIELD = {
    AttrType.INT: "i",
    AttrType.FLOAT: "f",
    AttrType.STRING: "s",
    AttrType.INTS: "ints",
    AttrType.FLOATS: "floats",
    AttrType.STRINGS: "strings",
    AttrType.BOOLEAN: "b",
    AttrType.BOOLEANS: "bools",
    AttrType.BLOCK: "block_idx",
    AttrType.LONG: "l",
    AttrType.BLOCKS: "blocks_idx",
    AttrType.LONGS: "longs",
    AttrType.FLOAT64S: "float64s",
    AttrType.VAR: "var_name",
    AttrType.VARS: "vars_name",
    AttrType.FLOAT64: "float64",
    AttrType.SCALAR: "scalar",
    AttrType.SCALARS: "scalars",
}
_VAR_OPTIONAL_BOOLS = ("persistable", "need_check_feed", "is_parameter", "stop_gradient")
_VAR_KIND_OF_NUMBER = {int(k): k for k in VarKind}
_DTYPE_OF_NUMBER = {int(d): d for d in DType}
_VAR_ATTR_FIELD = {AttrType.INT: "i", AttrType.STRING: "s", AttrType.INTS: "ints"}


def read_file(path: str | os.PathLike) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ProgramFormatError(f"cannot read {path}: {exc.strerror or exc}") from None


# ---------------------------------------------------------------------- decoding


def program_from_bytes(data: bytes, *, source: str = "<bytes>") -> Program:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProgramFormatError(f"{source}: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    program = fast_program_from_bytes(data)
    return program if program is not None else _program_via_protobuf(data, source)


def fast_program_from_bytes(data: bytes) -> Program | None:
    """The program, by the fast reader (`transpiler.ir.wire`); None when the bytes are not
    of the common shape it handles (they may still be a valid program, or not)."""
    try:
        with gc_paused(promote=True):
            return _FAST.program(data)
    except (Unusual, _InvalidText, ValueError, OverflowError, DecodeError, IRError):
        return None


def _program_via_protobuf(data: bytes, source: str) -> Program:
    """Decode through protobuf's message objects: slower, but any bytes protobuf accepts,
    with the warnings and errors that name what is wrong."""
    message = _pb().ProgramDesc()
    try:
        message.ParseFromString(data)
    except DecodeError as exc:
        raise ProgramFormatError(f"{source}: not a ProgramDesc ({_decode_reason(exc)})") from None
    if not message.IsInitialized():
        missing = ", ".join(message.FindInitializationErrors()[:3])
        raise ProgramFormatError(f"{source}: not a ProgramDesc (missing required fields: {missing})")
    if not message.blocks:
        raise ProgramFormatError(f"{source}: not a ProgramDesc (it has no blocks)")
    _warn_unknown_fields(message, source)
    try:
        return _program(message, source)
    except _InvalidText as exc:
        raise ProgramFormatError(f"{source}: not a valid ProgramDesc (a {exc} is not valid UTF-8)") from None
    except (ValueError, OverflowError) as exc:
        # Enum numbers outside our schema and similar wire values the IR cannot hold.
        raise ProgramFormatError(f"{source}: not a valid ProgramDesc ({exc})") from None


_STR_ONLY = {str}


class _InvalidText(Exception):
    """A proto2 `string` field holding bytes that are not UTF-8 (upb hands them back as `bytes`)."""


def _text(value, what: str) -> str:
    if type(value) is not str:
        raise _InvalidText(what)
    return value


def _texts(values, what: str) -> tuple[str, ...]:
    values = tuple(values)
    if values and set(map(type, values)) != _STR_ONLY:
        raise _InvalidText(what)
    return values


def _decode_reason(exc: DecodeError) -> str:
    text = str(exc)
    return text.split(": ", 1)[1] if ": " in text else text or "undecodable bytes"


def _warn_unknown_fields(message: pb.ProgramDesc, source: str) -> None:
    """Drop (in place) the fields Paddle 2.6's schema does not define, warning when there were any."""
    size = message.ByteSize()
    message.DiscardUnknownFields()
    lost = size - message.ByteSize()
    if lost:
        warnings.warn(
            f"{source}: dropped {lost} bytes of fields that Paddle 2.6's framework.proto does not define",
            UnknownFieldsWarning,
            stacklevel=3,
        )


def _present(message, names) -> frozenset[str]:
    return frozenset(name for name in names if message.HasField(name))


def _program(message: pb.ProgramDesc, source: str) -> Program:
    program = Program()
    if message.HasField("version"):
        program.version = message.version.version
    if message.HasField("op_version_map"):
        program.op_version_map = {}
        for pair in message.op_version_map.pair:
            program.op_version_map[_text(pair.op_name, "op version name")] = pair.op_version.version
    for position, block_msg in enumerate(message.blocks):
        block = Block(program, block_msg.idx, block_msg.parent_idx, block_msg.forward_block_idx)
        block._explicit = _present(block_msg, ("forward_block_idx",))
        for var_msg in block_msg.vars:
            _text(var_msg.name, "var name")
            if var_msg.name in block._vars:
                raise ProgramFormatError(f"{source}: block {position} declares var {var_msg.name!r} twice")
            block.add_var(_var(var_msg))
        for op_index, op_msg in enumerate(block_msg.ops):
            block._link_after(block._tail, _op(op_msg, source, position, op_index))
        program.append_block(block)
    return program


def _var(message) -> Var:
    if not message.name:
        raise IRError(f"a var needs a non-empty name, got {message.name!r}")
    flags = {flag: getattr(message, flag) for flag in _VAR_OPTIONAL_BOOLS if message.HasField(flag)}
    attrs = dict(_var_attr(attr_msg) for attr_msg in message.attrs)
    return Var._loaded(message.name, _var_type(message.type), flags, attrs)


def _var_type(var_type) -> tuple:
    """A `VarType` as `Var._loaded` takes it: (kind, dtype, shape, lod_level, reader,
    tuple_types, the fields that were explicit)."""
    kind = _VAR_KIND_OF_NUMBER.get(var_type.type) or VarKind(var_type.type)
    dtype = shape = None
    lod_level = 0
    reader: tuple = ()
    tuple_types: tuple = ()
    explicit = set()
    field = TENSOR_FIELD_OF_KIND.get(kind)
    if field is None or not var_type.HasField(field):
        # A kind without a tensor desc, or a desc under another kind's field: take whichever is there.
        field = next((f for f in TENSOR_FIELD_OF_KIND.values() if var_type.HasField(f)), None)
    if field is not None:
        sub = getattr(var_type, field)
        tensor = sub.tensor if field in LOD_FIELDS else sub
        dtype = _DTYPE_OF_NUMBER.get(tensor.data_type) or DType(tensor.data_type)
        shape = tuple(tensor.dims)
        if field in LOD_FIELDS:
            lod_level = sub.lod_level
            if sub.HasField("lod_level"):
                explicit.add("lod_level")
        if field != TENSOR_FIELD_OF_KIND.get(kind):
            explicit.add("tensor_field:" + field)
    if var_type.HasField("reader"):
        reader = tuple(
            (DType(t.tensor.data_type), tuple(t.tensor.dims), t.lod_level) for t in var_type.reader.lod_tensor
        )
        explicit.add("reader")
    if var_type.HasField("tuple"):
        tuple_types = tuple(var_type.tuple.element_type)
        explicit.add("tuple")
    return kind, dtype, shape, lod_level, reader, tuple_types, frozenset(explicit)


def _var_attr(attr_msg) -> tuple[str, Attr]:
    attr_type = AttrType(attr_msg.type)
    name = _text(attr_msg.name, "var attr name")
    value = getattr(attr_msg, _VAR_ATTR_FIELD.get(attr_type, "i"))
    if attr_type == AttrType.STRING:
        _text(value, "var attr string")
    return name, Attr.of(list(value) if attr_type == AttrType.INTS else value, attr_type)


def _op(message, source: str, block_idx: int, op_index: int) -> Op:
    op = Op(_text(message.type, "op type"))
    for slots, wire in ((op._inputs, message.inputs), (op._outputs, message.outputs)):
        for var_msg in wire:
            if _text(var_msg.parameter, "slot name") in slots:
                raise ProgramFormatError(
                    f"{source}: block {block_idx} op {op_index} ({message.type}) has slot {var_msg.parameter!r} twice"
                )
            slots[var_msg.parameter] = _texts(var_msg.arguments, "slot argument")
    attrs = op._attrs
    count = 0
    for attr_msg in message.attrs:
        name = attr_msg.name
        if type(name) is not str:
            raise _InvalidText("attr name")
        attrs[name] = _attr(attr_msg)  # a repeated name: Paddle's OpDesc keeps the last value
        count += 1
    if len(attrs) < count:  # saved as it came (load -> save byte-identical)
        attrs.clear()
        wire = []
        for attr_msg in message.attrs:
            attr = _attr(attr_msg)
            wire.append((attr_msg.name, attr))
            attrs[attr_msg.name] = attr
        op._wire_attrs = tuple(wire)
    if message.HasField("is_target"):
        op.is_target = message.is_target
        op._explicit = _IS_TARGET
    return op


_IS_TARGET = frozenset({"is_target"})

# Decoding is table-driven (one dict lookup per attr picks the field and the conversion):
# loading is most of what `pstranspile transpile` spends on a real model. Attrs are
# immutable, so the common (type, value) pairs of bool/int/str attrs are shared.
_ATTR_TYPE_OF_NUMBER = {int(t): t for t in AttrType}
_KEPT = 0  # the field's value is the attr's value (numbers, bools, block indices)
_TEXT = 1  # a str (checked: invalid UTF-8 comes back as bytes)
_NUMBERS = 2  # a repeated number field, as a tuple
_TEXTS = 3  # a repeated str field, as a tuple (checked)
_SCALAR = 4
_SCALARS = 5
_DECODE_KIND = {
    AttrType.INT: _KEPT, AttrType.FLOAT: _KEPT, AttrType.BOOLEAN: _KEPT, AttrType.BLOCK: _KEPT, AttrType.LONG: _KEPT,
    AttrType.FLOAT64: _KEPT, AttrType.STRING: _TEXT, AttrType.VAR: _TEXT,
    AttrType.INTS: _NUMBERS, AttrType.FLOATS: _NUMBERS, AttrType.BOOLEANS: _NUMBERS, AttrType.BLOCKS: _NUMBERS,
    AttrType.LONGS: _NUMBERS, AttrType.FLOAT64S: _NUMBERS, AttrType.STRINGS: _TEXTS, AttrType.VARS: _TEXTS,
    AttrType.SCALAR: _SCALAR, AttrType.SCALARS: _SCALARS,
}
# wire number -> (AttrType, field, decode kind, whether values are shared)
_DECODE = {
    int(t): (t, ATTR_FIELD[t], _DECODE_KIND[t], t in (AttrType.INT, AttrType.BOOLEAN, AttrType.LONG, AttrType.STRING))
    for t in AttrType
}
_SHARED: dict[tuple[int, object], Attr] = {}
_SHARED_MAX = 4096  # distinct shared values kept (names in STRING attrs would otherwise grow it without bound)


def _attr(message) -> Attr:
    number = message.type
    decode = _DECODE.get(number)
    if decode is None:
        AttrType(number)  # raises the ValueError that names the bad number
    attr_type, field, kind, shared = decode
    raw = getattr(message, field)
    if kind == _KEPT or kind == _TEXT:
        if kind == _TEXT and type(raw) is not str:
            raise _InvalidText(f"{attr_type.name} attr")
        if shared:
            key = (number, raw)
            attr = _SHARED.get(key)
            if attr is None:
                attr = Attr(attr_type, raw)
                if len(_SHARED) < _SHARED_MAX:
                    _SHARED[key] = attr
            return attr
        return Attr(attr_type, raw)
    if kind == _NUMBERS:
        return Attr(attr_type, tuple(raw))
    if kind == _TEXTS:
        values = tuple(raw)
        if values and set(map(type, values)) != _STR_ONLY:
            raise _InvalidText(f"{attr_type.name} attr")
        return Attr(attr_type, values)
    if kind == _SCALAR:
        return Attr(attr_type, _scalar_value(raw))
    return Attr(attr_type, tuple(_scalar_value(s) for s in raw))


def _scalar_value(message):
    kind = message.type
    if kind == _pb().Scalar.BOOLEAN:
        return bool(message.b)
    if kind == _pb().Scalar.LONG:
        return int(message.i)
    if kind == _pb().Scalar.FLOAT64:
        return float(message.r)
    return complex(message.c.r, message.c.i)


# The fast reader's decoders: each takes the bytes of one sub-message that repeats across
# programs (an op attr, a var's type, a var attr) and decodes it through protobuf, so its
# meaning is protobuf's. Anything out of the common shape raises `Unusual`, and the whole
# program is decoded the slow way above.


def _checked(message_class, chunk: bytes):
    message = message_class.FromString(chunk)
    if not message.IsInitialized():
        raise Unusual
    size = message.ByteSize()
    message.DiscardUnknownFields()
    if message.ByteSize() != size:
        raise Unusual
    return message


def _decode_op_attr(chunk: bytes) -> tuple[str, Attr]:
    message = _checked(_pb().OpDesc.Attr, chunk)
    return _text(message.name, "attr name"), _attr(message)


def _decode_var_type(chunk: bytes) -> tuple:
    return _var_type(_checked(_pb().VarType, chunk))


def _decode_var_attr(chunk: bytes) -> tuple[str, Attr]:
    return _var_attr(_checked(_pb().VarDesc.Attr, chunk))


_FAST = Reader(_decode_op_attr, _decode_var_type, _decode_var_attr)


# ---------------------------------------------------------------------- encoding


def program_to_bytes(program: Program) -> bytes:
    try:
        with gc_paused():  # the writer's short-lived lists would trigger collections that free nothing
            return _WRITER.program(program)
    except Exception:  # noqa: BLE001 - whatever the fast writer trips on, protobuf's path is the reference
        return program_to_message(program).SerializeToString()


def program_to_message(program: Program) -> pb.ProgramDesc:
    message = _pb().ProgramDesc()
    for block in program.blocks:
        block_msg = message.blocks.add()
        block_msg.idx = block.idx
        block_msg.parent_idx = block.parent_idx
        if block.forward_block_idx != -1 or "forward_block_idx" in block._explicit:
            block_msg.forward_block_idx = block.forward_block_idx
        for var in block.vars.values():
            _write_var(block_msg.vars.add(), var)
        for op in block.ops:
            _write_op(block_msg.ops.add(), op)
    if program.version is not None:
        message.version.version = program.version
    if program.op_version_map is not None:
        message.op_version_map.SetInParent()
        for name, version in program.op_version_map.items():
            pair = message.op_version_map.pair.add()
            pair.op_name = name
            pair.op_version.version = version
    return message


def _write_var(message, var: Var) -> None:
    message.name = var.name
    _write_var_type(message.type, var)
    for flag in _VAR_OPTIONAL_BOOLS:
        value = getattr(var, flag)
        if value or flag in var._explicit:
            setattr(message, flag, value)
    for name, attr in var.attrs.items():
        _write_var_attr(message.attrs.add(), name, attr, var.name)


def _write_var_type(var_type, var: Var) -> None:
    var_type.type = int(var.kind)
    if var.dtype is not None:
        field = next((f.split(":", 1)[1] for f in var._explicit if f.startswith("tensor_field:")), None)
        field = field or TENSOR_FIELD_OF_KIND.get(var.kind, "lod_tensor")
        sub = getattr(var_type, field)
        tensor = sub.tensor if field in LOD_FIELDS else sub
        tensor.data_type = int(var.dtype)
        tensor.dims.extend(var.shape or ())
        if field in LOD_FIELDS and (var.lod_level != 0 or "lod_level" in var._explicit):
            sub.lod_level = var.lod_level
    if var.reader or "reader" in var._explicit:
        var_type.reader.SetInParent()
        for dtype, dims, lod_level in var.reader:
            entry = var_type.reader.lod_tensor.add()
            entry.tensor.data_type = int(dtype)
            entry.tensor.dims.extend(dims)
            entry.lod_level = lod_level
    if var.tuple_types or "tuple" in var._explicit:
        var_type.tuple.SetInParent()
        var_type.tuple.element_type.extend(var.tuple_types)


def _write_var_attr(entry, name: str, attr: Attr, var_name: str) -> None:
    entry.name = name
    entry.type = int(attr.type)
    field = _VAR_ATTR_FIELD.get(attr.type)
    if field is None:
        raise ProgramFormatError(f"var {var_name!r}: a VarDesc attr cannot be {attr.type.name}")
    if attr.type == AttrType.INTS:
        entry.ints.extend(attr.value)
    else:
        setattr(entry, field, attr.value)


def _write_op(message, op: Op) -> None:
    # Sub-messages are built with keyword arguments (filled in C): saving, like loading,
    # is a good part of what `pstranspile transpile` spends on a real model.
    message.type = op.type
    for wire, slots in ((message.inputs, op._inputs), (message.outputs, op._outputs)):
        add = wire.add
        for slot, args in slots.items():
            add(parameter=slot, arguments=args)
    add = message.attrs.add
    for name, attr in op._attrs.items() if op._wire_attrs is None else op._wire_attrs:
        _write_op_attr(add, name, attr)
    if op.is_target or "is_target" in op._explicit:
        message.is_target = op.is_target


def _write_op_attr(add, name: str, attr: Attr) -> None:
    """Append one `OpDesc.Attr` through `add` (a repeated field's `add`)."""
    attr_type = attr.type
    field = _PLAIN_FIELD.get(attr_type)
    if field is not None:
        add(name=name, type=_WIRE_NUMBER[attr_type], **{field: attr.value})
    else:
        _write_attr_value(add(name=name, type=_WIRE_NUMBER[attr_type]), attr)


# The attr types whose value is the field's value as is (all but SCALAR / SCALARS).
_PLAIN_FIELD = {t: f for t, f in ATTR_FIELD.items() if t not in (AttrType.SCALAR, AttrType.SCALARS)}
_WIRE_NUMBER = {t: int(t) for t in AttrType}


def _write_attr_value(entry, attr: Attr) -> None:
    field = ATTR_FIELD[attr.type]
    if attr.type == AttrType.SCALAR:
        _write_scalar(entry.scalar, attr.value)
    elif attr.type == AttrType.SCALARS:
        for value in attr.value:
            _write_scalar(entry.scalars.add(), value)
    elif isinstance(attr.value, tuple):
        getattr(entry, field).extend(attr.value)
    else:
        setattr(entry, field, attr.value)


def _write_scalar(message, value) -> None:
    if isinstance(value, bool):
        message.type = _pb().Scalar.BOOLEAN
        message.b = value
    elif isinstance(value, int):
        message.type = _pb().Scalar.LONG
        message.i = value
    elif isinstance(value, float):
        message.type = _pb().Scalar.FLOAT64
        message.r = value
    else:
        message.type = _pb().Scalar.COMPLEX128
        message.c.r = value.real
        message.c.i = value.imag


# The fast writer's encoders (see `transpiler.ir.wire.Writer`): each writes one repeating
# piece through protobuf, so the bytes are protobuf's; the writer reuses them.


def _encode_op_attr(name: str, attr: Attr) -> bytes:
    holder = _pb().OpDesc()
    _write_op_attr(holder.attrs.add, name, attr)
    return holder.attrs[0].SerializeToString()


def _encode_var_type(var: Var) -> bytes:
    var_type = _pb().VarType()
    _write_var_type(var_type, var)
    return var_type.SerializeToString()


def _encode_var_attr(name: str, attr: Attr) -> bytes:
    entry = _pb().VarDesc.Attr()
    _write_var_attr(entry, name, attr, "?")
    return entry.SerializeToString()


_WRITER = Writer(_encode_op_attr, _encode_var_type, _encode_var_attr)
