"""The program diff: structured summary, index-insensitive line diff, fallbacks."""

from __future__ import annotations

import difflib
import random

import pytest

from conftest import PADDLE_PROGRAMS
from proto import framework_pb2
from transpiler.ir import Attr, AttrType, Program, VarKind
from transpiler.ir.diff import diff_programs, unified_diff, wire_order_lines

BASIC = PADDLE_PROGRAMS / "fluid18_basic_sgd_2ps" / "main.pb"
PIECEWISE = PADDLE_PROGRAMS / "fluid18_lr_piecewise_2ps" / "main.pb"


def _load(path=BASIC) -> Program:
    return Program.load(path)


def test_identical_programs():
    result = diff_programs(_load(), _load(), names=("a.pb", "b.pb"))
    assert result.equal and result.text_diff == "" and result.render() == ""
    assert result.summary() == "a.pb and b.pb are identical\n"
    assert result.blocks == () and result.blocks_added == ()


def test_ops_added_and_removed_are_multisets_by_type():
    before, after = _load(), _load()
    block = after.global_block()
    sgds = [op for op in block.ops if op.type == "sgd"]
    for op in sgds:
        block.insert_after(op, "send", {"X": op.input("Grad")})
    block.remove_ops(sgds)
    block.add_op("send_barrier")
    result = diff_programs(before, after, names=("main.pb", "trainer.pb"))
    assert not result.equal
    (block_diff,) = result.blocks
    assert block_diff.idx == 0 and (block_diff.ops_before, block_diff.ops_after) == (13, 14)
    assert block_diff.ops_removed == (("sgd", 2),)
    assert block_diff.ops_added == (("send", 2), ("send_barrier", 1))
    summary = result.summary_lines()
    assert summary[:5] == [
        "--- main.pb",
        "+++ trainer.pb",
        "block 0: ops 13 -> 14",
        "  ops removed: sgd x2",
        "  ops added: send x2, send_barrier",
    ]


def test_vars_added_removed_and_changed():
    before, after = _load(), _load()
    block = after.global_block()
    block.var("fc_w").shape = (500, 1000)
    block.var("fc_b").persistable = False
    block.var("fc_b").dtype = block.var("fc_b").dtype.FP64
    block.var("x").lod_level = 1
    block.var("y").kind = VarKind.SELECTED_ROWS
    block.create_var("fc_w.block0", dtype="float32", shape=[500, 1000], persistable=True)
    block.remove_var("fc_b@GRAD")
    (d,) = diff_programs(before, after).blocks
    assert d.vars_added == ("fc_w.block0",)
    assert d.vars_removed == ("fc_b@GRAD",)
    assert [c.describe() for c in d.vars_changed] == [
        "fc_b: dtype fp32 -> fp64, persistable yes -> no",
        "fc_w: shape [1000, 1000] -> [500, 1000]",
        "x: lod 0 -> 1",
        "y: kind lod_tensor -> selected_rows",
    ]
    assert d.ops_added == d.ops_removed == ()
    summary = diff_programs(before, after).summary()
    assert "  vars removed: fc_b@GRAD\n" in summary
    assert "  vars added: fc_w.block0\n" in summary
    assert "  var changed: fc_w: shape [1000, 1000] -> [500, 1000]\n" in summary


def test_blocks_added_and_removed():
    before = _load()
    after = _load()
    sub = after.create_block(0)
    sub.add_op("sgd")
    sub.add_op("sgd")
    after.create_block(0)
    result = diff_programs(before, after)
    assert result.blocks_added == ((1, (("sgd", 2),)), (2, ()))
    assert "block 1: added (ops: sgd x2)" in result.summary_lines()
    assert "block 2: added (no ops)" in result.summary_lines()
    reverse = diff_programs(after, before)
    assert reverse.blocks_removed == ((1, (("sgd", 2),)), (2, ()))
    assert "block 1: removed (ops: sgd x2)" in reverse.summary_lines()


def test_version_and_parent_changes():
    before, after = _load(PIECEWISE), _load(PIECEWISE)
    after.version = 2006002
    after.block(3).parent_idx = 2
    result = diff_programs(before, after)
    lines = result.summary_lines()
    assert "version: 1008005 -> 2006002" in lines
    assert "block 3: ops 1 -> 1" in lines and "  parent: 0 -> 2" in lines


