"""The op catalogue: coverage, agreement with what Fluid 1.8.5 wrote, `make_op` typing,
grad makers, shape rules, and unknown ops passing through the IR untouched."""

from __future__ import annotations

import json

import pytest

from conftest import PADDLE_CASES, PADDLE_PB_FILES, PADDLE_PROGRAMS
from ops import catalogue
from ops.catalogue import OPTIMIZER_SLOTS, GradContext, OpSpecError, ShapeContext, ShapeError, TensorInfo
from ops.catalogue import shapes
from transpiler.errors import IRError, UnknownOpError
from transpiler.ir import AttrType, DType, Op, OpRole, Program
from transpiler.ir.printer import dump
from transpiler.ir.verifier import verify

NOISE = {"op_callstack", "op_namescope"}
FLUID18_PB = [p for p in PADDLE_PB_FILES if p.parent.name.startswith("fluid18_")]


def _expected_op_types() -> set[str]:
    found: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            if "type" in node and ("inputs" in node or "outputs" in node):
                found.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for case in PADDLE_CASES:  # the real models' ops: test_paddle_real_models.py
        walk(json.loads((PADDLE_PROGRAMS / case / "expected.json").read_text()))
    return found


def test_every_fixture_op_type_is_catalogued():
    wanted = _expected_op_types()
    for path in PADDLE_PB_FILES:
        wanted |= {op.type for _, op in Program.load(path).all_ops()}
    assert len(wanted) > 40
    missing = sorted(t for t in wanted if catalogue.get(t) is None)
    assert missing == []


def test_distributed_ops_of_the_facts_are_catalogued():
    for op_type in ("send", "recv", "send_barrier", "fetch_barrier", "split_byref", "split_selected_rows", "split_ids",
                    "merge_ids", "prefetch", "lookup_sparse_table", "distributed_lookup_table", "fake_init",
                    "listen_and_serv", "checkpoint_notify", "save", "concat", "sum", "scale"):
        assert catalogue.require(op_type).type == op_type


def test_require_names_the_unknown_op():
    assert catalogue.get("no_such_op") is None
    with pytest.raises(UnknownOpError, match="'no_such_op'"):
        catalogue.require("no_such_op")
    with pytest.raises(UnknownOpError, match="'frobnicate'"):
        catalogue.make_op("frobnicate", {"X": ["a"]}, {"Out": ["b"]})


