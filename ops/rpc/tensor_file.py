"""Fluid's LoDTensor file format: one var per file, what `fluid.io.save_persistables`
writes and `fluid.io.load_persistables` reads (Paddle's `SerializeToStream`).

| bytes | what |
|---|---|
| uint32 | LoDTensor version, 0 |
| uint64 | LoD level count `L` |
| L × (uint64 + data) | each level: its byte size, then its offsets as uint64 |
| uint32 | Tensor version, 0 |
| int32 | size of the `VarType.TensorDesc` protobuf that follows |
| bytes | `TensorDesc` (`data_type`, `dims`; proto2, dims not packed) |
| bytes | the elements, C order, little-endian |

All little-endian (Paddle writes host order; every machine it runs on is little-endian).
Checked byte for byte against files Fluid 1.8.5 wrote, and Fluid 1.8.5 loads ours
(`tests/test_checkpoint_paddle.py`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ops.tensor import LoDTensor
from proto import framework_pb2
from transpiler.errors import PsTranspilerError
from transpiler.fileio import write_atomic
from transpiler.ir.types import DType


class TensorFileError(PsTranspilerError):
    """A file that is not a LoDTensor file (torn, foreign, or of an unknown dtype)."""


def encode_tensor(array: np.ndarray, lod: Sequence[np.ndarray] = ()) -> bytes:
    """The bytes of one LoDTensor file."""
    array = np.ascontiguousarray(array) if np.ndim(array) else np.asarray(array)  # a 0-d var stays 0-d (dims [])
    desc = framework_pb2.VarType.TensorDesc(data_type=int(DType.from_any(array.dtype)), dims=list(array.shape))
    desc_bytes = desc.SerializeToString()
    parts = [struct.pack("<IQ", 0, len(lod))]
    for level in lod:
        offsets = np.ascontiguousarray(level, dtype="<u8")
        parts += [struct.pack("<Q", offsets.nbytes), offsets.tobytes()]
    parts += [struct.pack("<Ii", 0, len(desc_bytes)), desc_bytes, array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()]
    return b"".join(parts)


def decode_tensor(data: bytes | memoryview, where: str = "the tensor") -> LoDTensor:
    """One LoDTensor file's bytes back to a `LoDTensor` (the array is a copy)."""
    view = memoryview(data)
    try:
        version, levels = struct.unpack_from("<IQ", view, 0)
        if version != 0:
            raise TensorFileError(f"{where}: LoDTensor version {version}, not 0")
        pos, lod = 12, []
        for _ in range(levels):
            (size,) = struct.unpack_from("<Q", view, pos)
            lod.append(np.frombuffer(view[pos + 8 : pos + 8 + size], dtype="<u8").astype(np.int64))
            pos += 8 + size
        version, desc_size = struct.unpack_from("<Ii", view, pos)
        if version != 0 or desc_size < 0:
            raise TensorFileError(f"{where}: Tensor version {version}, desc size {desc_size}")
        pos += 8
        desc = framework_pb2.VarType.TensorDesc.FromString(bytes(view[pos : pos + desc_size]))
        pos += desc_size
    except (struct.error, ValueError) as exc:
        raise TensorFileError(f"{where}: not a LoDTensor file ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError
        raise TensorFileError(f"{where}: not a LoDTensor file (bad TensorDesc: {exc})") from None
    try:
        dtype = DType(desc.data_type).to_numpy().newbyteorder("<")
    except (ValueError, TypeError):
        raise TensorFileError(f"{where}: unsupported data type {desc.data_type}") from None
    shape = tuple(int(d) for d in desc.dims)
    count = int(np.prod(shape, dtype=np.int64))
    if len(view) - pos != count * dtype.itemsize:
        raise TensorFileError(
            f"{where}: {len(view) - pos} data bytes for a {list(shape)} {dtype.name} tensor "
            f"({count * dtype.itemsize} expected): torn or foreign"
        )
    array = np.frombuffer(view[pos:], dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
    return LoDTensor(array, lod or None)


def write_tensor(path: Path, array: np.ndarray, *, durable: bool = True) -> str:
    """Write one LoDTensor file atomically; its sha256."""
    data = encode_tensor(array)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda out: out.write(data), durable=durable)
    return hashlib.sha256(data).hexdigest()


def read_tensor(path: Path) -> np.ndarray:
    """A LoDTensor file's array; `TensorFileError` when unreadable or not one."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TensorFileError(f"cannot read {path}: {exc.strerror}") from None
    return decode_tensor(data, str(path)).array


__all__ = ["TensorFileError", "decode_tensor", "encode_tensor", "read_tensor", "write_tensor"]