def test_line_diff_ignores_renumbering():
    before, after = _load(), _load()
    block = after.global_block()
    block.add_op("increment", {"X": "x"}, {"Out": "x"}, {"step": 1.0}, index=0)
    text = diff_programs(before, after, names=("a", "b")).text_diff
    changed = [line for line in text.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert changed == [
        "-block 0 parent=-1 vars=17 ops=13",
        "+block 0 parent=-1 vars=17 ops=14",
        "+  op 0 increment X=[x] -> Out=[x] {step=1.0}",
    ]
    # Context lines show the new numbering.
    assert "   op 1 mul X=[x] Y=[fc_w]" in text


def test_changed_op_in_place():
    before, after = _load(), _load()
    after.global_block().ops[1].set_attr("axis", 0)
    result = diff_programs(before, after)
    assert result.blocks == ()
    assert result.summary_lines()[-1].startswith("no op, var or block was added or removed")
    minus = [line for line in result.text_diff.splitlines() if line.startswith("-  op")]
    plus = [line for line in result.text_diff.splitlines() if line.startswith("+  op")]
    assert len(minus) == len(plus) == 1 and "axis=1" in minus[0] and "axis=0" in plus[0]


def test_render_and_summary_only():
    before, after = _load(), _load()
    after.global_block().remove_op(after.global_block().ops[-1])
    result = diff_programs(before, after, names=("a", "b"))
    full, short = result.render(), result.render(summary_only=True)
    assert full.startswith(short) and short == result.summary()
    assert full[len(short):].startswith("\n--- a\n+++ b\n@@ ")


def test_attr_type_only_difference_falls_back_to_json():
    before, after = _load(), _load()
    op = after.global_block().ops[1]
    op.set_attr("axis", op.attr("axis"), AttrType.LONG)  # same value, other wire type
    result = diff_programs(before, after)
    assert not result.equal and result.text_diff == ""
    assert result.detail_kind == "json"
    assert '-      "axis": "INT",' in result.detail_diff and '+      "axis": "LONG",' in result.detail_diff
    assert "the text dumps are equal but the bytes differ" in result.summary()
    assert result.render().endswith(result.detail_diff)


def test_noise_attr_difference_shows_with_all_attrs_or_in_the_json_fallback():
    before, after = _load(), _load()
    after.global_block().ops[0].set_attr("op_callstack", ["elsewhere.py:1"], AttrType.STRINGS)
    hidden = diff_programs(before, after)
    assert hidden.text_diff == "" and hidden.detail_kind == "json" and "elsewhere.py:1" in hidden.detail_diff
    shown = diff_programs(before, after, all_attrs=True)
    assert "elsewhere.py:1" in shown.text_diff and shown.detail_kind == ""


def test_wire_order_difference():
    before, after = _load(), _load()
    op = after.global_block().ops[0]
    attrs = list(op.attrs.items())
    for name, _attr in attrs:
        op.remove_attr(name)
    for name, attr in reversed(attrs):
        op.set_attr(name, attr)
    result = diff_programs(before, after)
    assert result.detail_kind == "order"
    assert "wire order" in result.summary()
    assert result.detail_diff.count("\n-  op 0 mul") == 1 and result.detail_diff.count("\n+  op 0 mul") == 1
    assert wire_order_lines(before)[1].startswith("  op 0 mul inputs: X Y | outputs: Out | attrs: ")


def test_encoding_only_difference():
    data = BASIC.read_bytes()
    message = framework_pb2.ProgramDesc.FromString(data)
    message.blocks[0].ops[0].is_target = False  # an optional field now present at its default
    other = message.SerializeToString()
    assert other != data
    result = diff_programs(Program.from_bytes(data), Program.from_bytes(other))
    assert not result.equal and result.detail_kind == "encoding" and result.detail_diff == ""
    assert result.summary_lines()[2:] == [
        "the programs differ only in encoding (optional fields written at their default value); "
        "dumps, attr types and wire order are all equal"
    ]
    assert result.render().startswith("--- a\n+++ b\n")


@pytest.mark.parametrize("seed", range(20))
def test_unified_diff_matches_difflib_without_op_alignment(seed):
    rng = random.Random(seed)
    a = [f"line {rng.randrange(8)}" for _ in range(rng.randrange(0, 30))]
    b = list(a)
    for _ in range(rng.randrange(1, 5)):
        where = rng.randrange(len(b) + 1)
        if rng.random() < 0.5 and b:
            del b[min(where, len(b) - 1)]
        else:
            b.insert(where, f"new {rng.randrange(100)}")
    expected = "".join(
        line if line.endswith("\n") else line + "\n"
        for line in difflib.unified_diff(a, b, "a", "b", lineterm="")
    )
    ours = unified_diff(a, b, ("a", "b"), align_ops=False)
    assert ours == expected


def test_unified_diff_of_equal_lines_is_empty():
    assert unified_diff(["x"], ["x"]) == ""
    assert unified_diff(["  op 0 a ->"], ["  op 0 a ->"]) == ""


def test_bytes_equal_programs_with_different_objects():
    before = _load()
    after = before.clone()
    op = after.global_block().ops[0]
    op.set_attr("x_num_col_dims", Attr.of(op.attr("x_num_col_dims"), AttrType.INT))
    assert diff_programs(before, after).equal