@pytest.mark.parametrize("path", FLUID18_PB, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_fluid18_ops_agree_with_their_entries(path):
    """Every slot Fluid 1.8.5 wrote is declared; every declared attr it wrote has our type;
    an op Fluid built through Python carries every attr we default."""
    for block, op in Program.load(path).all_ops():
        entry = catalogue.require(op.type)
        declared_in = {s.name for s in entry.inputs}
        declared_out = {s.name for s in entry.outputs}
        assert set(op.inputs) <= declared_in, (op.type, set(op.inputs) - declared_in)
        assert set(op.outputs) <= declared_out, (op.type, set(op.outputs) - declared_out)
        for name, attr in op.attrs.items():
            spec = entry.attrs.get(name) or catalogue.opdef.COMMON_ATTRS.get(name)
            assert spec is not None, f"{op.type} has attr {name} the catalogue does not declare"
            assert attr.type == spec.type, (op.type, name, attr.type, spec.type)
        checked = "op_namescope" in op.attrs and entry.role != OpRole.Backward  # built by Python, attrs checked
        if checked:
            assert set(entry.attrs) <= set(op.attrs), (op.type, set(entry.attrs) - set(op.attrs))


def test_make_op_types_attrs_as_paddle_does():
    send = catalogue.make_op("send", {"X": ["g.block0"]}, {"Out": ["dummy"]}, {"epmap": [], "sections": [3, 4]})
    assert send.attr_type("epmap") == AttrType.STRINGS and send.attr("epmap") == ()
    assert send.attr_type("sections") == AttrType.LONGS
    assert send.attr("use_send_handler") is True and send.attr("merge_add") is False
    assert send.attr("op_role") == int(OpRole.RPC)
    split = catalogue.make_op("split_byref", {"X": ["g"]}, {"Out": ["g.block0", "g.block1"]}, {"sections": [3, 4]})
    assert split.attr_type("sections") == AttrType.INTS and split.attr("op_role") == int(OpRole.Dist)
    serv = catalogue.make_op("listen_and_serv", {"X": []}, {}, {"optimize_blocks": [1, 2], "Fanin": 2}, role=OpRole.Forward)
    assert serv.attr_type("optimize_blocks") == AttrType.BLOCKS and serv.attr("checkpint_block_id") == -1
    lookup = catalogue.make_op("lookup_table", {"W": ["w"], "Ids": ["ids"]}, {"Out": ["o"]})
    assert lookup.attr_type("padding_idx") == AttrType.LONG and lookup.attr_type("height_sections") == AttrType.LONGS
    fetch = catalogue.make_op("fetch_barrier", {}, {"Out": ["a"]}, role=OpRole.RPC, role_vars=["p", "g"])
    assert fetch.input("X") == () and "X" in fetch.inputs  # dispensable, present and empty when inputs are given
    assert fetch.attr("op_role_var") == ("p", "g")
    assert list(fetch.attrs) == sorted(fetch.attrs)


def test_make_op_fills_empty_dispensable_inputs_only_when_inputs_are_given():
    with_inputs = catalogue.make_op("fill_constant", {}, {"Out": ["x"]}, {"shape": [1]})
    without = catalogue.make_op("fill_constant", None, {"Out": ["x"]}, {"shape": [1]})
    assert list(with_inputs.inputs) == ["ShapeTensor", "ShapeTensorList", "ValueTensor"]
    assert dict(without.inputs) == {}
    assert with_inputs.attr_type("shape") == AttrType.LONGS and with_inputs.attr("str_value") == ""


def test_make_op_refuses_bad_slots_and_attrs():
    with pytest.raises(OpSpecError, match="mul: input slot Y is required"):
        catalogue.make_op("mul", {"X": ["a"]}, {"Out": ["b"]})
    with pytest.raises(OpSpecError, match="no input slot 'Z'"):
        catalogue.make_op("mul", {"X": ["a"], "Y": ["b"], "Z": ["c"]}, {"Out": ["d"]})
    with pytest.raises(OpSpecError, match="takes one var"):
        catalogue.make_op("mul", {"X": ["a", "b"], "Y": ["c"]}, {"Out": ["d"]})
    with pytest.raises(OpSpecError, match="attr in_dtype"):
        catalogue.make_op("cast", {"X": ["a"]}, {"Out": ["b"]}, {"out_dtype": 5})
    with pytest.raises(OpSpecError, match="epmap"):
        catalogue.make_op("send", {"X": ["a"]}, {"Out": ["b"]}, {"epmap": 3})
    with pytest.raises(IRError):  # OpSpecError is an IRError
        catalogue.make_op("save", {"X": ["a"]}, {})


def _general_make_op(*args, **kwargs):
    """make_op with its cache of call shapes empty: the general path."""
    from ops.catalogue import build

    saved = dict(build._SHAPES)
    build._SHAPES.clear()
    try:
        return catalogue.make_op(*args, **kwargs)
    finally:
        build._SHAPES.clear()
        build._SHAPES.update(saved)


def _same_op(a, b) -> bool:
    return (a.type, list(a.inputs.items()), list(a.outputs.items()), list(a.attrs.items()),
            a._verified_attrs is a._attrs) == (b.type, list(b.inputs.items()), list(b.outputs.items()),
                                               list(b.attrs.items()), b._verified_attrs is b._attrs)


def test_make_op_of_a_shape_seen_before_builds_what_the_general_path_builds():
    """make_op remembers what a call's names settle (slot order, one-var slots, attr types,
    role attrs, attr order); a second call of that shape must build the same op, and a value
    the shortcut cannot take must still be normalised or refused as the first time."""
    from transpiler.ir import Var

    calls = [
        (("recv", {"X": ["a"]}, {"Out": ["b", "c"]}, {"epmap": ["e1", "e2"], "trainer_id": 0}),
         {"role": OpRole.RPC, "role_vars": ("p", "g")}),
        (("concat", {"X": ["a", "b"]}, {"Out": ["p"]}, {"axis": 0}), {"role": OpRole.Dist}),
        (("fill_constant", {}, {"Out": ["x"]}, {"shape": [1]}), {}),
        (("fill_constant", None, {"Out": ["x"]}, {"shape": [1]}), {}),
        (("sum", {"X": ["a", "b"]}, {"Out": ["c"]}, {"use_mkldnn": False}), {"fill_defaults": False}),
        (("send", {"X": ["g"]}, {"Out": ["d"]}, {"epmap": ["e"], "sections": [3, 4], "zz_unknown": 1}), {}),
        (("fetch_barrier", {}, {"Out": ["a"]}), {"role": 4, "role_vars": []}),
    ]
    for args, kwargs in calls:
        expected = _general_make_op(*args, **kwargs)
        first, second = catalogue.make_op(*args, **kwargs), catalogue.make_op(*args, **kwargs)
        assert _same_op(first, expected) and _same_op(second, expected), args[0]
    # Values of a known shape that the shortcut leaves to the general path.
    catalogue.make_op("mul", {"X": ["a"], "Y": ["c"]}, {"Out": ["d"]})
    with pytest.raises(OpSpecError, match="takes one var"):
        catalogue.make_op("mul", {"X": ["a", "b"], "Y": ["c"]}, {"Out": ["d"]})
    catalogue.make_op("send", {"X": ["a"]}, {"Out": ["b"]}, {"epmap": ["e"]})
    with pytest.raises(OpSpecError, match="epmap"):
        catalogue.make_op("send", {"X": ["a"]}, {"Out": ["b"]}, {"epmap": 3})
    named = catalogue.make_op("mul", {"X": Var("a"), "Y": "c"}, {"Out": [Var("d")]})
    assert named.input("X") == ("a",) and named.input("Y") == ("c",) and named.output("Out") == ("d",)


def test_make_op_without_defaults_builds_raw_descs():
    op = catalogue.make_op("sum", {"X": ["a", "b"]}, {"Out": ["c"]}, {"use_mkldnn": False}, fill_defaults=False)
    assert set(op.attrs) == {"use_mkldnn"}


def test_fill_attrs_types_and_completes_an_existing_op():
    op = Op("split_byref", {"X": ["g"]}, {"Out": ["a", "b"]}, {"sections": [2, 3]})
    op.set_attr("sections", [2, 3], AttrType.LONGS)
    catalogue.fill_attrs(op)
    assert op.attr_type("sections") == AttrType.INTS and op.attr("num") == 0 and op.attr("op_role_var") == ()
    unknown = Op("my_custom_op", {"X": ["a"]}, {"Out": ["b"]}, {"k": 1})
    assert catalogue.fill_attrs(unknown, strict=False) is unknown and dict(unknown.attr_values()) == {"k": 1}
    with pytest.raises(UnknownOpError, match="my_custom_op"):
        catalogue.fill_attrs(unknown)


def test_unknown_ops_load_dump_verify_and_round_trip_untouched():
    program = Program.load(PADDLE_PROGRAMS / "fluid18_basic_sgd_2ps" / "main.pb")
    block = program.global_block()
    block.create_var("weird_out", dtype="float32", shape=[-1, 1000])
    block.add_op("my_custom_op", {"X": ["fc_0.tmp_1"]}, {"Out": ["weird_out"]}, {"alpha": 0.5, "tags": ["a", "b"]})
    verify(program)
    data = program.to_bytes()
    again = Program.from_bytes(data)
    assert again.to_bytes() == data
    assert "my_custom_op X=[fc_0.tmp_1] -> Out=[weird_out] {alpha=0.5, tags=[\"a\", \"b\"]}" in dump(again)


def test_grad_entries_are_derived_from_the_makers():
    mul_grad = catalogue.require("mul_grad")
    assert [s.name for s in mul_grad.inputs] == ["Out@GRAD", "X", "Y"]
    assert [s.name for s in mul_grad.outputs] == ["X@GRAD", "Y@GRAD"]
    assert mul_grad.role == OpRole.Backward and set(mul_grad.attrs) == set(catalogue.require("mul").attrs)
    assert dict(catalogue.require("mean_grad").attrs) == {}
    concat_grad = catalogue.require("concat_grad")
    assert concat_grad.output("X@GRAD").duplicable
    assert catalogue.require("cross_entropy_grad2").input("XShape") is not None


def test_grad_maker_drops_no_grad_inputs_like_paddle():
    mul = catalogue.make_op("mul", {"X": ["x"], "Y": ["w"]}, {"Out": ["o"]})
    ctx = GradContext(mul, no_grad={"x@GRAD"})
    (grad,) = catalogue.require("mul").grad(ctx)
    assert grad.type == "mul_grad"
    assert grad.output("X@GRAD") == () and grad.output("Y@GRAD") == ("w@GRAD",)
    assert grad.input("Out@GRAD") == ("o@GRAD",) and grad.attr("x_num_col_dims") == 1
    assert ctx.grad_to_var == {"w@GRAD": "w"}
    concat = catalogue.make_op("concat", {"X": ["a", "b"]}, {"Out": ["c"]}, {"axis": 1})
    (cgrad,) = catalogue.require("concat").grad(GradContext(concat, no_grad={"a@GRAD"}))
    assert cgrad.output("X@GRAD") == ("@EMPTY@", "b@GRAD") and cgrad.input("AxisTensor") == ()


def test_sum_grad_is_scale_ops():
    op = catalogue.make_op("sum", {"X": ["a", "b"]}, {"Out": ["c"]})
    grads = catalogue.require("sum").grad(GradContext(op, no_grad={"b@GRAD"}))
    assert [(g.type, g.input("X"), g.output("Out")) for g in grads] == [("scale", ("c@GRAD",), ("a@GRAD",))]


def test_sequence_pool_grad_takes_max_index_only_for_max():
    for pooltype, has in (("SUM", False), ("MAX", True)):
        op = catalogue.make_op("sequence_pool", {"X": ["e"]}, {"Out": ["o"], "MaxIndex": ["m"]}, {"pooltype": pooltype})
        (grad,) = catalogue.require("sequence_pool").grad(GradContext(op))
        assert ("MaxIndex" in grad.inputs) is has


def test_optimizer_entries_cover_the_slot_table():
    for op_type, slots in OPTIMIZER_SLOTS.items():
        entry = catalogue.require(op_type)
        assert entry.role == OpRole.Optimize
        ins = {s.name for s in entry.inputs}
        outs = {s.name for s in entry.outputs}
        for slot in (slots.param, slots.grad, slots.learning_rate, *slots.accumulators):
            assert slot in ins, (op_type, slot)
        for src, dst in slots.outputs.items():
            assert src in ins and dst in outs, (op_type, src, dst)
    assert catalogue.is_optimizer("adam") and not catalogue.is_optimizer("mul")


def _ctx(op_type: str, attrs: dict, **inputs) -> ShapeContext:
    entry = catalogue.require(op_type)
    values = {**entry.attr_defaults(), **attrs}
    return ShapeContext(op_type, {k: tuple(v) for k, v in inputs.items()}, values)


F32 = DType.FP32


def test_shape_rules():
    out = shapes.mul(_ctx("mul", {}, X=[TensorInfo(F32, (-1, 1000), 1)], Y=[TensorInfo(F32, (1000, 10))]))
    assert out["Out"][0] == TensorInfo(F32, (-1, 10), 1)
    out = shapes.elementwise(_ctx("elementwise_add", {"axis": 1}, X=[TensorInfo(F32, (-1, 10))], Y=[TensorInfo(F32, (10,))]))
    assert out["Out"][0].shape == (-1, 10)
    out = shapes.elementwise(_ctx("elementwise_sub", {}, X=[TensorInfo(F32, (-1, 1000))], Y=[TensorInfo(F32, (-1, 1))]))
    assert out["Out"][0].shape == (-1, 1000)
    out = shapes.concat(_ctx("concat", {"axis": 1}, X=[TensorInfo(F32, (-1, 16)), TensorInfo(F32, (-1, 32))]))
    assert out["Out"][0].shape == (-1, 48)
    ids = TensorInfo(DType.INT64, (-1, 1), 1)
    out = shapes.lookup_table(_ctx("lookup_table", {}, W=[TensorInfo(F32, (100, 16))], Ids=[ids]))
    assert out["Out"][0] == TensorInfo(F32, (-1, 16), 1)
    out = shapes.cross_entropy(_ctx("cross_entropy2", {}, X=[TensorInfo(F32, (-1, 2))], Label=[TensorInfo(DType.INT64, (-1, 1))]))
    assert out["XShape"][0].shape == (-1, 2, 0) and out["Y"][0].shape == (-1, 1)
    out = shapes.reduce(_ctx("reduce_sum", {"dim": [1]}, X=[TensorInfo(F32, (-1, 5, 3))]))
    assert out["Out"][0].shape == (-1, 3)


def test_shape_rules_name_the_shapes_when_they_do_not_fit():
    with pytest.raises(ShapeError, match=r"X \[-1, 784\] and Y \[1000, 10\] cannot multiply"):
        shapes.mul(_ctx("mul", {}, X=[TensorInfo(F32, (-1, 784))], Y=[TensorInfo(F32, (1000, 10))]))
    with pytest.raises(ShapeError, match=r"do not broadcast"):
        shapes.elementwise(_ctx("elementwise_add", {}, X=[TensorInfo(F32, (-1, 3))], Y=[TensorInfo(F32, (4,))]))
    with pytest.raises(ShapeError, match="no LoD"):
        shapes.sequence_pool(_ctx("sequence_pool", {}, X=[TensorInfo(F32, (-1, 16))]))
    with pytest.raises(ShapeError, match="must end in a dimension of 1"):
        shapes.lookup_table(_ctx("lookup_table", {}, W=[TensorInfo(F32, (9, 2))], Ids=[TensorInfo(DType.INT64, (-1, 3))]))


def test_make_op_shares_a_typed_scalar_attr_and_still_types_each_value_by_its_spec():
    # The first call of a shape takes the general path; the calls of that shape after it share.
    one, two, three = (catalogue.make_op("send", {"X": [f"a{i}"]}, {"Out": ["b"]}, {"epmap": ["e"], "trainer_id": 0})
                       for i in range(3))
    assert two.attrs["trainer_id"] is three.attrs["trainer_id"]  # immutable: one Attr for both
    assert one.attrs["trainer_id"] == two.attrs["trainer_id"]
    other = catalogue.make_op("send", {"X": ["c"]}, {"Out": ["d"]}, {"epmap": ["f"], "trainer_id": 3})
    assert other.attr("trainer_id") == 3 and three.attr("trainer_id") == 0
    concat = catalogue.make_op("concat", {"X": ["a", "b"]}, {"Out": ["p"]}, {"axis": 0})
    assert concat.attr_type("axis") == AttrType.INT and concat.attr("axis") == 0
    with pytest.raises(OpSpecError):  # a bool is no INT, cached scalar or not
        catalogue.make_op("concat", {"X": ["a", "b"]}, {"Out": ["p"]}, {"axis": True})
