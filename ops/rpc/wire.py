"""Tensors on the wire: `VariableMessage` bytes ⇄ `LoDTensor` / `SelectedRows`.

The message is ordinary protobuf (`proto/rpc.proto`), but the big fields are handled
by hand so a tensor crosses the wire with one copy on each side at most:

* encoding serialises the small fields with protobuf, then appends the `rows` field,
  a `pad` field and the `data` field as raw bytes (`bytes.join` over the array's own
  buffer: the only copy). Protobuf allows fields in any order, so this is a valid
  message for any reader; the pad puts `data` at a 64-byte offset, so the receiver's
  array is aligned;
* decoding a message over `COPY_BELOW` (64 kB) walks the top-level fields, takes `rows`
  and `data` as memoryview slices of the received bytes, parses only the rest with
  protobuf, and wraps the slices with `np.frombuffer`: no copy. A smaller message is parsed
  whole by protobuf's C parser and its arrays copied out of it: walking the fields in
  Python costs more than copying that little (a 16 kB var: 2 against 8 µs; a batch of a
  step's 5 grads: 16 against 78 µs; past 64 kB the copy costs more, 200 µs at 256 kB).
  The arrays are read-only either way; kernels never write their inputs.

A `VarBatch` (several vars and a barrier flag in one message, what a sync trainer
sends and fetches once per pserver per step) is framed the same way: `encode_batch`
joins the vars' pieces (`var_parts`) in one copy, each var after a `pad` field that puts the var at a 64-byte
offset (so its `data` stays aligned), and `decode_batch` decodes each var in place (or,
under `COPY_BELOW`, the whole batch with protobuf).

Arrays in a scope may be non-contiguous views (a `split_byref` block of a transposed
grad), so `np.ascontiguousarray` comes first (a copy only when needed).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from ops.tensor import LoDTensor, SelectedRows
from proto import rpc_pb2
from transpiler.errors import PsTranspilerError
from transpiler.ir.types import DType

ROWS_FIELD = 8
PAD_FIELD = 14
DATA_FIELD = 15
ALIGN = 64
COPY_BELOW = 64 * 1024  # bytes: a smaller message is parsed whole by protobuf (see above)
MAX_VAR_FIELDS = 4096  # top-level fields of one VariableMessage walked by hand (a real one has < 20)
MAX_BATCH_FIELDS = 1 << 20  # top-level fields of one VarBatch walked by hand, unless the caller bounds it
_BIG_FIELDS = frozenset({ROWS_FIELD, DATA_FIELD})
_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5
_UINT64 = (1 << 64) - 1


class WireError(PsTranspilerError):
    """Bytes that are not a well-formed `VariableMessage`, or a value that cannot travel."""


@dataclass(frozen=True)
class WireVar:
    """A decoded `VariableMessage`: the var's name, its value (None when the message
    only names it, as a get request does) and the request's other fields."""

    name: str
    value: LoDTensor | SelectedRows | None
    trainer_id: int = 0
    merge_add: bool = False
    table_name: str = ""


@dataclass(frozen=True)
class WireBatch:
    """A decoded `VarBatch`; `fetch` and `fetch_barrier` are a `SendFetchBatch`'s."""

    trainer_id: int
    barrier: bool
    vars: tuple[WireVar, ...]
    fetch: tuple[str, ...] = ()
    fetch_barrier: bool = False


# ------------------------------------------------------------------ varints


_ONE_BYTE = [bytes((i,)) for i in range(0x80)]  # most keys and small lengths: no loop


def _varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return _ONE_BYTE[value]
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire: int = _WIRE_LEN) -> bytes:
    return _varint((field << 3) | wire)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """(the varint at `pos`, the position after it). Hot loops inline the one-byte case
    (`byte < 0x80`) and call this for the rest."""
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated VariableMessage (a varint runs past the end)")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("malformed VariableMessage (a varint is too long)")


# ------------------------------------------------------------------ encode


def _contiguous(array: np.ndarray) -> np.ndarray:
    """C-contiguous (a copy only when needed; unlike `np.ascontiguousarray`, 0-d stays 0-d)."""
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _little_endian(array: np.ndarray) -> np.ndarray:
    """The wire is little-endian; convert a big-endian array (a copy only then)."""
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        return array.astype(array.dtype.newbyteorder("<"))
    return array


