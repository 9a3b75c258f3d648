"""The text and JSON dumps of a program.

The text dump is what golden files hold and what `pstranspile dump` / `diff` print, so
it is stable (no ids, no addresses, no alignment padding that would ripple through a
diff), noise-free (op callstacks and name scopes are left out unless asked for) and has
one op per line:

    program version=1008005 blocks=1
    block 0 parent=-1 vars=9 ops=13
      var fc_w lod_tensor fp32 [1000, 1000] persistable param
      var x lod_tensor fp32 [-1, 1000] stop_gradient need_check_feed
      op 0 mul X=[x] Y=[fc_w] -> Out=[fc_0.tmp_0] {op_role=forward, x_num_col_dims=1, y_num_col_dims=1}

Slots and attrs are sorted by name. docs/cli.md ("The text dump format") documents every field.
"""

from __future__ import annotations

import json
import math
from typing import Any

from transpiler.ir.attrs import Attr
from transpiler.ir.program import Block, Op, Program, Var
from transpiler.ir.types import OP_CALLSTACK_ATTR, OP_NAMESCOPE_ATTR, OP_ROLE_ATTR, AttrType, OpRole

# Attrs that say where Python built an op, not what it does.
NOISE_ATTRS = frozenset({OP_CALLSTACK_ATTR, OP_NAMESCOPE_ATTR})

DUMP_FORMAT_LINE = "# ps-transpiler dump v1"


# ------------------------------------------------------------------------ values


def format_float32(value: float) -> str:
    """The shortest text that reads back as the same float32 (`0.1`, not `0.10000000149`)."""
    if math.isnan(value) or math.isinf(value):
        return str(value)
    import numpy as np  # here: the verifier imports this module, and transpiling needs no numpy

    return str(np.float32(value))


def format_attr(attr: Attr, name: str = "") -> str:
    value, kind = attr.value, attr.type
    if name == OP_ROLE_ATTR and kind == AttrType.INT:
        return OpRole(value & 0xFFFF_FFFF).describe() if value >= 0 else str(value)
    if kind in (AttrType.INT, AttrType.LONG):
        return str(value)
    if kind == AttrType.FLOAT:
        return format_float32(value)
    if kind == AttrType.FLOAT64:
        return repr(value)
    if kind == AttrType.STRING:
        return json.dumps(value, ensure_ascii=False)
    if kind == AttrType.BOOLEAN:
        return "true" if value else "false"
    if kind == AttrType.BLOCK:
        return f"block[{value}]"
    if kind == AttrType.VAR:
        return f"var({value})"
    if kind == AttrType.SCALAR:
        return f"scalar({_scalar_text(value)})"
    element = {
        AttrType.INTS: str,
        AttrType.LONGS: str,
        AttrType.FLOATS: format_float32,
        AttrType.FLOAT64S: repr,
        AttrType.STRINGS: lambda v: json.dumps(v, ensure_ascii=False),
        AttrType.BOOLEANS: lambda v: "true" if v else "false",
        AttrType.BLOCKS: lambda v: f"block[{v}]",
        AttrType.VARS: lambda v: f"var({v})",
        AttrType.SCALARS: lambda v: f"scalar({_scalar_text(v)})",
    }[kind]
    return "[" + ", ".join(element(v) for v in value) + "]"


def _scalar_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


# ------------------------------------------------------------------------- lines


def var_line(var: Var) -> str:
    parts = ["var", var.name, var.kind.name.lower()]
    if var.dtype is not None:
        parts.append(var.dtype.short)
        parts.append("[" + ", ".join(str(d) for d in var.shape or ()) + "]")
    if var.lod_level:
        parts.append(f"lod={var.lod_level}")
    for flag, word in (
        ("persistable", "persistable"),
        ("is_parameter", "param"),
        ("stop_gradient", "stop_gradient"),
        ("need_check_feed", "need_check_feed"),
    ):
        if getattr(var, flag):
            parts.append(word)
    if var.reader:
        parts.append("reader=" + json.dumps([[d.short, list(s), lod] for d, s, lod in var.reader]))
    if var.tuple_types:
        parts.append("tuple=" + json.dumps(list(var.tuple_types)))
    if var.attrs:
        parts.append("{" + ", ".join(f"{k}={format_attr(a)}" for k, a in sorted(var.attrs.items())) + "}")
    return " ".join(parts)


def _slot_text(slots) -> str:
    return " ".join(f"{slot}=[{', '.join(args)}]" for slot, args in sorted(slots.items()))


def op_line(op: Op, index: int, *, all_attrs: bool = False) -> str:
    parts = ["op", str(index), op.type]
    inputs = _slot_text(op.inputs)
    if inputs:
        parts.append(inputs)
    parts.append("->")
    outputs = _slot_text(op.outputs)
    if outputs:
        parts.append(outputs)
    attrs = [
        f"{name}={format_attr(attr, name)}"
        for name, attr in sorted(op.attrs.items())
        if all_attrs or name not in NOISE_ATTRS
    ]
    parts.append("{" + ", ".join(attrs) + "}")
    if op.is_target:
        parts.append("target")
    return " ".join(parts)


