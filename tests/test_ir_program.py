"""The IR API: edits keep order and the reader/writer index right; attrs keep their types."""

from __future__ import annotations

import math

import numpy as np
import pytest

from transpiler.errors import IRError
from transpiler.ir import Attr, AttrType, DType, OpRole, Program, VarKind
from transpiler.ir.program import Op, Var


def _program(*var_names: str) -> Program:
    program = Program.empty()
    for name in var_names:
        program.global_block().create_var(name, dtype="float32", shape=(2, 3))
    return program


def _types(block) -> list[str]:
    return [op.type for op in block.ops]


# ----------------------------------------------------------------- op edits


def test_add_op_appends_and_inserts_at_index():
    block = _program("x").global_block()
    a = block.add_op("a", {"X": "x"}, {"Out": "x"})
    b = block.add_op("b")
    c = block.add_op("c", index=0)
    d = block.add_op("d", index=2)
    e = block.add_op("e", index=99)
    assert _types(block) == ["c", "a", "d", "b", "e"]
    assert [block.index_of(op) for op in (c, a, d, b, e)] == [0, 1, 2, 3, 4]
    assert a.index == 1 and len(block) == 5
    assert a.block is block


def test_add_op_takes_a_detached_op_but_not_an_attached_one():
    block = _program().global_block()
    op = Op("relu", {"X": "x"}, {"Out": "y"}, {"alpha": 0.5})
    assert block.add_op(op) is op
    with pytest.raises(IRError, match="already belongs"):
        block.add_op(op)
    with pytest.raises(IRError, match="not both"):
        block.add_op(Op("relu"), {"X": "x"})


def test_insert_after_and_before():
    block = _program().global_block()
    a, b = block.add_op("a"), block.add_op("b")
    block.insert_after(a, "a2")
    block.insert_before(a, "a0")
    block.insert_after(b, "b2")
    block.insert_before(b, "b0")
    assert _types(block) == ["a0", "a", "a2", "b0", "b", "b2"]
    assert [op.index for op in block.ops] == list(range(6))


def test_insert_with_an_anchor_from_elsewhere_fails():
    program = _program()
    other = program.create_block(0)
    foreign = other.add_op("x")
    with pytest.raises(IRError, match="not in block 0"):
        program.global_block().insert_after(foreign, "y")
    with pytest.raises(IRError, match="no block"):
        program.global_block().insert_before(Op("z"), "y")


def test_remove_op_detaches_and_can_be_reused():
    program = _program("x", "y")
    block = program.global_block()
    a = block.add_op("a", {"X": "x"}, {"Out": "y"})
    b = block.add_op("b", {"X": "y"}, {"Out": "x"})
    assert block.remove_op(a) is a
    assert a.block is None and _types(block) == ["b"]
    assert block.writers("y") == [] and block.readers("x") == []
    with pytest.raises(IRError):
        block.remove_op(a)
    with pytest.raises(IRError):
        a.index  # noqa: B018  (a detached op has no index)
    block.insert_after(b, a)
    assert _types(block) == ["b", "a"] and block.writers("y") == [a]


def test_remove_ops_and_clear():
    block = _program().global_block()
    ops = [block.add_op(t) for t in "abcde"]
    block.remove_ops([ops[1], ops[3]])
    assert _types(block) == ["a", "c", "e"]
    block.remove_ops(op for op in block.ops if op.type != "c")
    assert _types(block) == ["c"]
    block.clear_ops()
    assert len(block) == 0 and block.ops == ()


def test_readers_and_writers_are_in_op_order_after_edits():
    block = _program("x", "y", "z").global_block()
    w1 = block.add_op("w1", outputs={"Out": "x"})
    r1 = block.add_op("r1", {"X": ["x", "x"]}, {"Out": "y"})
    r0 = block.insert_before(w1, "r0", {"X": "x"})
    w2 = block.add_op("w2", {"X": "y"}, {"Out": ["x", "z"]})
    assert block.readers("x") == [r0, r1]
    assert block.writers("x") == [w1, w2]
    assert block.writers("z") == [w2]
    assert block.readers("nothing") == [] and block.writers("nothing") == []
    assert block.var_names_used() == ["x", "y", "z"]
    assert block.names_read() == {"x", "y"}
    block.remove_op(w2)
    assert block.names_read() == {"x"}


