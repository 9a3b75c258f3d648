"""Ops that carry an attr twice (issue 12): Paddle 2.6 writes them (`reshape2` with
`use_mkldnn`, `mkldnn_data_type`, `use_quantizer` twice) and reads them back keeping the
last value. They load, save byte-identically, read as Paddle reads them, lose their stale
entries when set, and the verifier warns (once per program) but never refuses."""

from __future__ import annotations

from proto import framework_pb2
from transpiler.cli import main
from transpiler.ir import Program
from transpiler.ir.printer import dump
from transpiler.ir.verifier import check, check_warnings, verify


def _with_repeats() -> bytes:
    """x -> reshape2 -> y, then the wire entries Paddle 2.6 adds: two names written again with
    other values, and `use_quantizer` written twice with the same value."""
    program = Program.empty()
    block = program.global_block()
    block.create_var("x", dtype="float32", shape=[-1, 8])
    block.create_var("y", dtype="float32", shape=[-1, 2, 4])
    block.create_var("x_shape", dtype="float32", shape=[0, -1, 8])
    block.add_op("reshape2", {"X": "x"}, {"Out": "y", "XShape": "x_shape"},
                 {"shape": [-1, 2, 4], "use_mkldnn": False, "mkldnn_data_type": "float32", "use_quantizer": False,
                  "op_role": 0})
    message = framework_pb2.ProgramDesc.FromString(program.to_bytes())
    op = message.blocks[0].ops[0]
    for name, field, value in (("use_mkldnn", "b", True), ("mkldnn_data_type", "s", "bfloat16"),
                               ("use_quantizer", "b", False)):
        entry = op.attrs.add()
        entry.CopyFrom(next(a for a in op.attrs if a.name == name))
        setattr(entry, field, value)
    return message.SerializeToString()


def _wire_names(program: Program) -> list[str]:
    message = framework_pb2.ProgramDesc.FromString(program.to_bytes())
    return [a.name for a in message.blocks[0].ops[0].attrs]


def test_the_fixture_really_repeats_attrs():
    names = [a.name for a in framework_pb2.ProgramDesc.FromString(_with_repeats()).blocks[0].ops[0].attrs]
    assert names == ["shape", "use_mkldnn", "mkldnn_data_type", "use_quantizer", "op_role",
                     "use_mkldnn", "mkldnn_data_type", "use_quantizer"]


def test_load_save_is_byte_identical_and_clone_too():
    data = _with_repeats()
    program = Program.from_bytes(data)
    assert program.to_bytes() == data
    assert program.clone().to_bytes() == data
    assert Program.from_bytes(program.to_bytes()).to_bytes() == data


def test_the_last_value_wins_at_the_first_place():
    op = Program.from_bytes(_with_repeats()).global_block().ops[0]
    assert op.attr("use_mkldnn") is True
    assert op.attr("mkldnn_data_type") == "bfloat16"
    assert list(op.attrs) == ["shape", "use_mkldnn", "mkldnn_data_type", "use_quantizer", "op_role"]
    assert op.repeated_attrs() == {"use_mkldnn": 2, "mkldnn_data_type": 2, "use_quantizer": 2}
    line = next(line for line in dump(Program.from_bytes(_with_repeats())).splitlines() if "reshape2" in line)
    assert 'mkldnn_data_type="bfloat16"' in line and "use_mkldnn=true" in line and "float32" not in line


def test_setting_or_removing_an_attr_drops_its_stale_entries_only():
    program = Program.from_bytes(_with_repeats())
    op = program.global_block().ops[0]
    op.set_attr("use_mkldnn", False)
    assert _wire_names(program) == ["shape", "use_mkldnn", "mkldnn_data_type", "use_quantizer", "op_role",
                                    "mkldnn_data_type", "use_quantizer"]
    assert Program.from_bytes(program.to_bytes()).global_block().ops[0].attr("use_mkldnn") is False
    op.remove_attr("mkldnn_data_type")
    assert op.repeated_attrs() == {"use_quantizer": 2}
    op.set_attr("use_quantizer", True)
    assert op.repeated_attrs() == {}
    assert _wire_names(program) == ["shape", "use_mkldnn", "use_quantizer", "op_role"]
    reloaded = Program.from_bytes(program.to_bytes()).global_block().ops[0]
    assert reloaded.attr_values() == {"shape": (-1, 2, 4), "use_mkldnn": False, "use_quantizer": True, "op_role": 0}


def test_a_clone_given_attrs_drops_their_stale_entries_as_set_attr_does():
    program = Program.from_bytes(_with_repeats())
    block = program.global_block()
    op = block.ops[0]
    twin = op.clone(attrs={"use_mkldnn": False, "axis": 1})
    block.remove_op(op)
    op.set_attr("use_mkldnn", False)
    op.set_attr("axis", 1)
    block.add_op(op)
    expected = program.to_bytes()
    block.remove_op(op)
    block.add_op(twin)
    assert program.to_bytes() == expected
    assert twin.repeated_attrs() == {"mkldnn_data_type": 2, "use_quantizer": 2}


def test_a_new_attr_on_such_an_op_is_written_once_after_the_others():
    program = Program.from_bytes(_with_repeats())
    program.global_block().ops[0].set_attr("axis", 1)
    assert _wire_names(program)[-4:] == ["use_mkldnn", "mkldnn_data_type", "use_quantizer", "axis"]
    assert Program.from_bytes(program.to_bytes()).global_block().ops[0].attr("axis") == 1


def test_the_verifier_warns_once_and_does_not_refuse():
    program = Program.from_bytes(_with_repeats())
    verify(program, name="main.pb")
    assert check(program, name="main.pb") == []
    assert check_warnings(program, name="main.pb") == [
        "main.pb: 1 of 1 ops repeat attrs (mkldnn_data_type (1 op), use_mkldnn (1 op), use_quantizer (1 op)); "
        "the last value of each is used, as in Paddle"
    ]
    program.global_block().ops[0].set_attr("use_mkldnn", True)
    program.global_block().ops[0].set_attr("mkldnn_data_type", "bfloat16")
    program.global_block().ops[0].set_attr("use_quantizer", False)
    assert check_warnings(program) == []


def test_cli_dump_exits_0_with_one_warning_line(tmp_path, capsys):
    path = tmp_path / "main.pb"
    path.write_bytes(_with_repeats())
    assert main(["dump", str(path), "--full"]) == 0  # the whole warning, however long tmp_path is
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"pstranspile: warning: {check_warnings(Program.load(path), name=str(path))[0]}"]
    assert 'mkldnn_data_type="bfloat16"' in out
