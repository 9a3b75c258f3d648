"""Typed op attributes.

An `Attr` is an (`AttrType`, value) pair whose value is already normalised to one
Python shape per type, so the rest of the code never guesses:

| AttrType | Python value |
|---|---|
| INT, LONG | `int` (range-checked: int32 / int64) |
| FLOAT, FLOAT64 | `float` |
| STRING | `str` |
| BOOLEAN | `bool` |
| INTS, LONGS, FLOATS, FLOAT64S, STRINGS, BOOLEANS | `tuple` of the element type |
| BLOCK | `int` (block index); BLOCKS a `tuple[int, ...]` |
| VAR | `str` (var name); VARS a `tuple[str, ...]` |
| SCALAR | `bool`, `int`, `float` or `complex`; SCALARS a tuple of those |

Lists are stored as tuples so an attr read from one op can never be mutated through
another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from transpiler.errors import IRError
from transpiler.ir.types import OP_CALLSTACK_ATTR, OP_NAMESCOPE_ATTR, OP_ROLE_ATTR, OP_ROLE_VAR_ATTR, AttrType

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

LIST_TYPES = frozenset(
    {
        AttrType.INTS,
        AttrType.FLOATS,
        AttrType.STRINGS,
        AttrType.BOOLEANS,
        AttrType.BLOCKS,
        AttrType.LONGS,
        AttrType.FLOAT64S,
        AttrType.VARS,
        AttrType.SCALARS,
    }
)
BLOCK_TYPES = frozenset({AttrType.BLOCK, AttrType.BLOCKS})
VAR_TYPES = frozenset({AttrType.VAR, AttrType.VARS})
# Attr types whose values name blocks or vars: whether they are right depends on the program.
REFERENCE_TYPES = BLOCK_TYPES | VAR_TYPES

# The attrs every Paddle op may carry, with the type Paddle's OpDesc gives them: the
# transpiler reads them, so a program that types one otherwise is malformed (the verifier says so).
COMMON_ATTR_TYPES = {
    OP_ROLE_ATTR: (AttrType.INT,),
    OP_ROLE_VAR_ATTR: (AttrType.STRINGS,),
    OP_NAMESCOPE_ATTR: (AttrType.STRING,),
    OP_CALLSTACK_ATTR: (AttrType.STRINGS,),
}

# The element type of each list type, used to coerce elements one by one.
ELEMENT_TYPE = {
    AttrType.INTS: AttrType.INT,
    AttrType.FLOATS: AttrType.FLOAT,
    AttrType.STRINGS: AttrType.STRING,
    AttrType.BOOLEANS: AttrType.BOOLEAN,
    AttrType.BLOCKS: AttrType.BLOCK,
    AttrType.LONGS: AttrType.LONG,
    AttrType.FLOAT64S: AttrType.FLOAT64,
    AttrType.VARS: AttrType.VAR,
    AttrType.SCALARS: AttrType.SCALAR,
}
LIST_TYPE_OF_ELEMENT = {v: k for k, v in ELEMENT_TYPE.items()}


@dataclass(frozen=True, slots=True, init=False)
class Attr:
    """One attribute value with its wire type. Build with `Attr.of(value, type)`."""

    type: AttrType
    value: Any

    def __init__(self, type: AttrType, value: Any) -> None:
        # The slots' own setters: what the frozen dataclass's generated `__init__` does through
        # `object.__setattr__` looked up per field, at half the cost (a transpile builds thousands).
        _set_type(self, type)
        _set_value(self, value)

    @staticmethod
    def of(value: Any, type: AttrType | None = None) -> Attr:
        """Normalise `value` to `type`, or infer the type from the value when `type` is None."""
        if isinstance(value, Attr):
            return value if type is None or value.type == type else Attr.of(value.value, type)
        if type is None:
            attr_type = infer_attr_type(value)
        else:
            attr_type = type if type.__class__ is AttrType else AttrType(type)
        return Attr(attr_type, coerce(value, attr_type))


_set_type = Attr.__dict__["type"].__set__
_set_value = Attr.__dict__["value"].__set__


def sound_on_its_own(name: str, attr: Attr) -> bool:
    """Whether the verifier's checks of attr `name` pass in any program: a common attr of
    its type, or any other attr that names no block or var. An op whose attrs are all so
    need not have them checked again until one changes (`Op._verified_attrs`)."""
    if attr.type in REFERENCE_TYPES:
        return False
    expected = COMMON_ATTR_TYPES.get(name)
    return expected is None or attr.type in expected


def infer_attr_type(value: Any) -> AttrType:
    """Guess the wire type of a Python value, as Paddle's Python side does."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise IRError("cannot infer the type of an empty list attr; pass an explicit AttrType")
        element_types = {infer_attr_type(v) for v in value}
        if element_types <= {AttrType.INT, AttrType.LONG}:
            return AttrType.LONGS if AttrType.LONG in element_types else AttrType.INTS
        if element_types <= {AttrType.INT, AttrType.LONG, AttrType.FLOAT}:
            return AttrType.FLOATS
        if len(element_types) == 1:
            (element,) = element_types
            if element in LIST_TYPE_OF_ELEMENT:
                return LIST_TYPE_OF_ELEMENT[element]
        raise IRError(f"cannot infer the type of a list attr mixing {sorted(t.name for t in element_types)}")
    if _is_block(value):
        return AttrType.BLOCK
    if isinstance(value, bool):
        return AttrType.BOOLEAN
    if isinstance(value, int):
        return AttrType.INT if INT32_MIN <= value <= INT32_MAX else AttrType.LONG
    if isinstance(value, float):
        return AttrType.FLOAT
    if isinstance(value, str):
        return AttrType.STRING
    if isinstance(value, complex):
        return AttrType.SCALAR
    if hasattr(value, "dtype") and hasattr(value, "item"):  # numpy scalars
        return infer_attr_type(value.item())
    raise IRError(f"cannot use a {type(value).__name__} as an attr value")


