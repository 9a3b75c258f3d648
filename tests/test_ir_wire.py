"""The fast reader and writer (`transpiler.ir.wire`) agree with protobuf's: on every
fixture the reader decodes the program itself (no fallback) to the same IR, and on mutated
bytes it either gives up (and the protobuf path decides) or gives exactly what the protobuf
path gives; the writer writes the bytes protobuf writes, for fixtures, transpiled programs
and every attr type with its edge values.
"""

from __future__ import annotations

import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import PADDLE_PB_FILES, PADDLE_PROGRAMS
from proto import framework_pb2
from test_ir_fuzz import MUTATED_BYTES, mutate, mutation
from transpiler.errors import IRError, ProgramFormatError
from transpiler.ir import Attr, AttrType, Program, VarKind
from transpiler.ir.printer import dump
from transpiler.ir.serde import (
    _WRITER,
    UnknownFieldsWarning,
    _program_via_protobuf,
    fast_program_from_bytes,
    program_to_message,
)

FIXTURES = {f"{p.parent.name}/{p.name}": p.read_bytes() for p in PADDLE_PB_FILES}


def _same_program(a: Program, b: Program) -> None:
    assert a.to_bytes() == b.to_bytes()
    assert dump(a, all_attrs=True) == dump(b, all_attrs=True)
    for (_, op_a), (_, op_b) in zip(a.all_ops(), b.all_ops(), strict=True):
        assert op_a.repeated_attrs() == op_b.repeated_attrs()
        assert op_a._explicit == op_b._explicit
    for block_a, block_b in zip(a.blocks, b.blocks, strict=True):
        assert block_a._explicit == block_b._explicit
        for var_a, var_b in zip(block_a.vars.values(), block_b.vars.values(), strict=True):
            assert var_a._explicit == var_b._explicit
            assert repr(var_a) == repr(var_b)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_the_fast_reader_takes_every_fixture_and_agrees_with_protobuf(name):
    data = FIXTURES[name]
    fast = fast_program_from_bytes(data)
    assert fast is not None, "a Paddle-written program fell back to the slow reader"
    assert fast.to_bytes() == data
    _same_program(fast, _program_via_protobuf(data, name))


@MUTATED_BYTES
@given(name=st.sampled_from(sorted(FIXTURES)), mutations=st.lists(mutation, min_size=1, max_size=3))
def test_on_mutated_bytes_the_fast_reader_gives_up_or_agrees(name, mutations):
    data = mutate(FIXTURES[name], mutations)
    fast = fast_program_from_bytes(data)
    if fast is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownFieldsWarning)  # the fast reader must not drop fields silently
        try:
            slow = _program_via_protobuf(data, "mutated")
        except (ProgramFormatError, IRError) as exc:
            pytest.fail(f"the fast reader accepted bytes the protobuf path refuses: {exc}")
    _same_program(fast, slow)


def _small_program() -> Program:
    program = Program.empty()
    block = program.global_block()
    block.create_var("x", dtype="float32", shape=[-1, 3])
    block.create_var("y", dtype="float32", shape=[-1, 3])
    block.add_op("relu", {"X": ["x"]}, {"Out": ["y"]}, {"op_role": 0, "axis": Attr.of(-1, AttrType.INT)})
    return program


def test_unknown_fields_fall_back_and_still_warn():
    message = framework_pb2.ProgramDesc.FromString(_small_program().to_bytes())
    data = message.SerializeToString() + b"\x98\x06\x01"  # field 99, varint 1: not in the schema
    assert fast_program_from_bytes(data) is None
    with pytest.warns(UnknownFieldsWarning):
        program = Program.from_bytes(data)
    assert program.global_block().ops[0].attr("axis") == -1


def test_packed_dims_read_as_protobuf_reads_them():
    """proto2 writes `dims` unpacked; a packed encoding is valid protobuf too (a var's type
    is decoded by protobuf, once per distinct type)."""
    data = _small_program().to_bytes()
    unpacked_dims = b"\x10\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01\x10\x03"  # dims: -1, 3
    assert data.count(unpacked_dims) == 2
    packed = b"\x12\x0b\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01\x03"
    assert len(packed) == len(unpacked_dims)  # same size: the enclosing lengths stay right
    mutated = data.replace(unpacked_dims, packed)
    fast = fast_program_from_bytes(mutated)
    assert fast is not None and fast.global_block().var("x").shape == (-1, 3)
    _same_program(fast, _program_via_protobuf(mutated, "packed"))


def test_repeated_attrs_keep_the_last_value_and_save_as_they_came():
    message = framework_pb2.ProgramDesc.FromString(_small_program().to_bytes())
    op = message.blocks[0].ops[0]
    again = op.attrs.add()
    again.name, again.type, again.i = "axis", framework_pb2.INT, 7
    data = message.SerializeToString()
    fast = fast_program_from_bytes(data)
    assert fast is not None
    loaded = fast.global_block().ops[0]
    assert loaded.attr("axis") == 7
    assert loaded.repeated_attrs() == {"axis": 2}
    assert fast.to_bytes() == data
    loaded.set_attr("axis", 3)
    assert loaded.repeated_attrs() == {}
    assert Program.from_bytes(fast.to_bytes()).global_block().ops[0].attr("axis") == 3


def test_loaded_programs_are_independent_though_attrs_are_shared():
    """Two loads of the same bytes share decoded attrs (immutable); editing one program's
    op must not show in the other."""
    data = _small_program().to_bytes()
    first, second = Program.from_bytes(data), Program.from_bytes(data)
    first.global_block().ops[0].set_attr("axis", 2)
    first.global_block().var("x").attrs["k"] = Attr.of(1, AttrType.INT)
    assert second.global_block().ops[0].attr("axis") == -1
    assert second.global_block().var("x").attrs == {}
    assert Program.from_bytes(data).global_block().ops[0].attr("axis") == -1


