"""The text and JSON dumps: golden files per fixture, float formatting, noise attrs.

`python3 -m pytest tests/test_ir_printer.py --update-golden` rewrites tests/golden/dump/;
review that diff like code.
"""

from __future__ import annotations

import json
import math

import pytest

from conftest import PADDLE_PB_FILES, PADDLE_PROGRAMS
from transpiler.ir import Attr, AttrType, Program, VarKind
from transpiler.ir.printer import (
    DUMP_FORMAT_LINE,
    NOISE_ATTRS,
    dump,
    dump_json,
    dump_json_text,
    format_attr,
    format_float32,
    op_context,
    op_line,
    var_line,
)

PB_IDS = [f"{p.parent.name}.{p.stem}" for p in PADDLE_PB_FILES]


@pytest.mark.parametrize("path", PADDLE_PB_FILES, ids=PB_IDS)
def test_dump_golden(path, golden):
    golden.check(f"dump/{path.parent.name}.{path.stem}.txt", dump(Program.load(path)))


def test_json_dump_golden(golden):
    # The piecewise-decay program: sub-blocks and BLOCK attrs, the richest fixture.
    program = Program.load(PADDLE_PROGRAMS / "fluid18_lr_piecewise_2ps" / "main.pb")
    golden.check("dump/fluid18_lr_piecewise_2ps.main.json", dump_json_text(program))


@pytest.mark.parametrize("path", PADDLE_PB_FILES, ids=PB_IDS)
def test_dump_is_stable_across_round_trip_and_clone(path):
    program = Program.load(path)
    text = dump(program)
    assert dump(Program.from_bytes(program.to_bytes())) == text
    assert dump(program.clone()) == text
    assert text.startswith(DUMP_FORMAT_LINE + "\n") and text.endswith("\n")


@pytest.mark.parametrize("path", PADDLE_PB_FILES, ids=PB_IDS)
def test_one_line_per_var_and_op(path):
    program = Program.load(path)
    lines = dump(program).splitlines()
    assert sum(1 for line in lines if line.startswith("  op ")) == program.num_ops()
    assert sum(1 for line in lines if line.startswith("  var ")) == sum(len(b.vars) for b in program.blocks)
    assert sum(1 for line in lines if line.startswith("block ")) == program.num_blocks


def test_noise_attrs_are_hidden_by_default_and_shown_on_request():
    program = Program.load(PADDLE_PROGRAMS / "mlp_adam_2ps" / "main.pb")
    assert any(op.has_attr("op_callstack") for _b, op in program.all_ops())
    plain, full = dump(program), dump(program, all_attrs=True)
    for noise in NOISE_ATTRS:
        assert f"{noise}=" not in plain
        assert f"{noise}=" in full
    assert "op_versions=68" in plain.splitlines()[1]
    assert "  op_version " not in plain
    assert "\n  op_version affine_grid=1\n" in full
    as_json = dump_json(program)
    assert not any(noise in op["attrs"] for op in as_json["blocks"][0]["ops"] for noise in NOISE_ATTRS)
    assert all("op_callstack" in op["attrs"] for op in dump_json(program, all_attrs=True)["blocks"][0]["ops"])


def test_callstack_paths_are_relative_in_the_fixture():
    """The fixtures' README promises relative paths; an absolute path would leak a machine."""
    program = Program.load(PADDLE_PROGRAMS / "mlp_adam_2ps" / "main.pb")
    text = dump(program, all_attrs=True)
    assert "/home/" not in text and "/root/" not in text


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.1, "0.1"), (1.0, "1.0"), (0.0, "0.0"), (-0.007745347, "-0.007745347"), (1e-8, "1e-08"),
     (3.4028234663852886e38, "3.4028235e+38"), (2**24 + 1.0, "1.6777216e+07"), (math.inf, "inf"), (math.nan, "nan")],
)
def test_format_float32(value, text):
    assert format_float32(value) == text


def test_float32_attr_is_printed_shortest_after_a_round_trip():
    program = Program.empty()
    program.global_block().add_op("scale", attrs={"scale": 0.1, "f64": Attr.of(0.1, AttrType.FLOAT64)})
    again = Program.from_bytes(program.to_bytes())
    line = dump(again).splitlines()[-1]
    assert "scale=0.1" in line and "0.100000001" not in line
    assert "f64=0.1" in line


