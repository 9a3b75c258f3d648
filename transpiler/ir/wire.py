"""The fast reader and writer of `ProgramDesc` bytes: the common case of
`serde.program_from_bytes` and `serde.program_to_bytes`.

Going through protobuf's Python objects costs about a microsecond per field touched
(every sub-message and repeated field is a wrapper object), which made loading a real
model cost some 40 µs per op, and saving about half that. This module walks the wire
format itself, for the shape Paddle writes: every field known to Paddle 2.6's schema,
every required field there, no field that should appear once appearing twice, UTF-8 text,
enum numbers the schema knows. The pieces that repeat across a program (op attrs, a var's
type) are decoded or encoded once per distinct piece and shared. Plain pieces (varint,
string and float attrs and their lists; a LoD tensor's type) are handled here, the rest
(SCALAR attrs, other var kinds ...) through protobuf by the callbacks `serde` passes in,
so their meaning is protobuf's.

Reading anything else (unknown fields, a missing required field, truncated bytes ...)
raises `Unusual`, and `serde` decodes the whole program the slow way, which knows how to
warn or refuse. So this module never has to reproduce protobuf's corner cases: it only has
to agree with it on the bytes it accepts (tests/test_ir_wire.py compares the readers on
every fixture and on mutated bytes, and the writers on fixtures, transpiled programs and
every attr type's edge values).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from transpiler.ir.attrs import Attr
from transpiler.ir.program import Block, Op, Program, Var
from transpiler.ir.types import AttrType, DType, VarKind


class Unusual(Exception):
    """The bytes are not of the common shape this reader handles: use protobuf's reader."""


# A var's type, decoded by serde from a `VarType` message: (kind, dtype, shape,
# lod_level, reader, tuple_types, explicit fields).
VarTypeDesc = tuple
AttrDecoder = Callable[[bytes], tuple[str, Attr]]
VarTypeDecoder = Callable[[bytes], VarTypeDesc]
VarAttrDecoder = Callable[[bytes], tuple[str, Attr]]

_CACHE_MAX = 8192  # distinct byte strings kept per cache (op_role_var values are nearly unique)
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_VAR_FLAG_OF_TAG = {0x18: "persistable", 0x20: "need_check_feed", 0x28: "is_parameter", 0x30: "stop_gradient"}