# The Python class each attr type keeps as is (the common case, checked first).
_KEPT_CLASS = {
    AttrType.STRING: str, AttrType.VAR: str, AttrType.BOOLEAN: bool, AttrType.FLOAT: float, AttrType.FLOAT64: float,
}
_KEPT_ELEMENT_CLASS = {AttrType.STRINGS: str, AttrType.VARS: str, AttrType.BOOLEANS: bool}
_INT_LIST_BOUNDS = {AttrType.INTS: (INT32_MIN, INT32_MAX), AttrType.LONGS: (INT64_MIN, INT64_MAX)}


_INT = AttrType.INT  # an enum member read from its class costs more than a global: coerce is hot


def coerce(value: Any, attr_type: AttrType) -> Any:
    """Convert `value` to the normalised Python shape of `attr_type`, or raise `IRError`."""
    cls = value.__class__
    if cls is _KEPT_CLASS.get(attr_type):
        return value
    if cls is int and attr_type is _INT and INT32_MIN <= value <= INT32_MAX:
        return value
    if (cls is tuple or cls is list) and value:
        element = _KEPT_ELEMENT_CLASS.get(attr_type)
        if element is not None and set(map(type, value)) == {element}:
            return tuple(value)
        bounds = _INT_LIST_BOUNDS.get(attr_type)
        if bounds is not None and set(map(type, value)) == {int} and bounds[0] <= min(value) and max(value) <= bounds[1]:
            return tuple(value)  # what coercing element by element gives, at C speed (shapes, sections)
    if attr_type in LIST_TYPES:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise IRError(f"a {attr_type.name} attr needs a list, got {type(value).__name__}")
        element = ELEMENT_TYPE[attr_type]
        return tuple(coerce(v, element) for v in value)
    if hasattr(value, "dtype") and hasattr(value, "item") and not _is_block(value):
        value = value.item()
    if attr_type in (AttrType.INT, AttrType.LONG):
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise IRError(f"a {attr_type.name} attr needs an integer, got {value!r}")
        low, high = (INT32_MIN, INT32_MAX) if attr_type == AttrType.INT else (INT64_MIN, INT64_MAX)
        if not low <= value <= high:
            raise IRError(f"{value} does not fit a {attr_type.name} attr")
        return int(value)
    if attr_type in (AttrType.FLOAT, AttrType.FLOAT64):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise IRError(f"a {attr_type.name} attr needs a number, got {value!r}")
        return float(value)
    if attr_type in (AttrType.STRING, AttrType.VAR):
        if not isinstance(value, str):
            name = getattr(value, "name", None)
            if attr_type == AttrType.VAR and isinstance(name, str):
                return name
            raise IRError(f"a {attr_type.name} attr needs a string, got {value!r}")
        return value
    if attr_type == AttrType.BOOLEAN:
        if not isinstance(value, bool):
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            raise IRError(f"a BOOLEAN attr needs a bool, got {value!r}")
        return value
    if attr_type == AttrType.BLOCK:
        if _is_block(value):
            return int(value.idx)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise IRError(f"a BLOCK attr needs a Block or a block index, got {value!r}")
        return value
    if attr_type == AttrType.SCALAR:
        if not isinstance(value, (bool, int, float, complex)):
            raise IRError(f"a SCALAR attr needs a bool, int, float or complex, got {value!r}")
        if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
            raise IRError(f"{value} does not fit a SCALAR attr (int64)")
        return value
    raise IRError(f"unsupported attr type {attr_type!r}")


def _is_block(value: Any) -> bool:
    # Duck-typed so this module need not import the Block class.
    return hasattr(value, "idx") and hasattr(value, "parent_idx") and hasattr(value, "ops")


def attr_values_equal(a: Attr, b: Attr) -> bool:
    """Equality that treats NaN as equal to NaN (a NaN attr must not make a program differ from itself)."""
    if a.type != b.type:
        return False
    return _values_equal(a.value, b.value)


def _values_equal(x: Any, y: Any) -> bool:
    if isinstance(x, tuple) and isinstance(y, tuple):
        return len(x) == len(y) and all(_values_equal(p, q) for p, q in zip(x, y, strict=True))
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return type(x) is type(y) and x == y