def _payload(value: Any) -> tuple[int, np.ndarray, Any, np.ndarray | None, int]:
    """(kind, contiguous array, lod, rows or None, height) of a scope value."""
    if isinstance(value, SelectedRows):
        with value.lock:  # an auto-grown table changes in place: snapshot its rows and values together
            rows = np.asarray(value.rows, dtype=np.int64)
            array = value.value[: rows.size]
            if value.initializer is not None or value.capacity > rows.size:  # a table, not a grad
                rows, array = rows.copy(), array.copy()
        return rpc_pb2.SELECTED_ROWS, _contiguous(array), (), _little_endian(_contiguous(rows)), value.height
    if isinstance(value, LoDTensor):
        return rpc_pb2.LOD_TENSOR, _contiguous(value.array), value.lod, None, 0
    if isinstance(value, np.ndarray):
        return rpc_pb2.LOD_TENSOR, _contiguous(value), (), None, 0
    raise WireError(f"cannot send a {type(value).__name__}: only LoDTensor, SelectedRows and numpy arrays travel")


def encode_var(name: str, value: Any = None, **fields: Any) -> bytes:
    """The `VariableMessage` bytes for `name` (and `value`, when given); `fields` are
    `var_parts`' (`trainer_id`, `merge_add`, `table_name`)."""
    return b"".join(var_parts(name, value, **fields))


Parts = list[Any]  # bytes and uint8 arrays: a message not yet joined


def var_parts(
    name: str,
    value: Any = None,
    *,
    trainer_id: int = 0,
    merge_add: bool = False,
    table_name: str = "",
) -> Parts:
    """`encode_var`'s message as pieces (the array's own buffer among them), so a batch
    of vars is joined, and copied, once."""
    message = rpc_pb2.VariableMessage(
        varname=name, trainer_id=int(trainer_id), merge_add=bool(merge_add), table_name=table_name
    )
    if value is None:
        return [message.SerializeToString()]
    kind, array, lod, rows, height = _payload(value)
    array = _little_endian(array)
    message.has_value = True
    message.kind = kind
    message.data_type = _paddle_dtype(name, array.dtype)
    message.dims.extend(int(d) for d in array.shape)
    for level in lod:
        message.lod.add().offsets.extend(int(x) for x in level)
    message.height = int(height)
    parts: list[Any] = [message.SerializeToString()]
    if rows is not None and rows.size:
        parts += [_ROWS_KEY, _varint(rows.nbytes), rows.view(np.uint8).reshape(-1)]
    nbytes = array.nbytes
    if nbytes:
        data_key = _DATA_KEY + _varint(nbytes)
        pad = (-(_size(parts) + 2 + len(data_key))) % ALIGN  # the pad field is 2 + pad bytes (pad < 128)
        parts += [_PAD_KEY + _varint(pad) + bytes(pad), data_key, array.reshape(-1).view(np.uint8)]
    return parts


_ROWS_KEY, _DATA_KEY, _PAD_KEY = _key(ROWS_FIELD), _key(DATA_FIELD), _key(PAD_FIELD)


# dtype conversions, once per dtype (a step converts the same few many times)
_PADDLE_OF: dict[np.dtype, int] = {}
_NUMPY_OF: dict[int, np.dtype] = {}


def _paddle_dtype(name: str, dtype: np.dtype) -> int:
    """Paddle's data_type of a (little-endian) numpy dtype."""
    code = _PADDLE_OF.get(dtype)
    if code is None:
        try:
            code = _PADDLE_OF[dtype] = int(DType.from_any(dtype.newbyteorder("=")))
        except ValueError:
            raise WireError(f"var {name!r}: dtype {dtype} has no Paddle equivalent") from None
    return code


def _numpy_dtype(name: str, data_type: int) -> np.dtype:
    """The little-endian numpy dtype of Paddle's `data_type`."""
    dtype = _NUMPY_OF.get(data_type)
    if dtype is None:
        try:
            dtype = _NUMPY_OF[data_type] = DType(data_type).to_numpy().newbyteorder("<")
        except (ValueError, TypeError):
            raise WireError(f"var {name!r}: unknown data_type {data_type}") from None
    return dtype


def _size(parts: Parts) -> int:
    return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)