def test_the_index_built_late_matches_one_kept_from_the_start():
    """The reader / writer index is built at the first question: edits made before it
    (on a clone, which starts without one) must show in it all the same."""
    program = _program("x", "y", "z")
    block = program.global_block()
    block.add_op("w1", outputs={"Out": "x"})
    block.add_op("r1", {"X": ["x", "x"]}, {"Out": "y"})
    block.add_op("w2", {"X": "y"}, {"Out": ["x", "z"]})
    block.readers("x")  # the original's index, kept up to date from here on
    copy = program.clone().global_block()
    for b in (block, copy):
        w1, r1, w2 = b.ops
        assert b.names_used() == {"x", "y", "z"}
        r0 = b.insert_before(w1, "r0", {"X": "x"})
        r1.set_input("X", ["z"])
        b.remove_op(w2)
        w3 = b.add_op("w3", outputs={"Out": "y"})
        assert b.names_used() == {"x", "y", "z"}
    for b in (block, copy):
        r0, w1, r1, w3 = b.ops
        assert b.readers("x") == [r0] and b.readers("z") == [r1]
        assert b.writers("x") == [w1] and b.writers("y") == [r1, w3] and b.writers("z") == []
        assert b.names_read() == {"x", "z"} and b.names_used() == {"x", "y", "z"}
        assert b.var_names_used() == ["x", "z", "y"]


def test_slot_setters_keep_the_index_right():
    block = _program("x", "y", "z").global_block()
    op = block.add_op("op", {"X": "x"}, {"Out": "y"})
    op.set_input("X", ["z", "x"])
    op.set_output("Out", block.var("z"))
    assert op.input("X") == ("z", "x") and op.output("Out") == ("z",)
    assert block.readers("z") == [op] and block.writers("y") == [] and block.writers("z") == [op]
    op.remove_input("X")
    assert block.readers("x") == [] and op.input("X") == ()
    with pytest.raises(IRError, match="var name or a Var"):
        op.set_input("X", [1])


def test_replace_uses_rewrites_reads_only():
    block = _program("a", "b", "c").global_block()
    w = block.add_op("w", {"X": "c"}, {"Out": "a"})
    r1 = block.add_op("r1", {"X": "a", "Y": ["a", "c"]}, {"Out": "c"})
    r2 = block.add_op("r2", {"X": "a"}, {"Out": "b"})
    assert block.replace_uses("a", "b", ops=[r2]) == 1
    assert r2.input("X") == ("b",) and r1.input("X") == ("a",)
    assert block.replace_uses("a", "b") == 1
    assert r1.inputs == {"X": ("b",), "Y": ("b", "c")}
    assert w.output("Out") == ("a",), "writes of the old name stay"
    assert block.readers("a") == [] and block.readers("b") == [r1, r2] and block.writers("a") == [w]
    assert block.replace_uses("nobody", "x") == 0


def test_rename_var_keeps_declaration_order_and_renames_uses():
    block = _program("a", "b", "c").global_block()
    op = block.add_op("op", {"X": ["b", "a"]}, {"Out": "b"})
    var = block.rename_var("b", "bee")
    assert var.name == "bee" and var.block is block
    assert list(block.vars) == ["a", "bee", "c"]
    assert op.input("X") == ("bee", "a") and op.output("Out") == ("bee",)
    assert block.readers("bee") == [op] and block.writers("bee") == [op] and block.readers("b") == []
    with pytest.raises(IRError, match="already declares"):
        block.rename_var("a", "c")
    with pytest.raises(IRError, match="declares no var"):
        block.rename_var("nope", "x")