# ------------------------------------------------------------------ the fast writer


def _protobuf_bytes(program: Program) -> bytes:
    return program_to_message(program).SerializeToString()


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_the_fast_writer_writes_what_protobuf_writes(name):
    program = Program.from_bytes(FIXTURES[name])
    assert _WRITER.program(program) == _protobuf_bytes(program) == FIXTURES[name]


def test_the_fast_writer_agrees_on_transpiled_programs():
    from transpiler.api import transpile

    case = PADDLE_PROGRAMS / "bert_adam_clip_2ps_sync"
    main, startup = Program.load(case / "main.pb"), Program.load(case / "startup.pb")
    result = transpile(main, startup, pservers="127.0.0.1:6170,127.0.0.1:6171", trainers=2)
    programs = [result.trainer, result.trainer_startup, *(p for pair in result.pservers.values() for p in pair)]
    for program in programs:
        assert _WRITER.program(program) == _protobuf_bytes(program)


EDGE_ATTRS = {
    "neg_int": Attr.of(-5, AttrType.INT),
    "big_long": Attr.of(2**62, AttrType.LONG),
    "neg_long": Attr.of(-(2**63), AttrType.LONG),
    "zero_int": Attr.of(0, AttrType.INT),
    "flag": Attr.of(False, AttrType.BOOLEAN),
    "flags": Attr.of([True, False], AttrType.BOOLEANS),
    "empty_ints": Attr.of([], AttrType.INTS),
    "ints": Attr.of([-1, 0, 300, 2**31 - 1], AttrType.INTS),
    "longs": Attr.of([-(2**40), 2**40], AttrType.LONGS),
    "text": Attr.of("ünïcode " * 40, AttrType.STRING),  # longer than 127 bytes: a two-byte length
    "empty_text": Attr.of("", AttrType.STRING),
    "texts": Attr.of(["a", "", "é" * 100], AttrType.STRINGS),
    "var": Attr.of("x", AttrType.VAR),
    "vars": Attr.of(["x", "y"], AttrType.VARS),
    "block": Attr.of(0, AttrType.BLOCK),
    "blocks": Attr.of([0], AttrType.BLOCKS),
    "neg_zero": Attr.of(-0.0, AttrType.FLOAT),
    "zero": Attr.of(0.0, AttrType.FLOAT),
    "nan": Attr.of(float("nan"), AttrType.FLOAT64),
    "floats": Attr.of([1.5, -0.0, float("inf"), float("nan"), 0.1, 3.4e38], AttrType.FLOATS),
    "float_nan": Attr.of(float("nan"), AttrType.FLOAT),
    "float_too_big": Attr.of(1e39, AttrType.FLOAT),  # not a float32: protobuf decides (inf)
    "float_tiny": Attr.of(1e-46, AttrType.FLOAT),
    "float64s": Attr.of([0.1, -1e300], AttrType.FLOAT64S),
    "scalar_true": Attr.of(True, AttrType.SCALAR),
    "scalar_one": Attr.of(1, AttrType.SCALAR),
    "scalars": Attr.of([1, 2.5, 1j], AttrType.SCALARS),
}


def test_the_fast_writer_agrees_on_every_attr_type_and_edge_value():
    program = _small_program()
    program.version = 0
    program.op_version_map = {"relu": 2, "ä": 0}
    block = program.global_block()
    op = block.ops[0]
    for name, attr in EDGE_ATTRS.items():
        op.set_attr(name, attr)
    op.set_attr("again_neg_zero", Attr.of(-0.0, AttrType.FLOAT))  # equal to 0.0, not the same bytes
    block.var("x").attrs["v"] = Attr.of([1, -2], AttrType.INTS)
    block.var("x").persistable = True
    sub = program.create_block(0)
    sub.forward_block_idx = 0
    sub.create_var("é" * 70, dtype="int64", shape=[-1])
    assert _WRITER.program(program) == _protobuf_bytes(program)
    assert Program.from_bytes(program.to_bytes()).to_bytes() == program.to_bytes()


def test_reading_without_protobuf_gives_what_protobuf_gives_for_every_edge_value():
    """The reader decodes plain attrs and var types itself; every value above, written by
    protobuf, must read back as protobuf reads it."""
    program = _small_program()
    op = program.global_block().ops[0]
    for name, attr in EDGE_ATTRS.items():
        op.set_attr(name, attr)
    program.global_block().create_var("lod", dtype="float32", shape=[-1, 2], lod_level=1)
    program.global_block().create_var("feed", kind=VarKind.FEED_MINIBATCH)
    data = _protobuf_bytes(program)
    fast = fast_program_from_bytes(data)
    assert fast is not None
    _same_program(fast, _program_via_protobuf(data, "edge"))
    assert fast.to_bytes() == data


def test_a_plain_transpile_needs_no_protobuf(tmp_path):
    """Loading, transpiling and saving a Paddle-built program never imports the generated
    protobuf code (its import is a good part of the CLI's start)."""
    import subprocess
    import sys

    case = PADDLE_PROGRAMS / "resnet50_momentum_4ps_sync"
    probe = (
        "import sys; from transpiler.ir import Program; from transpiler.api import transpile\n"
        f"main, startup = Program.load({str(case / 'main.pb')!r}), Program.load({str(case / 'startup.pb')!r})\n"
        "result = transpile(main, startup, pservers='127.0.0.1:6170,127.0.0.1:6171', trainers=2)\n"
        f"result.save({str(tmp_path)!r})\n"
        "print(sorted(m for m in sys.modules if m.startswith('proto')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          cwd=PADDLE_PROGRAMS.parents[2])
    assert done.stdout.strip() == "[]"