BATCH_TRAINER_FIELD, BATCH_BARRIER_FIELD, BATCH_VARS_FIELD, BATCH_PAD_FIELD = 1, 2, 3, 15
BATCH_FETCH_FIELD, BATCH_FETCH_BARRIER_FIELD = 4, 5


def encode_batch(encoded: list[Parts], *, trainer_id: int = 0, barrier: bool = False,
                 fetch: tuple[str, ...] | list[str] = (), fetch_barrier: bool = False) -> bytes:
    """The `VarBatch` bytes holding `encoded` (each var's `var_parts`), in order; `fetch`
    and `fetch_barrier` make it a `SendFetchBatch` request."""
    parts: list[bytes] = [
        _key(BATCH_TRAINER_FIELD, _WIRE_VARINT) + _varint(int(trainer_id) & _UINT64),  # two's complement, as protobuf
        _key(BATCH_BARRIER_FIELD, _WIRE_VARINT) + _varint(int(bool(barrier))),
    ]
    for name in fetch:
        raw = name.encode()
        parts.append(_key(BATCH_FETCH_FIELD) + _varint(len(raw)) + raw)
    if fetch_barrier:
        parts.append(_key(BATCH_FETCH_BARRIER_FIELD, _WIRE_VARINT) + _varint(1))
    size = sum(len(p) for p in parts)
    var_key = _key(BATCH_VARS_FIELD)
    for message in encoded:
        length = _size(message)
        head = var_key + _varint(length)
        pad = (-(size + 2 + len(head))) % ALIGN  # the pad field is 2 + pad bytes (pad < 128)
        parts += [_key(BATCH_PAD_FIELD) + _varint(pad) + bytes(pad), head, *message]
        size += 2 + pad + len(head) + length
    return b"".join(parts)


def decode_batch(data: bytes | memoryview, *, max_fields: int = MAX_BATCH_FIELDS) -> WireBatch:
    """Decode `VarBatch` bytes; every var's arrays are views of `data` (copies when
    `data` is under `COPY_BELOW`). A batch walked by hand with more than `max_fields`
    top-level fields (vars, their pads, fetched names) is a `WireError` as soon as the
    walk counts them: the walk is Python, its time must not be the sender's choice (a
    pserver passes what its program allows, `ops.rpc.limits`)."""
    if len(data) < COPY_BELOW:
        try:
            batch = rpc_pb2.VarBatch.FromString(data)
        except Exception:  # protobuf's DecodeError: the walk below names what is wrong
            pass
        else:
            return WireBatch(batch.trainer_id, batch.barrier, tuple(_from_message(v) for v in batch.vars),
                             tuple(batch.fetch), batch.fetch_barrier)
    return _walk_batch(data, max_fields)


def _walk_batch(data: bytes | memoryview, max_fields: int = MAX_BATCH_FIELDS) -> WireBatch:
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    trainer_id, barrier, found, fetch, fetch_barrier = 0, False, [], [], False
    pos, end, fields = 0, len(buf), 0
    while pos < end:
        fields += 1
        if fields > max_fields:
            raise WireError(f"a VarBatch of more than {max_fields} fields (vars, pads and names to fetch)")
        key = buf[pos]
        key, pos = (key, pos + 1) if key < 0x80 else _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == _WIRE_VARINT:
            value, pos = _read_varint(buf, pos)
            if field == BATCH_TRAINER_FIELD:
                trainer_id = value - (1 << 64) if value >= 1 << 63 else value  # int32: negatives are 10-byte varints
            elif field == BATCH_BARRIER_FIELD:
                barrier = bool(value)
            elif field == BATCH_FETCH_BARRIER_FIELD:
                fetch_barrier = bool(value)
        elif wire == _WIRE_LEN:
            length, pos = _read_varint(buf, pos)
            if pos + length > end:
                raise WireError(f"truncated VarBatch (field {field} needs {length} bytes)")
            if field == BATCH_VARS_FIELD:
                found.append(decode_var(buf[pos : pos + length]))
            elif field == BATCH_FETCH_FIELD:
                fetch.append(_utf8(buf[pos : pos + length]))
            pos += length
        elif wire in (_WIRE_I64, _WIRE_I32):
            pos += 8 if wire == _WIRE_I64 else 4
        else:
            raise WireError(f"malformed VarBatch (wire type {wire} in field {field})")
    if pos > end:
        raise WireError("truncated VarBatch")
    return WireBatch(trainer_id, barrier, tuple(found), tuple(fetch), fetch_barrier)