def test_rename_vars_renames_all_at_once_with_or_without_an_index():
    for indexed in (False, True):
        program = _program("a", "b", "c")
        block = program.global_block()
        r = block.add_op("r", {"X": ["a", "b"], "Y": "c"}, {"Out": "c"})
        w = block.add_op("w", {"X": "c"}, {"Out": ["b", "a"]})
        untouched = block.add_op("u", {"X": "c"})
        if indexed:
            block.readers("a")
        before = untouched.inputs
        block.rename_vars({"a": "b", "b": "a", "c": "cee"})  # a swap, and a plain rename
        assert list(block.vars) == ["b", "a", "cee"]
        assert r.inputs == {"X": ("b", "a"), "Y": ("cee",)} and r.output("Out") == ("cee",)
        assert w.input("X") == ("cee",) and w.output("Out") == ("a", "b")
        assert untouched.input("X") == ("cee",) and before == {"X": ("c",)}
        assert block.readers("cee") == [r, w, untouched] and block.readers("c") == []
        assert block.writers("a") == [w] and block.writers("cee") == [r]


def test_index_of_an_op_of_another_block_fails():
    program = _program()
    op = program.create_block().add_op("x")
    with pytest.raises(IRError):
        program.global_block().index_of(op)


# ----------------------------------------------------------------------- vars


def test_vars():
    block = _program().global_block()
    var = block.create_var("w", dtype=np.float32, shape=[4, 5], persistable=True, is_parameter=True)
    assert var.dtype == DType.FP32 and var.shape == (4, 5) and var.numel() == 20
    assert block.var("w") is var and block.has_var("w") and block.find_var("w") is var
    with pytest.raises(IRError, match="already declares"):
        block.create_var("w")
    with pytest.raises(IRError, match="already belongs"):
        _program().global_block().add_var(var)
    more = [Var("a"), Var("b")]
    block.add_vars(more)
    assert list(block.vars)[-2:] == ["a", "b"] and all(v.block is block for v in more)
    with pytest.raises(IRError, match="already declares"):
        block.add_vars([Var("c"), Var("w")])
    with pytest.raises(IRError, match="already belongs"):
        _program().global_block().add_vars([Var("d"), var])
    assert block.create_var("x", dtype="fp32", shape=(-1, 5)).shape == (-1, 5)
    with pytest.raises(IRError, match="no static shape"):
        block.var("x").numel()
    feed = block.create_var("feed", VarKind.FEED_MINIBATCH)
    assert feed.dtype is None and feed.shape is None
    copy = var.copy("w2")
    assert copy.name == "w2" and copy.block is None and var.name == "w"
    assert block.remove_var("w") is var and var.block is None and not block.has_var("w")
    with pytest.raises(IRError):
        Var("")


# ---------------------------------------------------------------------- attrs

EVERY_ATTR_TYPE = {
    AttrType.INT: (7, 7),
    AttrType.FLOAT: (0.5, 0.5),
    AttrType.STRING: ("héllo", "héllo"),
    AttrType.INTS: ([1, -2, 3], (1, -2, 3)),
    AttrType.FLOATS: ([0.25, 1.5], (0.25, 1.5)),
    AttrType.STRINGS: (["a", "b"], ("a", "b")),
    AttrType.BOOLEAN: (True, True),
    AttrType.BOOLEANS: ([True, False], (True, False)),
    AttrType.BLOCK: (1, 1),
    AttrType.LONG: (2**40, 2**40),
    AttrType.BLOCKS: ([1, 2], (1, 2)),
    AttrType.LONGS: ([2**40, -1], (2**40, -1)),
    AttrType.FLOAT64S: ([0.1, 1e300], (0.1, 1e300)),
    AttrType.VAR: ("x", "x"),
    AttrType.VARS: (["x", "y"], ("x", "y")),
    AttrType.FLOAT64: (0.1, 0.1),
    AttrType.SCALAR: (3 + 4j, 3 + 4j),
    AttrType.SCALARS: ([True, 2, 2.5, 1j], (True, 2, 2.5, 1j)),
}


