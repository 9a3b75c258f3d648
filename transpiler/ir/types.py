"""Enumerations of the Fluid IR, with the wire numbers of Paddle's `framework.proto`.

Paddle folds data types and variable kinds into one enum (`VarType.Type`); the IR splits
them into `DType` and `VarKind` so a var's kind and its element type cannot be confused.
The numbers are the wire values, so serde converts with `DType(n)` / `int(dtype)`.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


class AttrType(enum.IntEnum):
    INT = 0
    FLOAT = 1
    STRING = 2
    INTS = 3
    FLOATS = 4
    STRINGS = 5
    BOOLEAN = 6
    BOOLEANS = 7
    BLOCK = 8
    LONG = 9
    BLOCKS = 10
    LONGS = 11
    FLOAT64S = 12
    VAR = 13
    VARS = 14
    FLOAT64 = 15
    SCALAR = 16
    SCALARS = 17


class DType(enum.IntEnum):
    """Element types (the data-type half of Paddle's `VarType.Type`)."""

    BOOL = 0
    INT16 = 1
    INT32 = 2
    INT64 = 3
    FP16 = 4
    FP32 = 5
    FP64 = 6
    SIZE_T = 19
    UINT8 = 20
    INT8 = 21
    BF16 = 22
    COMPLEX64 = 23
    COMPLEX128 = 24

    @property
    def short(self) -> str:
        """Lower-case name used by the text dump (`fp32`, `int64`, ...)."""
        return self.name.lower()

    @property
    def itemsize(self) -> int:
        """Bytes per element (numpy's `itemsize`; BF16 2, SIZE_T 8), without importing numpy."""
        return _ITEMSIZE[self]

    def to_numpy(self) -> np.dtype:
        import numpy as np  # here, not at the top: `pstranspile --version` / `dump` need no numpy

        try:
            return np.dtype(_NUMPY_OF[self])
        except KeyError:
            raise TypeError(f"dtype {self.name} has no numpy equivalent") from None

    @classmethod
    def from_any(cls, value: DType | str | np.dtype | type) -> DType:
        """`DType.FP32`, `"float32"`, `"fp32"`, `np.float32` and `np.dtype("f4")` all give FP32."""
        if isinstance(value, DType):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            if key in _ALIASES:
                return _ALIASES[key]
            try:
                return cls[key.upper()]
            except KeyError:
                pass
        import numpy as np

        try:
            np_dtype = np.dtype(value)
        except TypeError:
            raise ValueError(f"unknown dtype {value!r}") from None
        for dtype, name in _NUMPY_OF.items():
            if np.dtype(name) == np_dtype:
                return dtype
        raise ValueError(f"unknown dtype {value!r}")


_ITEMSIZE = {
    DType.BOOL: 1, DType.INT16: 2, DType.INT32: 4, DType.INT64: 8, DType.FP16: 2, DType.FP32: 4, DType.FP64: 8,
    DType.SIZE_T: 8, DType.UINT8: 1, DType.INT8: 1, DType.BF16: 2, DType.COMPLEX64: 8, DType.COMPLEX128: 16,
}

_NUMPY_OF = {
    DType.BOOL: "bool",
    DType.INT16: "int16",
    DType.INT32: "int32",
    DType.INT64: "int64",
    DType.FP16: "float16",
    DType.FP32: "float32",
    DType.FP64: "float64",
    DType.SIZE_T: "uint64",
    DType.UINT8: "uint8",
    DType.INT8: "int8",
    DType.COMPLEX64: "complex64",
    DType.COMPLEX128: "complex128",
}

_ALIASES = {
    "float32": DType.FP32,
    "float": DType.FP32,
    "float64": DType.FP64,
    "double": DType.FP64,
    "float16": DType.FP16,
    "half": DType.FP16,
    "bfloat16": DType.BF16,
    "int": DType.INT32,
    "long": DType.INT64,
    "bool": DType.BOOL,
}


class VarKind(enum.IntEnum):
    """Variable kinds (the container half of Paddle's `VarType.Type`)."""

    LOD_TENSOR = 7
    SELECTED_ROWS = 8
    FEED_MINIBATCH = 9
    FETCH_LIST = 10
    STEP_SCOPES = 11
    LOD_RANK_TABLE = 12
    LOD_TENSOR_ARRAY = 13
    PLACE_LIST = 14
    READER = 15
    RAW = 17
    TUPLE = 18
    STRING = 25
    STRINGS = 26
    VOCAB = 27
    FEED_LIST = 28
    PSTRING = 29
    SPARSE_COO = 30
    SPARSE_CSR = 31


# The VarType sub-message that carries a kind's tensor description. Kinds absent here
# (FEED_MINIBATCH, RAW, ...) carry none.
TENSOR_FIELD_OF_KIND: dict[VarKind, str] = {
    VarKind.LOD_TENSOR: "lod_tensor",
    VarKind.SELECTED_ROWS: "selected_rows",
    VarKind.LOD_TENSOR_ARRAY: "tensor_array",
    VarKind.STRING: "string",
    VarKind.STRINGS: "strings",
    VarKind.VOCAB: "vocab",
    VarKind.SPARSE_COO: "sparse_coo",
    VarKind.SPARSE_CSR: "sparse_csr",
}

# Sub-messages whose tensor description carries a `lod_level` beside it.
LOD_FIELDS = frozenset({"lod_tensor", "tensor_array"})


class OpRole(enum.IntFlag):
    """Fluid's `op_role` attr: what part of training an op belongs to.

    Values combine as Fluid combines them: the loss op is `Forward | Loss` (256), the
    loss-grad seed `Backward | Loss` (257), lr-decay ops `LRSched` (16).
    """

    Forward = 0
    Backward = 1
    Optimize = 2
    RPC = 4
    Dist = 8
    LRSched = 16
    Loss = 256

    def describe(self) -> str:
        """`"backward|loss"`, `"forward|loss"`; `"forward"` for 0 (Forward is the absence of
        the other base roles, so the loss op, 256, is forward|loss)."""
        names = [m.name.lower() for m in OpRole if m.value and m.value & self.value]
        if not self.value & 0xFF:
            names.insert(0, "forward")
        return "|".join(names)


OP_ROLE_ATTR = "op_role"
OP_ROLE_VAR_ATTR = "op_role_var"
OP_CALLSTACK_ATTR = "op_callstack"
OP_NAMESCOPE_ATTR = "op_namescope"

# The name Paddle uses in a grad op's slot for a grad that is not needed.
EMPTY_VAR_NAME = "@EMPTY@"
GRAD_SUFFIX = "@GRAD"