class Reader:
    """One reader per set of decoders; its caches of decoded attrs and var types live
    as long as it does (serde keeps one for the process)."""

    def __init__(self, decode_attr: AttrDecoder, decode_var_type: VarTypeDecoder, decode_var_attr: VarAttrDecoder):
        self._decode_attr = decode_attr
        self._decode_var_type = decode_var_type
        self._decode_var_attr = decode_var_attr
        self._attrs: dict[bytes, tuple[str, Attr]] = {}
        self._var_types: dict[bytes, VarTypeDesc] = {}

    # ------------------------------------------------------------------ program

    def program(self, data: bytes) -> Program:
        program = Program()
        pos, end = 0, len(data)
        version = op_versions = None
        while pos < end:
            tag = data[pos]
            start, stop = _chunk(data, pos + 1, end)
            pos = stop
            if tag == 0x0A:  # blocks
                program.append_block(self._block(program, data, start, stop))
            elif tag == 0x22 and version is None:  # version
                version = _version(data, start, stop)
            elif tag == 0x2A and op_versions is None:  # op_version_map
                op_versions = _op_version_map(data, start, stop)
            else:
                raise Unusual
        if not program._blocks:
            raise Unusual  # serde names the problem
        program.version = version
        program.op_version_map = op_versions
        return program

    # -------------------------------------------------------------------- block

    def _block(self, program: Program, data: bytes, pos: int, end: int) -> Block:
        idx = parent_idx = None
        forward_block_idx = -1
        explicit = False
        var_chunks: list[tuple[int, int]] = []
        op_chunks: list[tuple[int, int]] = []
        while pos < end:
            tag = data[pos]
            if tag == 0x1A or tag == 0x22:
                start, pos = _chunk(data, pos + 1, end)
                (var_chunks if tag == 0x1A else op_chunks).append((start, pos))
            elif tag == 0x08 and idx is None:
                idx, pos = _int32(data, pos + 1, end)
            elif tag == 0x10 and parent_idx is None:
                parent_idx, pos = _int32(data, pos + 1, end)
            elif tag == 0x28 and not explicit:
                forward_block_idx, pos = _int32(data, pos + 1, end)
                explicit = True
            else:
                raise Unusual
        if idx is None or parent_idx is None:
            raise Unusual
        block = Block(program, idx, parent_idx, forward_block_idx)
        if explicit:
            block._explicit = frozenset({"forward_block_idx"})
        variables = [self._var(data, start, stop) for start, stop in var_chunks]
        if len({var.name for var in variables}) < len(variables):
            raise Unusual  # serde names the var declared twice
        block._add_loaded(variables, [self._op(data, start, stop) for start, stop in op_chunks])
        return block

    # ---------------------------------------------------------------------- var

    def _var(self, data: bytes, pos: int, end: int) -> Var:
        name = type_desc = None
        flags: dict[str, bool] = {}
        attrs: dict[str, Attr] = {}
        while pos < end:
            tag = data[pos]
            if tag == 0x0A and name is None:
                start, pos = _chunk(data, pos + 1, end)
                name = _text(data, start, pos)
            elif tag == 0x12 and type_desc is None:
                start, pos = _chunk(data, pos + 1, end)
                type_desc = self._var_type(data[start:pos])
            elif tag in _VAR_FLAG_OF_TAG:
                flag = _VAR_FLAG_OF_TAG[tag]
                if flag in flags:
                    raise Unusual
                value, pos = _varint(data, pos + 1, end)
                flags[flag] = value != 0
            elif tag == 0x3A:
                start, pos = _chunk(data, pos + 1, end)
                attr_name, attr = self._decode_var_attr(data[start:pos])
                if attr_name in attrs:
                    raise Unusual
                attrs[attr_name] = attr
            else:
                raise Unusual
        if not name or type_desc is None:
            raise Unusual
        return Var._loaded(name, type_desc, flags, attrs)

    def _var_type(self, chunk: bytes) -> VarTypeDesc:
        desc = self._var_types.get(chunk)
        if desc is None:
            desc = decode_plain_var_type(chunk) or self._decode_var_type(chunk)
            if len(self._var_types) < _CACHE_MAX:
                self._var_types[chunk] = desc
        return desc

    # ----------------------------------------------------------------------- op

    def _op(self, data: bytes, pos: int, end: int) -> Op:
        op_type = None
        inputs: dict[str, tuple[str, ...]] = {}
        outputs: dict[str, tuple[str, ...]] = {}
        wire: list[tuple[str, Attr]] = []
        is_target = None
        cache, decode = self._attrs, self._decode_attr
        while pos < end:
            tag = data[pos]
            if tag == 0x28:  # is_target, the one varint field
                if is_target is not None:
                    raise Unusual
                value, pos = _varint(data, pos + 1, end)
                is_target = value != 0
                continue
            length = data[pos + 1] if pos + 1 < end else 0x80
            if length < 0x80:  # nearly every field of an op is this short: no call
                start = pos + 2
                pos = start + length
                if pos > end:
                    raise Unusual
            else:
                start, pos = _chunk(data, pos + 1, end)
            if tag == 0x22:  # attrs, the most frequent field
                chunk = data[start:pos]
                entry = cache.get(chunk)
                if entry is None:
                    entry = decode_plain_attr(chunk) or decode(chunk)
                    if len(cache) < _CACHE_MAX:
                        cache[chunk] = entry
                wire.append(entry)
            elif tag == 0x0A or tag == 0x12:
                slots = inputs if tag == 0x0A else outputs
                slot, args = _slot(data, start, pos)
                if slot in slots:
                    raise Unusual  # serde names the repeated slot
                slots[slot] = args
            elif tag == 0x1A and op_type is None:
                op_type = _text(data, start, pos)
            else:
                raise Unusual
        if not op_type:
            raise Unusual
        return Op._loaded(op_type, inputs, outputs, wire, is_target)