def test_the_attr_table_covers_every_attr_type():
    assert set(EVERY_ATTR_TYPE) == set(AttrType)


def _program_with_every_attr() -> tuple[Program, Op]:
    program = _program("x", "y")
    program.create_block(0)
    program.create_block(0)
    op = program.global_block().add_op("everything", {"X": "x"}, {"Out": "y"})
    for attr_type, (value, _expected) in EVERY_ATTR_TYPE.items():
        op.set_attr(attr_type.name.lower(), value, attr_type)
    return program, op


@pytest.mark.parametrize("attr_type", list(AttrType), ids=lambda t: t.name)
def test_every_attr_type_reads_back_and_round_trips(attr_type):
    program, op = _program_with_every_attr()
    name = attr_type.name.lower()
    expected = EVERY_ATTR_TYPE[attr_type][1]
    assert op.attr_type(name) == attr_type
    assert op.attr(name) == expected
    data = program.to_bytes()
    again = Program.from_bytes(data).global_block().ops[0]
    assert again.attr_type(name) == attr_type
    if attr_type == AttrType.FLOAT:  # float32 on the wire
        assert again.attr(name) == pytest.approx(expected)
    else:
        assert again.attr(name) == expected
    assert Program.from_bytes(data).to_bytes() == data


def test_float32_attr_round_trips_to_the_float32_value():
    program = _program()
    op = program.global_block().add_op("scale", attrs={"scale": 0.1})
    again = Program.from_bytes(program.to_bytes()).global_block().ops[0]
    assert again.attr("scale") == float(np.float32(0.1)) != 0.1


def test_nan_and_infinite_floats_round_trip():
    program = _program()
    program.global_block().add_op("x", attrs={"a": math.nan, "b": [math.inf, -math.inf]})
    again = Program.from_bytes(program.to_bytes()).global_block().ops[0]
    assert math.isnan(again.attr("a")) and again.attr("b") == (math.inf, -math.inf)


@pytest.mark.parametrize(
    ("value", "attr_type"),
    [
        (1, AttrType.INT),
        (-(2**31), AttrType.INT),
        (2**31, AttrType.LONG),
        (1.0, AttrType.FLOAT),
        ("s", AttrType.STRING),
        (True, AttrType.BOOLEAN),
        ([1, 2], AttrType.INTS),
        ((1, 2**40), AttrType.LONGS),
        ([1, 2.5], AttrType.FLOATS),
        (["a"], AttrType.STRINGS),
        ([False], AttrType.BOOLEANS),
        (1 + 2j, AttrType.SCALAR),
        (np.int64(3), AttrType.INT),
        (np.float32(0.5), AttrType.FLOAT),
    ],
)
def test_set_attr_infers_the_type(value, attr_type):
    op = Op("x")
    op.set_attr("a", value)
    assert op.attr_type("a") == attr_type


def test_set_attr_infers_block_from_a_block():
    program = _program()
    sub = program.create_block(0)
    op = program.global_block().add_op("while", attrs={"sub_block": sub})
    assert op.attr_type("sub_block") == AttrType.BLOCK and op.attr("sub_block") == 1


def test_set_attr_keeps_an_existing_wire_type():
    op = Op("x", attrs={"axis": Attr.of(1, AttrType.LONG), "ids": Attr.of([], AttrType.INTS)})
    op.set_attr("axis", 2)
    op.set_attr("ids", [5])
    assert op.attr_type("axis") == AttrType.LONG and op.attr("axis") == 2
    assert op.attr_type("ids") == AttrType.INTS and op.attr("ids") == (5,)
    op.set_attr("axis", 3, AttrType.INT)
    assert op.attr_type("axis") == AttrType.INT
    op.set_attr("axis", Attr.of("s"))
    assert op.attr_type("axis") == AttrType.STRING