def block_lines(block: Block, *, all_attrs: bool = False) -> list[str]:
    head = f"block {block.idx} parent={block.parent_idx} vars={len(block.vars)} ops={len(block)}"
    if block.forward_block_idx != -1:
        head += f" forward_block={block.forward_block_idx}"
    lines = [head]
    lines += ["  " + var_line(var) for var in sorted(block.vars.values(), key=lambda v: v.name)]
    lines += ["  " + op_line(op, i, all_attrs=all_attrs) for i, op in enumerate(block.ops)]
    return lines


def dump_lines(program: Program, *, block: int | None = None, all_attrs: bool = False) -> list[str]:
    version = "none" if program.version is None else str(program.version)
    head = f"program version={version} blocks={program.num_blocks}"
    if program.op_version_map is not None:
        head += f" op_versions={len(program.op_version_map)}"
    lines = [DUMP_FORMAT_LINE, head]
    if all_attrs and program.op_version_map:
        lines += [f"  op_version {name}={v}" for name, v in sorted(program.op_version_map.items())]
    blocks = program.blocks if block is None else (program.block(block),)
    for b in blocks:
        lines += block_lines(b, all_attrs=all_attrs)
    return lines


def dump(program: Program, *, block: int | None = None, all_attrs: bool = False) -> str:
    """The text dump (ends with a newline)."""
    return "\n".join(dump_lines(program, block=block, all_attrs=all_attrs)) + "\n"


def op_context(block: Block, index: int, radius: int = 3) -> str:
    """The dump lines of ops `index - radius .. index + radius`, the faulty one marked `>>`."""
    ops = block.ops
    lines = []
    for i in range(max(0, index - radius), min(len(ops), index + radius + 1)):
        marker = ">> " if i == index else "   "
        lines.append(f"  {marker}{op_line(ops[i], i)}")
    return "\n".join(lines)


# -------------------------------------------------------------------------- JSON


def _json_value(attr: Attr) -> Any:
    def one(kind: AttrType, v: Any) -> Any:
        if kind == AttrType.FLOAT:
            v = float(format_float32(v)) if math.isfinite(v) else v
        if isinstance(v, float) and not math.isfinite(v):
            return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
        if isinstance(v, complex):
            return {"real": v.real, "imag": v.imag}
        return v

    from transpiler.ir.attrs import ELEMENT_TYPE

    if attr.type in ELEMENT_TYPE:
        return [one(ELEMENT_TYPE[attr.type], v) for v in attr.value]
    return one(attr.type, attr.value)


def var_json(var: Var) -> dict[str, Any]:
    out: dict[str, Any] = {"type": var.kind.name}
    if var.dtype is not None:
        out["dtype"] = var.dtype.name
        out["shape"] = list(var.shape or ())
    out["lod_level"] = var.lod_level
    for flag in ("persistable", "is_parameter", "stop_gradient", "need_check_feed"):
        out[flag] = getattr(var, flag)
    if var.reader:
        out["reader"] = [[d.name, list(s), lod] for d, s, lod in var.reader]
    if var.tuple_types:
        out["tuple"] = list(var.tuple_types)
    if var.attrs:
        out["attrs"] = {k: _json_value(a) for k, a in sorted(var.attrs.items())}
    return out


def op_json(op: Op, *, all_attrs: bool = False) -> dict[str, Any]:
    attrs = {k: a for k, a in sorted(op.attrs.items()) if all_attrs or k not in NOISE_ATTRS}
    out = {
        "type": op.type,
        "inputs": {k: list(v) for k, v in sorted(op.inputs.items())},
        "outputs": {k: list(v) for k, v in sorted(op.outputs.items())},
        "attrs": {k: _json_value(a) for k, a in attrs.items()},
        "attr_types": {k: a.type.name for k, a in attrs.items()},
    }
    if op.is_target:
        out["is_target"] = True
    return out


def dump_json(program: Program, *, block: int | None = None, all_attrs: bool = False) -> dict[str, Any]:
    """A JSON-ready dict; blocks look like `expected.json`'s (`ops`, `vars`) plus types."""
    blocks = program.blocks if block is None else (program.block(block),)
    return {
        "version": program.version,
        "op_version_map": None if program.op_version_map is None else dict(sorted(program.op_version_map.items())),
        "blocks": [
            {
                "idx": b.idx,
                "parent_idx": b.parent_idx,
                "forward_block_idx": b.forward_block_idx,
                "vars": {v.name: var_json(v) for v in sorted(b.vars.values(), key=lambda v: v.name)},
                "ops": [op_json(op, all_attrs=all_attrs) for op in b.ops],
            }
            for b in blocks
        ],
    }


def dump_json_text(program: Program, **kwargs) -> str:
    return json.dumps(dump_json(program, **kwargs), indent=1, ensure_ascii=False) + "\n"
