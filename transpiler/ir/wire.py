"""The fast reader of `ProgramDesc` bytes: the common case of `serde.program_from_bytes`.

Going through protobuf's Python objects costs about a microsecond per field touched
(every sub-message and repeated field is a wrapper object), which made loading a real
model cost some 40 µs per op. This reader walks the wire format itself, for the
shape Paddle writes: every field known to Paddle 2.6's schema, every required field
there, no field that should appear once appearing twice, UTF-8 text, enum numbers
the schema knows. The parts that repeat across a program are decoded once per distinct
byte string and shared (op attrs, a var's type): those go through protobuf, by the
callbacks `serde` passes in, so their meaning is protobuf's.

Anything else (unknown fields, a missing required field, packed numbers, truncated bytes
...) raises `Unusual`, and `serde` decodes the whole program the slow way, which knows
how to warn or refuse. So this module never has to reproduce protobuf's corner cases:
it only has to agree with it on the bytes it accepts (the tests compare the two readers
on every fixture and on mutated bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transpiler.ir.attrs import Attr
from transpiler.ir.program import Block, Op, Program, Var


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
            desc = self._decode_var_type(chunk)
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
                    entry = decode(chunk)
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