@pytest.mark.parametrize(
    ("value", "attr_type", "message"),
    [
        ([], None, "empty list"),
        (["a", 1], None, "mixing"),
        (None, None, "NoneType"),
        ({"a": 1}, None, "dict"),
        (2**31, AttrType.INT, "does not fit"),
        (2**63, AttrType.LONG, "does not fit"),
        ("1", AttrType.INT, "integer"),
        (1.5, AttrType.INT, "integer"),
        (True, AttrType.FLOAT, "number"),
        (2, AttrType.BOOLEAN, "bool"),
        (3, AttrType.STRING, "string"),
        ("ab", AttrType.INTS, "list"),
        (-1, AttrType.BLOCK, "block index"),
        ("x", AttrType.SCALAR, "SCALAR"),
    ],
)
def test_set_attr_errors(value, attr_type, message):
    op = Op("x")
    with pytest.raises(IRError, match=message):
        op.set_attr("a", value, attr_type)
    assert not op.has_attr("a")


def test_attr_access():
    op = Op("x", attrs={"a": 1})
    assert op.attr("missing", None) is None
    with pytest.raises(IRError, match="no attr"):
        op.attr("missing")
    with pytest.raises(IRError, match="no attr"):
        op.attr_type("missing")
    op.remove_attr("a")
    op.remove_attr("a")  # absent: no error
    assert op.attr_values() == {}


def test_attr_lists_are_immutable_tuples():
    op = Op("x", attrs={"shape": [1, 2]})
    assert op.attr("shape") == (1, 2)
    with pytest.raises(TypeError):
        op.attrs["shape"] = Attr.of([3])  # type: ignore[index]


# ------------------------------------------------------------ blocks, clone


def test_create_block_and_parents():
    program = _program("x")
    b1 = program.create_block(0)
    b2 = program.create_block(1)
    assert (b1.idx, b1.parent_idx, b2.idx, b2.parent_idx) == (1, 0, 2, 1)
    assert b2.parent is b1 and b1.parent is program.global_block() and program.global_block().parent is None
    b1.create_var("inner", dtype="int64", shape=[1])
    assert b2.find_var("x") is program.global_block().var("x")
    assert b2.find_var("inner") is b1.var("inner")
    assert program.global_block().find_var("inner") is None
    with pytest.raises(IRError, match="out of range"):
        program.create_block(5)
    with pytest.raises(IRError, match="out of range"):
        program.block(3)
    assert program.num_blocks == 3 and [b.idx for b in program.blocks] == [0, 1, 2]


def test_block_attr_and_blocks_attr():
    program = _program()
    b1, b2 = program.create_block(0), program.create_block(0)
    op = program.global_block().add_op(
        "cond", attrs={"sub_block": b1, "blocks": Attr.of([1, 2], AttrType.BLOCKS), "n": 1}
    )
    assert op.block_attr("sub_block") is b1
    assert op.blocks_attr("blocks") == [b1, b2]
    assert op.sub_block_indices() == [1, 1, 2]
    with pytest.raises(IRError, match="not BLOCK"):
        op.block_attr("n")
    with pytest.raises(IRError, match="not BLOCKS"):
        op.blocks_attr("sub_block")
    with pytest.raises(IRError, match="not in a program"):
        Op("detached", attrs={"sub_block": Attr.of(1, AttrType.BLOCK)}).block_attr("sub_block")


def test_clone_is_independent():
    program = _program("x", "y")
    program.version = 7
    program.create_block(0).add_op("inner", {"X": "x"})
    op = program.global_block().add_op("op", {"X": "x"}, {"Out": "y"}, {"k": [1, 2]})
    before = program.to_bytes()
    copy = program.clone()
    assert copy.to_bytes() == before
    cop = copy.global_block().ops[0]
    assert cop is not op and cop.block is copy.global_block()
    cop.set_attr("k", [9])
    cop.set_input("X", "y")
    copy.global_block().var("x").shape = (9,)
    copy.global_block().add_op("new")
    copy.block(1).remove_op(copy.block(1).ops[0])
    copy.create_block(0)
    copy.version = 8
    assert program.to_bytes() == before
    assert program.global_block().readers("x") == [op]
    assert copy.global_block().readers("x") == []