def _utf8(raw: memoryview) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError:
        raise WireError("malformed VarBatch (a fetched var's name is not UTF-8)") from None


# ------------------------------------------------------------------ decode


def _split_fields(buf: memoryview) -> tuple[bytes, dict[int, memoryview]]:
    """(the message without its big fields, big field number -> its bytes as a view)."""
    small: list[memoryview] = []
    big: dict[int, memoryview] = {}
    pos, end, fields = 0, len(buf), 0
    while pos < end:
        fields += 1
        if fields > MAX_VAR_FIELDS:
            raise WireError(f"malformed VariableMessage (more than {MAX_VAR_FIELDS} fields)")
        start = pos
        key = buf[pos]
        key, pos = (key, pos + 1) if key < 0x80 else _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == _WIRE_VARINT:
            _, pos = _read_varint(buf, pos)
        elif wire == _WIRE_I64:
            pos += 8
        elif wire == _WIRE_I32:
            pos += 4
        elif wire == _WIRE_LEN:
            length, pos = _read_varint(buf, pos)
            if field in _BIG_FIELDS:
                if pos + length > end:
                    raise WireError(f"truncated VariableMessage (field {field} needs {length} bytes)")
                big[field] = buf[pos : pos + length]
                pos += length
                continue
            pos += length
        else:
            raise WireError(f"malformed VariableMessage (wire type {wire} in field {field})")
        if pos > end:
            raise WireError("truncated VariableMessage")
        small.append(buf[start:pos])
    return b"".join(small), big


def decode_var(data: bytes | memoryview) -> WireVar:
    """Decode `VariableMessage` bytes; the value's arrays are views of `data` (copies
    when `data` is under `COPY_BELOW`)."""
    if len(data) < COPY_BELOW:
        try:
            message = rpc_pb2.VariableMessage.FromString(data)
        except Exception:  # protobuf's DecodeError: the walk below names what is wrong
            pass
        else:
            return _from_message(message)
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    small, big = _split_fields(buf)
    try:
        message = rpc_pb2.VariableMessage.FromString(small)
    except Exception as exc:  # protobuf's DecodeError
        raise WireError(f"malformed VariableMessage: {exc}") from None
    return _wire_var(message, big)


def _from_message(message: Any) -> WireVar:
    """A var protobuf parsed whole (its big fields are bytes of the message's own)."""
    return _wire_var(message, {DATA_FIELD: message.data, ROWS_FIELD: message.rows})


def _wire_var(message: Any, big: dict[int, Any]) -> WireVar:
    return WireVar(
        name=message.varname,
        value=_value(message, big) if message.has_value else None,
        trainer_id=message.trainer_id,
        merge_add=message.merge_add,
        table_name=message.table_name,
    )


def _value(message: Any, big: dict[int, Any]) -> LoDTensor | SelectedRows:
    name = message.varname
    dtype = _numpy_dtype(name, message.data_type)
    dims = tuple(message.dims)  # protobuf's ints
    payload = big.get(DATA_FIELD, b"")
    expected = math.prod(dims) * dtype.itemsize
    if len(payload) != expected:
        raise WireError(f"var {name!r}: {len(payload)} data bytes for {dtype.name}{list(dims)} ({expected} expected)")
    array = np.frombuffer(payload, dtype=dtype).reshape(dims)
    if message.kind == rpc_pb2.SELECTED_ROWS:
        raw_rows = big.get(ROWS_FIELD, b"")
        if len(raw_rows) % 8:
            raise WireError(f"var {name!r}: {len(raw_rows)} row bytes is not a whole number of int64 rows")
        rows = np.frombuffer(raw_rows, dtype="<i8")
        try:
            return SelectedRows(rows, array, int(message.height))
        except ValueError as exc:
            raise WireError(f"var {name!r}: {exc}") from None
    if not message.lod:
        return LoDTensor(array)
    try:
        return LoDTensor(array, [list(level.offsets) for level in message.lod])
    except ValueError as exc:
        raise WireError(f"var {name!r}: {exc}") from None
