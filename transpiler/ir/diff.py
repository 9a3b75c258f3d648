"""What changed between two programs: a structured summary, then a unified diff of the dumps.

A transpiler is reviewed by what it did to a program, so `pstranspile diff` answers in
that order: per block, which op types were added or removed (as multisets: two `sgd`
gone and one `send` added, not "29 ops vs 28"), which vars came, went or changed
(kind, dtype, shape, lod level, flags), which blocks appeared; then the line diff.

The line diff ignores the op index at the start of each op line when it lines the two
dumps up, so inserting one op at the top of a block shows as one added line, not as
every later op renumbered; the lines printed still carry their own indices.

Two programs are equal when their bytes are. When the text dumps agree but the bytes
do not, the cause is one the text dump leaves out on purpose, and the diff falls back,
in order, to the typed JSON dumps with every attr (attr types such as INT vs LONG,
callstacks), then to the wire order of vars, slots and attrs, and says so.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from transpiler.ir.printer import dump_json_text, dump_lines
from transpiler.ir.program import Block, Program, Var

CONTEXT_LINES = 3

# `  op 12 mul ...` -> `  op mul ...`: the alignment key of a dump line.
_OP_INDEX = re.compile(r"^(\s*op) \d+ ")

# The var fields the summary compares, with the word it prints for each.
_VAR_FIELDS = (
    ("kind", "kind"),
    ("dtype", "dtype"),
    ("shape", "shape"),
    ("lod_level", "lod"),
    ("persistable", "persistable"),
    ("is_parameter", "param"),
    ("stop_gradient", "stop_gradient"),
    ("need_check_feed", "need_check_feed"),
)


@dataclass(frozen=True)
class VarChange:
    """One var declared on both sides whose declaration differs."""

    name: str
    changes: tuple[tuple[str, str, str], ...]  # (field word, before, after)

    def describe(self) -> str:
        return f"{self.name}: " + ", ".join(f"{word} {a} -> {b}" for word, a, b in self.changes)


@dataclass(frozen=True)
class BlockDiff:
    """Differences of one block present on both sides (`idx` is its index)."""

    idx: int
    ops_before: int
    ops_after: int
    ops_added: tuple[tuple[str, int], ...]  # (op type, count), sorted by type
    ops_removed: tuple[tuple[str, int], ...]
    vars_added: tuple[str, ...]
    vars_removed: tuple[str, ...]
    vars_changed: tuple[VarChange, ...]
    parent_change: tuple[int, int] | None = None

    @property
    def empty(self) -> bool:
        return not (
            self.ops_added
            or self.ops_removed
            or self.vars_added
            or self.vars_removed
            or self.vars_changed
            or self.parent_change
            or self.ops_before != self.ops_after
        )


@dataclass(frozen=True)
class ProgramDiff:
    """The whole comparison; `equal` is byte equality of the two programs."""

    names: tuple[str, str]
    equal: bool
    blocks: tuple[BlockDiff, ...]
    blocks_added: tuple[tuple[int, tuple[tuple[str, int], ...]], ...]  # (idx, op type counts)
    blocks_removed: tuple[tuple[int, tuple[tuple[str, int], ...]], ...]
    version_change: tuple[str, str] | None
    text_diff: str  # unified diff of the text dumps ("" when they are equal)
    detail_diff: str = ""  # when the text dumps are equal but the bytes are not
    detail_kind: str = ""  # "json", "order" or "encoding": what `detail_diff` compares
    notes: tuple[str, ...] = field(default=())

    def summary_lines(self) -> list[str]:
        return list(_summary_lines(self))

    def summary(self) -> str:
        return "".join(line + "\n" for line in self.summary_lines())

    def render(self, *, summary_only: bool = False) -> str:
        """The text `pstranspile diff` prints: summary, a blank line, the unified diff."""
        if self.equal:
            return ""
        out = self.summary()
        body = self.text_diff or self.detail_diff
        if body and not summary_only:
            out += "\n" + body
        return out


# --------------------------------------------------------------------- compare


def diff_programs(
    a: Program,
    b: Program,
    *,
    names: tuple[str, str] = ("a", "b"),
    all_attrs: bool = False,
    context: int = CONTEXT_LINES,
) -> ProgramDiff:
    """Compare `a` (before) with `b` (after)."""
    equal = a.to_bytes() == b.to_bytes()
    common = min(a.num_blocks, b.num_blocks)
    blocks = tuple(
        d for d in (_block_diff(a.blocks[i], b.blocks[i]) for i in range(common)) if not d.empty
    )
    added = tuple((blk.idx, _op_counts(blk)) for blk in b.blocks[common:])
    removed = tuple((blk.idx, _op_counts(blk)) for blk in a.blocks[common:])
    version_change = None
    if a.version != b.version:
        version_change = (str(a.version), str(b.version))

    lines_a = dump_lines(a, all_attrs=all_attrs)
    lines_b = dump_lines(b, all_attrs=all_attrs)
    text_diff = "" if lines_a == lines_b else unified_diff(lines_a, lines_b, names, context=context)
    detail_diff, detail_kind, notes = "", "", []
    if not equal and not text_diff:
        detail_kind, detail_diff = _detail(a, b, names, context)
        notes.append(_DETAIL_NOTE[detail_kind])
    return ProgramDiff(
        names=names,
        equal=equal,
        blocks=blocks,
        blocks_added=added,
        blocks_removed=removed,
        version_change=version_change,
        text_diff=text_diff,
        detail_diff=detail_diff,
        detail_kind=detail_kind,
        notes=tuple(notes),
    )


_DETAIL_NOTE = {
    "json": "the text dumps are equal but the bytes differ; the typed JSON dumps (every attr, with its type) follow",
    "order": "the text dumps and JSON dumps are equal but the bytes differ; "
    "the wire order of vars, slots and attrs differs, as follows",
    "encoding": "the programs differ only in encoding (optional fields written at their default value); "
    "dumps, attr types and wire order are all equal",
}


def _detail(a: Program, b: Program, names: tuple[str, str], context: int) -> tuple[str, str]:
    json_a = dump_json_text(a, all_attrs=True).splitlines()
    json_b = dump_json_text(b, all_attrs=True).splitlines()
    if json_a != json_b:
        return "json", unified_diff(json_a, json_b, names, context=context, align_ops=False)
    order_a, order_b = wire_order_lines(a), wire_order_lines(b)
    if order_a != order_b:
        return "order", unified_diff(order_a, order_b, names, context=context, align_ops=False)
    return "encoding", ""


def wire_order_lines(program: Program) -> list[str]:
    """Vars, slots and attrs in the order they are stored (the dump sorts them)."""
    lines = []
    for block in program.blocks:
        lines.append(f"block {block.idx} vars: " + " ".join(block.vars))
        for index, op in enumerate(block.ops):
            lines.append(
                f"  op {index} {op.type} inputs: {' '.join(op.inputs)} | outputs: {' '.join(op.outputs)}"
                f" | attrs: {' '.join(op.attrs)}"
            )
    return lines


def _op_counts(block: Block) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(Counter(op.type for op in block.ops).items()))


def _block_diff(a: Block, b: Block) -> BlockDiff:
    types_a = Counter(op.type for op in a.ops)
    types_b = Counter(op.type for op in b.ops)
    vars_a, vars_b = a.vars, b.vars
    changed = []
    for name, var in vars_a.items():
        other = vars_b.get(name)
        if other is not None:
            change = _var_change(var, other)
            if change is not None:
                changed.append(change)
    parent = (a.parent_idx, b.parent_idx) if a.parent_idx != b.parent_idx else None
    return BlockDiff(
        idx=b.idx,
        ops_before=len(a),
        ops_after=len(b),
        ops_added=tuple(sorted((types_b - types_a).items())),
        ops_removed=tuple(sorted((types_a - types_b).items())),
        vars_added=tuple(sorted(n for n in vars_b if n not in vars_a)),
        vars_removed=tuple(sorted(n for n in vars_a if n not in vars_b)),
        vars_changed=tuple(sorted(changed, key=lambda c: c.name)),
        parent_change=parent,
    )


def _var_change(a: Var, b: Var) -> VarChange | None:
    changes = []
    for attr, word in _VAR_FIELDS:
        x, y = getattr(a, attr), getattr(b, attr)
        if x != y:
            changes.append((word, _field_text(x), _field_text(y)))
    return VarChange(a.name, tuple(changes)) if changes else None


def _field_text(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    short = getattr(value, "short", None)  # DType
    if isinstance(short, str):
        return short
    name = getattr(value, "name", None)  # VarKind
    if isinstance(name, str):
        return name.lower()
    return str(value)


# --------------------------------------------------------------------- summary


def _counts_text(counts: Sequence[tuple[str, int]]) -> str:
    return ", ".join(f"{t} x{n}" if n > 1 else t for t, n in counts)


def _summary_lines(d: ProgramDiff) -> Iterator[str]:
    name_a, name_b = d.names
    if d.equal:
        yield f"{name_a} and {name_b} are identical"
        return
    yield f"--- {name_a}"
    yield f"+++ {name_b}"
    if d.version_change:
        yield f"version: {d.version_change[0]} -> {d.version_change[1]}"
    for idx, counts in d.blocks_added:
        yield f"block {idx}: added" + (f" (ops: {_counts_text(counts)})" if counts else " (no ops)")
    for idx, counts in d.blocks_removed:
        yield f"block {idx}: removed" + (f" (ops: {_counts_text(counts)})" if counts else " (no ops)")
    for block in d.blocks:
        yield f"block {block.idx}: ops {block.ops_before} -> {block.ops_after}"
        if block.parent_change:
            yield f"  parent: {block.parent_change[0]} -> {block.parent_change[1]}"
        if block.ops_removed:
            yield f"  ops removed: {_counts_text(block.ops_removed)}"
        if block.ops_added:
            yield f"  ops added: {_counts_text(block.ops_added)}"
        if block.vars_removed:
            yield f"  vars removed: {', '.join(block.vars_removed)}"
        if block.vars_added:
            yield f"  vars added: {', '.join(block.vars_added)}"
        for change in block.vars_changed:
            yield f"  var changed: {change.describe()}"
    if d.text_diff and not (d.blocks or d.blocks_added or d.blocks_removed or d.version_change):
        yield "no op, var or block was added or removed; ops differ in place (slots or attrs)"
    yield from d.notes


# ------------------------------------------------------------------ line diff


def unified_diff(
    a: Sequence[str],
    b: Sequence[str],
    names: tuple[str, str] = ("a", "b"),
    *,
    context: int = CONTEXT_LINES,
    align_ops: bool = True,
) -> str:
    """`diff -u` of two line lists. With `align_ops`, op lines are matched without their
    index, so renumbering alone never makes a line differ."""
    if align_ops:
        keys_a = [_OP_INDEX.sub(r"\1 ", line) for line in a]
        keys_b = [_OP_INDEX.sub(r"\1 ", line) for line in b]
    else:
        keys_a, keys_b = list(a), list(b)
    matcher = difflib.SequenceMatcher(None, keys_a, keys_b, autojunk=False)
    out = [f"--- {names[0]}\n", f"+++ {names[1]}\n"]
    hunks = 0
    for group in matcher.get_grouped_opcodes(context):
        hunks += 1
        first, last = group[0], group[-1]
        out.append(f"@@ -{_range(first[1], last[2])} +{_range(first[3], last[4])} @@\n")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                # Same line modulo the op index: show the new side, which is what the user has now.
                out.extend(f" {line}\n" for line in b[j1:j2])
                continue
            if tag in ("replace", "delete"):
                out.extend(f"-{line}\n" for line in a[i1:i2])
            if tag in ("replace", "insert"):
                out.extend(f"+{line}\n" for line in b[j1:j2])
    if hunks == 0:
        return ""
    return "".join(out)


def _range(start: int, stop: int) -> str:
    """difflib's unified range format: 1-based start, length omitted when 1."""
    length = stop - start
    begin = start + 1
    if length == 1:
        return str(begin)
    if length == 0:
        begin -= 1
    return f"{begin},{length}"