def test_add_ops_appends_in_order_and_keeps_the_index_and_caches_right():
    for index_first in (False, True):
        block = _program("x", "y").global_block()
        first = block.add_op("a", {"X": "x"}, {"Out": "y"})
        if index_first:
            assert block.readers("x") == [first]  # the index exists: add_ops must keep it whole
        assert block.ops == (first,)  # the op tuple is cached: add_ops must drop it
        version = block.version
        b, c = Op("b", {"X": "y"}, {"Out": "x"}), Op("c", {"X": ["x", "y"]})
        block.add_ops([b, c])
        assert _types(block) == ["a", "b", "c"] and len(block) == 3 and block.version > version
        assert [block.index_of(op) for op in (first, b, c)] == [0, 1, 2]
        assert block.readers("x") == [first, c] and block.readers("y") == [b, c]
        assert block.writers("x") == [b] and block.writers("y") == [first]
        assert b.block is block and c.index == 2
        block.remove_op(b)
        assert _types(block) == ["a", "c"] and block.writers("x") == []


def test_add_ops_refuses_attached_repeated_or_non_ops_and_adds_nothing_then():
    block = _program("x").global_block()
    attached = block.add_op("a")
    twice = Op("b")
    for bad in ([Op("c"), attached], [twice, twice], [Op("c"), "d"]):
        with pytest.raises(IRError):
            block.add_ops(bad)
        assert _types(block) == ["a"]
    frozen = _program("x")
    frozen.freeze()
    with pytest.raises(IRError):
        frozen.global_block().add_ops([Op("a")])


def test_op_derived_is_clone_with_normalised_values():
    op = Op("op", {"X": "x", "Y": ["y"]}, {"Out": "o"}, {"k": Attr.of(1, AttrType.LONG), "s": "a"})
    changed = {"k": Attr(AttrType.LONG, 2), "op_role_var": Attr(AttrType.STRINGS, ("w", "g"))}
    twin = op._derived({"Y": ("z", "w")}, {"Out": ("p",)}, changed, sound=True)
    cloned = op.clone(inputs={"Y": ["z", "w"]}, outputs={"Out": "p"}, attrs={"k": 2, "op_role_var": ["w", "g"]})
    for copy in (twin, cloned):
        assert copy.block is None and copy.type == "op"
        assert list(copy.inputs.items()) == [("X", ("x",)), ("Y", ("z", "w"))] and copy.outputs == {"Out": ("p",)}
        assert list(copy.attrs.items()) == [("k", Attr(AttrType.LONG, 2)), ("s", Attr.of("a")),
                                            ("op_role_var", Attr(AttrType.STRINGS, ("w", "g")))]
    assert op.input("Y") == ("y",) and op.attr("k") == 1
    plain = op._derived()
    assert plain._inputs is op._inputs and plain._attrs is op._attrs  # shared, as clone shares them
    # Counts as verified only when the original's attrs were and the new ones are sound.
    assert twin._verified_attrs is None
    op._verified_attrs = op._attrs
    assert op._derived(attrs=changed, sound=True)._verified_attrs is not None
    assert op._derived(attrs=changed, sound=False)._verified_attrs is None
    assert op._derived()._verified_attrs is op._attrs


def test_op_clone_is_detached_and_independent():
    block = _program("x").global_block()
    op = block.add_op("op", {"X": "x"}, attrs={"k": 1})
    twin = op.clone()
    assert twin.block is None and twin.inputs == op.inputs
    twin.set_attr("k", 2)
    twin.set_input("X", "z")
    assert op.attr("k") == 1 and op.input("X") == ("x",)
    block.add_op(twin)
    assert block.readers("z") == [twin]