def test_every_attr_type_has_a_text_form():
    cases = {
        AttrType.INT: (-3, "-3"),
        AttrType.FLOAT: (0.5, "0.5"),
        AttrType.STRING: ('a "q"\n', '"a \\"q\\"\\n"'),
        AttrType.INTS: ([1, 2], "[1, 2]"),
        AttrType.FLOATS: ([0.1], "[0.1]"),
        AttrType.STRINGS: (["x", "é"], '["x", "é"]'),
        AttrType.BOOLEAN: (False, "false"),
        AttrType.BOOLEANS: ([True, False], "[true, false]"),
        AttrType.BLOCK: (2, "block[2]"),
        AttrType.LONG: (2**40, "1099511627776"),
        AttrType.BLOCKS: ([1, 2], "[block[1], block[2]]"),
        AttrType.LONGS: ([-1], "[-1]"),
        AttrType.FLOAT64S: ([0.1], "[0.1]"),
        AttrType.VAR: ("w", "var(w)"),
        AttrType.VARS: (["w", "b"], "[var(w), var(b)]"),
        AttrType.FLOAT64: (1e-300, "1e-300"),
        AttrType.SCALAR: (True, "scalar(true)"),
        AttrType.SCALARS: ([1, 2.5, 1j], "[scalar(1), scalar(2.5), scalar(1j)]"),
    }
    assert set(cases) == set(AttrType)
    for attr_type, (value, text) in cases.items():
        assert format_attr(Attr.of(value, attr_type)) == text, attr_type.name


def test_op_role_is_printed_by_name():
    assert format_attr(Attr.of(257), "op_role") == "backward|loss"
    assert format_attr(Attr.of(256), "op_role") == "forward|loss"
    assert format_attr(Attr.of(0), "op_role") == "forward"
    assert format_attr(Attr.of(18), "op_role") == "optimize|lrsched"
    assert format_attr(Attr.of(257), "other") == "257"


def test_op_line_sorts_slots_and_attrs():
    program = Program.empty()
    op = program.global_block().add_op(
        "sgd",
        {"Param": "w", "Grad": "g", "LearningRate": "lr"},
        {"ParamOut": "w"},
        {"op_role": 2, "b": 1, "a": "x", "op_callstack": ["f"]},
    )
    assert op_line(op, 4) == (
        'op 4 sgd Grad=[g] LearningRate=[lr] Param=[w] -> ParamOut=[w] {a="x", b=1, op_role=optimize}'
    )
    assert 'op_callstack=["f"]' in op_line(op, 4, all_attrs=True)
    bare = program.global_block().add_op("noop")
    bare.is_target = True
    assert op_line(bare, 0) == "op 0 noop -> {} target"


def test_var_line_fields():
    block = Program.empty().global_block()
    var = block.create_var(
        "w", dtype="float32", shape=[-1, 8], lod_level=1, persistable=True, is_parameter=True,
        stop_gradient=True, need_check_feed=True,
    )
    assert var_line(var) == "var w lod_tensor fp32 [-1, 8] lod=1 persistable param stop_gradient need_check_feed"
    feed = block.create_var("feed", VarKind.FEED_MINIBATCH, persistable=True)
    assert var_line(feed) == "var feed feed_minibatch persistable"
    assert var_line(block.create_var("s", dtype="int64", shape=[])) == "var s lod_tensor int64 []"
    rows = block.create_var("rows", VarKind.SELECTED_ROWS, dtype="float32", shape=[100, 16])
    assert var_line(rows) == "var rows selected_rows fp32 [100, 16]"


def test_dump_of_one_block_and_forward_block():
    program = Program.load(PADDLE_PROGRAMS / "fluid18_lr_piecewise_2ps" / "main.pb")
    text = dump(program, block=2)
    lines = text.splitlines()
    assert lines[:3] == [DUMP_FORMAT_LINE, "program version=1008005 blocks=4", "block 2 parent=0 vars=0 ops=1"]
    assert len(lines) == 4
    program.block(2).forward_block_idx = 1
    assert "block 2 parent=0 vars=0 ops=1 forward_block=1" in dump(program)


def test_json_dump_carries_attr_types_and_is_valid_json():
    program = Program.load(PADDLE_PROGRAMS / "fluid18_lr_piecewise_2ps" / "main.pb")
    data = json.loads(dump_json_text(program))
    assert [b["idx"] for b in data["blocks"]] == [0, 1, 2, 3]
    cond = next(op for op in data["blocks"][0]["ops"] if op["type"] == "conditional_block")
    assert cond["attr_types"]["sub_block"] == "BLOCK" and cond["attrs"]["sub_block"] == 1
    assert data["blocks"][0]["vars"]["fc_w"] == {
        "type": "LOD_TENSOR", "dtype": "FP32", "shape": [1000, 1000], "lod_level": 0,
        "persistable": True, "is_parameter": False, "stop_gradient": False, "need_check_feed": False,
    }


def test_json_encodes_non_finite_floats_and_complex_as_strict_json():
    program = Program.empty()
    program.global_block().add_op("x", attrs={"n": math.nan, "i": [math.inf, -math.inf], "c": 1 + 2j})
    text = dump_json_text(program)
    attrs = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    attrs = attrs["blocks"][0]["ops"][0]["attrs"]
    assert attrs == {"c": {"real": 1.0, "imag": 2.0}, "i": ["Infinity", "-Infinity"], "n": "NaN"}


def test_op_context_marks_the_op():
    program = Program.load(PADDLE_PROGRAMS / "fluid18_basic_sgd_2ps" / "main.pb")
    lines = op_context(program.global_block(), 6, radius=1).splitlines()
    assert [line[:5] for line in lines] == ["     ", "  >> ", "     "]
    assert lines[1].startswith("  >> op 6 ")