# ------------------------------------------------------------------ wire pieces


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """An unsigned varint (at most 64 bits) starting at `pos`, and the position after it."""
    result = shift = 0
    while pos < end:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            if result >= 1 << 64:
                raise Unusual
            return result, pos
        shift += 7
        if shift > 63:
            raise Unusual
    raise Unusual  # truncated


def _int32(data: bytes, pos: int, end: int) -> tuple[int, int]:
    value, pos = _varint(data, pos, end)
    if value >= 1 << 63:
        value -= 1 << 64  # negative numbers are sign-extended to 64 bits on the wire
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise Unusual  # protobuf truncates; leave that to it
    return value, pos


def _int64(data: bytes, pos: int, end: int) -> tuple[int, int]:
    value, pos = _varint(data, pos, end)
    return (value - (1 << 64) if value >= 1 << 63 else value), pos


def _chunk(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """The bounds of a length-delimited field whose length varint starts at `pos`."""
    length = data[pos] if pos < end else 0x80
    if length < 0x80:
        pos += 1
    else:
        length, pos = _varint(data, pos, end)
    stop = pos + length
    if stop > end:
        raise Unusual  # truncated
    return pos, stop


def _text(data: bytes, start: int, stop: int) -> str:
    try:
        return data[start:stop].decode()
    except UnicodeDecodeError:
        raise Unusual from None  # serde says which field is not UTF-8


def _slot(data: bytes, pos: int, end: int) -> tuple[str, tuple[str, ...]]:
    """An `OpDesc.Var`: the slot name and its arguments. (Invalid UTF-8 raises
    `UnicodeDecodeError`, which serde treats as `Unusual`.)"""
    parameter = None
    args = []
    while pos < end:
        tag = data[pos]
        length = data[pos + 1] if pos + 1 < end else 0x80
        if length < 0x80:
            start = pos + 2
            pos = start + length
            if pos > end:
                raise Unusual
        else:
            start, pos = _chunk(data, pos + 1, end)
        if tag == 0x12:
            args.append(data[start:pos].decode())
        elif tag == 0x0A and parameter is None:
            parameter = data[start:pos].decode()
        else:
            raise Unusual
    if parameter is None:
        raise Unusual
    return parameter, tuple(args)


def _version(data: bytes, pos: int, end: int) -> int:
    value = 0
    seen = False
    while pos < end:
        if data[pos] != 0x08 or seen:
            raise Unusual
        value, pos = _int64(data, pos + 1, end)
        seen = True
    return value


def _op_version_map(data: bytes, pos: int, end: int) -> dict[str, int]:
    versions: dict[str, int] = {}
    while pos < end:
        if data[pos] != 0x0A:
            raise Unusual
        start, pos = _chunk(data, pos + 1, end)
        name, version = _op_version_pair(data, start, pos)
        versions[name] = version  # a repeated name: the last pair wins, as serde's dict does
    return versions


def _op_version_pair(data: bytes, pos: int, end: int) -> tuple[str, int]:
    name: Any = None
    version = None
    while pos < end:
        tag = data[pos]
        start, pos = _chunk(data, pos + 1, end)
        if tag == 0x0A and name is None:
            name = _text(data, start, pos)
        elif tag == 0x12 and version is None:
            # OpVersion { required int32 version = 1; }
            if start == pos or data[start] != 0x08:
                raise Unusual
            version, after = _int32(data, start + 1, pos)
            if after != pos:
                raise Unusual
        else:
            raise Unusual
    if name is None or version is None:
        raise Unusual
    return name, version


# ====================================================================== writing

AttrEncoder = Callable[[str, Attr], bytes]
VarTypeEncoder = Callable[[Var], bytes]


class Writer:
    """`ProgramDesc` bytes written directly, in protobuf's field order, for what the IR
    holds. The pieces that repeat (an op attr: loaded or catalogue attrs are shared
    objects; a var's type) are encoded by protobuf through serde's callbacks, once per
    distinct piece, so their bytes are protobuf's."""

    def __init__(self, encode_attr: AttrEncoder, encode_var_type: VarTypeEncoder, encode_var_attr: AttrEncoder):
        self._encode_attr = encode_attr
        self._encode_var_type = encode_var_type
        self._encode_var_attr = encode_var_attr
        # (name, id(attr)) -> (attr, field bytes); the attr is held so its id is not reused.
        self._attrs: dict[tuple[str, int], tuple[Attr, bytes]] = {}
        self._var_types: dict[tuple, bytes] = {}
        # Text fields by their text: var names recur in many ops (and programs), slot names
        # and op types everywhere. tag -> {text: the whole field's bytes}.
        self._texts: dict[int, dict[str, bytes]] = {0x0A: {}, 0x12: {}, 0x1A: {}}

    def program(self, program: Program) -> bytes:
        parts = [_field(0x0A, self._block(block)) for block in program.blocks]
        if program.version is not None:
            parts.append(_field(0x22, b"\x08" + _varint_bytes(program.version)))
        if program.op_version_map is not None:
            parts.append(_field(0x2A, b"".join(
                _field(0x0A, _field(0x0A, name.encode()) + _field(0x12, b"\x08" + _varint_bytes(version)))
                for name, version in program.op_version_map.items()
            )))
        return b"".join(parts)

    def _block(self, block: Block) -> bytes:
        parts = [b"\x08", _varint_bytes(block.idx), b"\x10", _varint_bytes(block.parent_idx)]
        parts.extend(_field(0x1A, self._var(var)) for var in block._vars.values())
        parts.extend(_field(0x22, self._op(op)) for op in block.ops)
        if block.forward_block_idx != -1 or "forward_block_idx" in block._explicit:
            parts += (b"\x28", _varint_bytes(block.forward_block_idx))
        return b"".join(parts)

    def _var(self, var: Var) -> bytes:
        parts = [_field(0x0A, var._name.encode()), _field(0x12, self._var_type(var))]
        explicit = var._explicit
        if var.persistable or explicit:  # the common var has no flag set and none explicit
            for tag, flag in _VAR_FLAG_TAGS:
                value = getattr(var, flag)
                if value or flag in explicit:
                    parts.append(tag + (b"\x01" if value else b"\x00"))
        elif var.need_check_feed or var.is_parameter or var.stop_gradient:
            for tag, flag in _VAR_FLAG_TAGS:
                if getattr(var, flag):
                    parts.append(tag + b"\x01")
        for name, attr in var.attrs.items():
            parts.append(_field(0x3A, self._encode_var_attr(name, attr)))
        return b"".join(parts)

    def _var_type(self, var: Var) -> bytes:
        key = (var.kind, var.dtype, var.shape, var.lod_level, var.reader, var.tuple_types, var._explicit)
        encoded = self._var_types.get(key)
        if encoded is None:
            encoded = encode_plain_var_type(var) or self._encode_var_type(var)
            if len(self._var_types) < _CACHE_MAX:
                self._var_types[key] = encoded
        return encoded

    def _op(self, op: Op) -> bytes:
        parts = []
        slot_fields, arg_fields = self._texts[0x0A], self._texts[0x12]
        for tag, slots in ((b"\x0a", op._inputs), (b"\x12", op._outputs)):
            for slot, args in slots.items():
                pieces = [slot_fields.get(slot) or self._text_field(0x0A, slot)]
                for arg in args:
                    pieces.append(arg_fields.get(arg) or self._text_field(0x12, arg))
                body = b"".join(pieces)
                parts += (tag, _length(body), body)
        parts.append(self._texts[0x1A].get(op.type) or self._text_field(0x1A, op.type))
        cache, encode = self._attrs, self._encode_attr
        for name, attr in op._attrs.items() if op._wire_attrs is None else op._wire_attrs:
            entry = cache.get((name, id(attr)))
            if entry is None or entry[0] is not attr:
                body = encode_plain_attr(name, attr) or encode_plain_float_attr(name, attr) or encode(name, attr)
                entry = (attr, _field(0x22, body))
                if len(cache) < _CACHE_MAX:
                    cache[(name, id(attr))] = entry
            parts.append(entry[1])
        if op.is_target or "is_target" in op._explicit:
            parts.append(b"\x28\x01" if op.is_target else b"\x28\x00")
        return b"".join(parts)

    def _text_field(self, tag: int, text: str) -> bytes:
        encoded = _field(tag, text.encode())
        known = self._texts[tag]
        if len(known) < _TEXT_CACHE_MAX:
            known[text] = encoded
        return encoded


_TEXT_CACHE_MAX = 1 << 16  # distinct names kept per field kind
_VAR_FLAG_TAGS = ((b"\x18", "persistable"), (b"\x20", "need_check_feed"), (b"\x28", "is_parameter"),
                  (b"\x30", "stop_gradient"))


_SMALL = [bytes([n]) for n in range(128)]


def _varint_bytes(value: int) -> bytes:
    """A varint as protobuf writes int32 / int64 / bool: negatives as 64-bit two's complement."""
    if 0 <= value < 128:
        return _SMALL[value]
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length(body: bytes) -> bytes:
    size = len(body)
    return _SMALL[size] if size < 128 else _varint_bytes(size)


def _field(tag: int, body: bytes) -> bytes:
    """A length-delimited field (tag < 128, one byte)."""
    size = len(body)
    return _SMALL[tag] + (_SMALL[size] if size < 128 else _varint_bytes(size)) + body


# `OpDesc.Attr` field tags of the attr types whose value encodes without protobuf's help:
# varints and strings, single or repeated (unpacked, as proto2 writes them). Floats are
# left to protobuf (its float32 rounding and NaN bits are the reference).
_VARINT_TAG = {AttrType.INT: 0x18, AttrType.BOOLEAN: 0x50, AttrType.BLOCK: 0x60, AttrType.LONG: 0x68}
_VARINTS_TAG = {AttrType.INTS: 0x30, AttrType.BOOLEANS: 0x58, AttrType.BLOCKS: 0x70, AttrType.LONGS: 0x78}
_TEXT_TAG = {AttrType.STRING: 0x2A, AttrType.VAR: 0x8A}
_TEXTS_TAG = {AttrType.STRINGS: 0x42, AttrType.VARS: 0x92}
_TWO_BYTE_TAGS = {0x8A: b"\x8a\x01", 0x92: b"\x92\x01"}  # fields 17 and 18 take two bytes


def encode_plain_attr(name: str, attr: Attr) -> bytes | None:
    """The `OpDesc.Attr` bytes of a varint or string attr, as protobuf writes them; None
    for the other types."""
    attr_type, value = attr.type, attr.value
    head = _field(0x0A, name.encode()) + b"\x10" + _SMALL[int(attr_type)]
    tag = _VARINT_TAG.get(attr_type)
    if tag is not None:
        return head + _SMALL[tag] + _varint_bytes(int(value))
    tag = _VARINTS_TAG.get(attr_type)
    if tag is not None:
        prefix = _SMALL[tag]
        return head + b"".join([prefix + _varint_bytes(int(v)) for v in value])
    tag = _TEXT_TAG.get(attr_type)
    if tag is not None:
        return head + _tagged_text(tag, value)
    tag = _TEXTS_TAG.get(attr_type)
    if tag is not None:
        return head + b"".join([_tagged_text(tag, v) for v in value])
    return None


def _tagged_text(tag: int, text: str) -> bytes:
    body = text.encode()
    return _TWO_BYTE_TAGS.get(tag, _SMALL[tag] if tag < 128 else b"") + _length(body) + body


# ============================================== the common pieces, without protobuf
#
# Most attrs are a name, a type and one varint, string, float or list of those, and most
# vars are LoD tensors: decoding and encoding those here means a program Paddle wrote is
# read and written without importing protobuf's generated code (a good part of what
# `pstranspile transpile` spends on starting). Anything else (SCALAR attrs, packed lists,
# other var kinds, extra fields) returns None and goes through protobuf.

_ATTR_TYPE_OF_NUMBER = {int(t): t for t in AttrType}
_VALUE_TAG = {  # attr type -> the tag of its value field (wire types: 0 varint, 1 fixed64, 2 bytes, 5 fixed32)
    AttrType.INT: 0x18, AttrType.FLOAT: 0x25, AttrType.STRING: 0x2A, AttrType.INTS: 0x30, AttrType.FLOATS: 0x3D,
    AttrType.STRINGS: 0x42, AttrType.BOOLEAN: 0x50, AttrType.BOOLEANS: 0x58, AttrType.BLOCK: 0x60,
    AttrType.LONG: 0x68, AttrType.BLOCKS: 0x70, AttrType.LONGS: 0x78, AttrType.FLOAT64S: 0x181,
    AttrType.VAR: 0x18A, AttrType.VARS: 0x192, AttrType.FLOAT64: 0x199,
}
_REPEATED = frozenset({AttrType.INTS, AttrType.FLOATS, AttrType.STRINGS, AttrType.BOOLEANS, AttrType.BLOCKS,
                       AttrType.LONGS, AttrType.FLOAT64S, AttrType.VARS})
_DEFAULT = {AttrType.INT: 0, AttrType.FLOAT: 0.0, AttrType.STRING: "", AttrType.BOOLEAN: False,
            AttrType.BLOCK: 0, AttrType.LONG: 0, AttrType.VAR: "", AttrType.FLOAT64: 0.0}
_INT32_TYPES = frozenset({AttrType.INT, AttrType.INTS, AttrType.BLOCK, AttrType.BLOCKS})
_BOOL_TYPES = frozenset({AttrType.BOOLEAN, AttrType.BOOLEANS})
_FLOAT32 = struct.Struct("<f")
_FLOAT64 = struct.Struct("<d")


def decode_plain_attr(chunk: bytes) -> tuple[str, Attr] | None:
    """An `OpDesc.Attr` holding just its name, its type and values in its type's field,
    decoded as protobuf would; None for anything else."""
    end = len(chunk)
    if end < 4 or chunk[0] != 0x0A:
        return None
    start, pos = _chunk(chunk, 1, end)
    name = chunk[start:pos].decode()
    if pos >= end or chunk[pos] != 0x10:
        return None
    number, pos = _varint(chunk, pos + 1, end)
    attr_type = _ATTR_TYPE_OF_NUMBER.get(number)
    tag = _VALUE_TAG.get(attr_type)
    if tag is None:
        return None
    values = []
    while pos < end:
        if tag > 0xFF:  # fields 16..19: a two-byte tag
            if pos + 1 >= end or chunk[pos] != tag & 0xFF or chunk[pos + 1] != 0x01:
                return None
            pos += 2
        else:
            if chunk[pos] != tag:
                return None
            pos += 1
        value, pos = _field_value(chunk, pos, end, tag & 7, attr_type)
        values.append(value)
    if attr_type in _REPEATED:
        return name, Attr(attr_type, tuple(values))
    if len(values) > 1:
        return None  # protobuf keeps the last; leave it to protobuf
    return name, Attr(attr_type, values[0] if values else _DEFAULT[attr_type])


def _field_value(chunk: bytes, pos: int, end: int, wire_type: int, attr_type: AttrType) -> tuple[Any, int]:
    if wire_type == 0:
        if attr_type in _INT32_TYPES:
            return _int32(chunk, pos, end)
        if attr_type in _BOOL_TYPES:
            value, pos = _varint(chunk, pos, end)
            return value != 0, pos
        return _int64(chunk, pos, end)
    if wire_type == 2:
        start, pos = _chunk(chunk, pos, end)
        return chunk[start:pos].decode(), pos
    size, unpack = (4, _FLOAT32.unpack_from) if wire_type == 5 else (8, _FLOAT64.unpack_from)
    if pos + size > end:
        raise Unusual
    return unpack(chunk, pos)[0], pos + size


def encode_plain_float_attr(name: str, attr: Attr) -> bytes | None:
    """The bytes of a FLOAT / FLOATS / FLOAT64 / FLOAT64S attr; None if a value does not
    fit a float32 (protobuf decides what that becomes)."""
    tag, pack = {
        AttrType.FLOAT: (b"\x25", _FLOAT32.pack), AttrType.FLOATS: (b"\x3d", _FLOAT32.pack),
        AttrType.FLOAT64: (b"\x99\x01", _FLOAT64.pack), AttrType.FLOAT64S: (b"\x81\x01", _FLOAT64.pack),
    }.get(attr.type, (None, None))
    if tag is None:
        return None
    values = attr.value if attr.type in _REPEATED else (attr.value,)
    head = _field(0x0A, name.encode()) + b"\x10" + _SMALL[int(attr.type)]
    try:
        return head + b"".join([tag + pack(v) for v in values])
    except (OverflowError, struct.error):
        return None


_LOD_TENSOR = 7
_VAR_KIND_OF_NUMBER = {int(k): k for k in VarKind}
_DTYPE_OF_NUMBER = {int(d): d for d in DType}
_NO_EXPLICIT: frozenset[str] = frozenset()
_LOD_LEVEL_EXPLICIT = frozenset({"lod_level"})


def decode_plain_var_type(chunk: bytes) -> tuple | None:
    """A `VarType` that is a kind alone, or a LoD tensor (data type, dims, lod_level), as
    `Var._loaded` takes it; None for anything else."""
    end = len(chunk)
    if end < 2 or chunk[0] != 0x08:
        return None
    number, pos = _varint(chunk, 1, end)
    kind = _VAR_KIND_OF_NUMBER.get(number)
    if kind is None:
        return None
    if pos == end:
        return kind, None, None, 0, (), (), _NO_EXPLICIT
    if number != _LOD_TENSOR or chunk[pos] != 0x1A:
        return None
    start, pos = _chunk(chunk, pos + 1, end)
    if pos != end:
        return None
    return _lod_tensor_desc(kind, chunk, start, end)


def _lod_tensor_desc(kind: VarKind, chunk: bytes, pos: int, end: int) -> tuple | None:
    tensor = None
    lod_level = None
    while pos < end:
        tag = chunk[pos]
        if tag == 0x0A and tensor is None:
            start, pos = _chunk(chunk, pos + 1, end)
            tensor = _tensor_desc(chunk, start, pos)
            if tensor is None:
                return None
        elif tag == 0x10 and lod_level is None:
            lod_level, pos = _int32(chunk, pos + 1, end)
        else:
            return None
    if tensor is None:
        return None
    dtype, shape = tensor
    explicit = _NO_EXPLICIT if lod_level is None else _LOD_LEVEL_EXPLICIT
    return kind, dtype, shape, lod_level or 0, (), (), explicit


def _tensor_desc(chunk: bytes, pos: int, end: int) -> tuple | None:
    if pos >= end or chunk[pos] != 0x08:
        return None
    number, pos = _varint(chunk, pos + 1, end)
    dtype = _DTYPE_OF_NUMBER.get(number)
    if dtype is None:
        return None
    dims = []
    while pos < end:
        if chunk[pos] != 0x10:
            return None
        dim, pos = _int64(chunk, pos + 1, end)
        dims.append(dim)
    return dtype, tuple(dims)


def encode_plain_var_type(var: Var) -> bytes | None:
    """The `VarType` bytes of a var that is a kind alone or a plain LoD tensor; None for
    anything else."""
    if var.reader or var.tuple_types or any(f in var._explicit for f in ("reader", "tuple")):
        return None
    kind = b"\x08" + _varint_bytes(int(var.kind))
    if var.dtype is None:
        return kind
    if var.kind != _LOD_TENSOR or any(f.startswith("tensor_field:") for f in var._explicit):
        return None
    tensor = b"\x08" + _varint_bytes(int(var.dtype)) + b"".join([b"\x10" + _varint_bytes(d) for d in var.shape or ()])
    body = _field(0x0A, tensor)
    if var.lod_level != 0 or "lod_level" in var._explicit:
        body += b"\x10" + _varint_bytes(var.lod_level)
    return kind + _field(0x1A, body)