def test_op_clone_replaces_the_slots_and_attrs_it_is_given_as_the_setters_would():
    op = Op("op", {"X": "x", "Y": ["y"]}, {"Out": "o"}, {"k": Attr.of(1, AttrType.LONG), "s": "a"})
    twin = op.clone(inputs={"Y": ["z", "w"]}, outputs={"Out": "p"}, attrs={"k": 2, "new": [1.5]})
    edited = op.clone()
    edited.set_input("Y", ["z", "w"])
    edited.set_output("Out", "p")
    edited.set_attr("k", 2)
    edited.set_attr("new", [1.5])
    for copy in (twin, edited):
        assert list(copy.inputs.items()) == [("X", ("x",)), ("Y", ("z", "w"))]
        assert copy.outputs == {"Out": ("p",)}
        assert list(copy.attrs.items()) == [("k", Attr(AttrType.LONG, 2)), ("s", Attr.of("a")),
                                            ("new", Attr(AttrType.FLOATS, (1.5,)))]
    assert op.inputs == {"X": ("x",), "Y": ("y",)} and op.attr("k") == 1 and not op.has_attr("new")


def test_op_clones_share_slots_and_attrs_yet_every_edit_stays_on_its_op():
    """A clone shares its original's slot and attr dicts (edits replace them, never
    change them in place): each edit, on either side, must leave the other op as it was."""
    edits = [
        lambda op: op.set_attr("k", 2),
        lambda op: op.set_attr("new", "v"),
        lambda op: op.remove_attr("k"),
        lambda op: op.set_input("X", "z"),
        lambda op: op.set_output("Out", ["z", "w"]),
        lambda op: op.remove_input("X"),
        lambda op: op.remove_output("Out"),
        lambda op: op.rename_input("x", "z"),
        lambda op: op.rename_output("y", "z"),
    ]
    for edit in edits:
        block = _program("x", "y").global_block()
        op = block.add_op("op", {"X": "x", "Y": ["x", "y"]}, {"Out": "y"}, {"k": 1, "j": [1, 2]})
        twin = op.clone()
        snapshot = (dict(op.inputs), dict(op.outputs), dict(op.attrs))
        edit(twin)
        assert (dict(op.inputs), dict(op.outputs), dict(op.attrs)) == snapshot
        assert block.readers("x") == [op] and block.writers("y") == [op]
        edit(op)
        assert (dict(op.inputs), dict(op.outputs), dict(op.attrs)) == (dict(twin.inputs), dict(twin.outputs),
                                                                       dict(twin.attrs))
        assert (dict(twin.inputs), dict(twin.outputs), dict(twin.attrs)) != snapshot


def test_program_helpers_and_save(tmp_path):
    program = _program("x")
    program.global_block().add_op("a")
    program.create_block(0).add_op("b")
    assert program.num_ops() == 2
    assert [(b.idx, op.type) for b, op in program.all_ops()] == [(0, "a"), (1, "b")]
    path = tmp_path / "p.pb"
    program.save(path)
    assert Program.load(path).to_bytes() == program.to_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.pb"], "no temp file left behind"


def test_role_and_role_vars():
    op = Op("sgd", attrs={"op_role": 2, "op_role_var": ["w", "w@GRAD"]})
    assert op.role.describe() == "optimize"
    assert op.role_vars == ("w", "w@GRAD")
    assert Op("mul").role.describe() == "forward"


def test_has_role_agrees_with_the_role_flags():
    for number in (0, 1, 2, 3, 16, 18, 256, 257, 0x10000, -1, -(2**31)):
        op = Op("op", attrs={"op_role": Attr.of(number, AttrType.INT)})
        for flag in OpRole:
            assert op.has_role(flag) == bool(op.role & flag), (number, flag)
    assert not Op("mul").has_role(OpRole.Optimize)


def test_var_copy_carries_every_field():
    """`Var.copy` lists its fields one by one (it is hot); a field added to `__slots__`
    but not to `copy` fails here."""
    from transpiler.ir.attrs import Attr

    var = Var("v", VarKind.SELECTED_ROWS, "fp64", (3, 4), lod_level=2, persistable=True, need_check_feed=True,
              is_parameter=True, stop_gradient=True, attrs={"a": Attr.of(1)})
    var.reader = ((DType.FP32, (1,), 0),)
    var.tuple_types = (5,)
    var._explicit = frozenset({"persistable"})
    copy = var.copy("w")
    for slot in Var.__slots__:
        if slot not in ("_name", "block"):
            assert getattr(copy, slot) == getattr(var, slot), slot
    assert copy.name == "w" and copy.block is None and copy.attrs is not var.attrs


# ------------------------------------------------------------- clone map, freeze


def test_clone_with_map_maps_every_op_and_var_to_its_copy():
    program = _program("x", "y")
    block = program.global_block()
    a = block.add_op("relu", {"X": "x"}, {"Out": "y"})
    sub = program.create_block(0)
    b = sub.add_op("scale", {"X": "y"}, {"Out": "y"})
    copy, copies = program.clone_with_map()
    assert copies.op(a) is copy.global_block().ops[0] and copies.op(b) is copy.block(1).ops[0]
    assert copies.op(a) is not a and copies.op(a).type == "relu"
    assert copies.var(block.var("x")) is copy.global_block().var("x")
    assert len(copies.ops) == 2 and len(copies.vars) == 2
    with pytest.raises(IRError, match="not an op of the cloned program"):
        copies.op(Op("relu"))
    copy.global_block().remove_op(copies.op(a))  # editing the copy leaves the original alone
    assert _types(block) == ["relu"]


def test_a_frozen_program_refuses_every_edit_and_its_clones_do_not():
    from transpiler.ir import FrozenProgramError

    program = _program("x", "y")
    block = program.global_block()
    op = block.add_op("relu", {"X": "x"}, {"Out": "y"})
    program.freeze()
    edits = [
        lambda: block.add_op("relu"),
        lambda: block.insert_after(op, "relu"),
        lambda: block.insert_before(op, "relu"),
        lambda: block.remove_op(op),
        lambda: block.create_var("z"),
        lambda: block.remove_var("x"),
        lambda: block.rename_var("x", "x2"),
        lambda: block.replace_uses("x", "y"),
        lambda: block.reorder([op]),
        lambda: program.create_block(0),
        lambda: op.set_attr("alpha", 1.0),
        lambda: op.remove_attr("alpha"),
        lambda: op.set_input("X", ["y"]),
        lambda: op.set_output("Out", ["x"]),
    ]
    for edit in edits:
        with pytest.raises(FrozenProgramError, match="frozen program"):
            edit()
    assert _types(block) == ["relu"] and op.input("X") == ("x",) and not op.has_attr("alpha")
    assert isinstance(FrozenProgramError("x"), IRError)
    copy = program.clone()
    assert not copy.frozen
    copy.global_block().add_op("relu")
    detached = op.clone()
    detached.set_attr("alpha", 1.0)  # a detached copy of a frozen op is free


def test_names_used_and_read_agree_on_small_and_large_blocks_with_and_without_the_index():
    for count in (3, 40):  # below and above the size where names_used walks the ops another way
        block = _program(*[f"v{i}" for i in range(count + 1)]).global_block()
        for i in range(count):
            block.add_op("op", {"X": [f"v{i}", "@EMPTY@"], "Y": []}, {"Out": f"v{i + 1}"} if i % 2 else {})
        expected_read = {f"v{i}" for i in range(count)} | {"@EMPTY@"}
        expected = expected_read | {f"v{i + 1}" for i in range(count) if i % 2}
        assert block.names_used() == expected and block.names_read() == expected_read
        block.readers("v0")  # builds the index, which both answer from then on
        assert block.names_used() == expected and block.names_read() == expected_read
