"""The dependency graph: RAW / WAR / WAW edges, stable topological order, reorder."""

from __future__ import annotations

import pytest

from conftest import PADDLE_PROGRAMS
from transpiler.errors import IRError
from transpiler.ir import Program
from transpiler.ir.graph import RAW, WAR, WAW


def _block(*var_names: str):
    program = Program.empty()
    block = program.global_block()
    for name in var_names:
        block.create_var(name, dtype="float32", shape=[1])
    return block


def _edges(block) -> list[tuple[int, int, list[tuple[str, str]]]]:
    graph = block.graph()
    return [(graph.index(s), graph.index(d), deps) for s, d, deps in graph.edges()]


def test_raw_war_waw_edges():
    block = _block("a", "b", "c")
    block.add_op("w_a", outputs={"Out": "a"})  # 0
    block.add_op("r_a", {"X": "a"}, {"Out": "b"})  # 1: RAW a from 0
    block.add_op("w_a2", {"X": "c"}, {"Out": "a"})  # 2: WAR a after 1, WAW a after 0
    block.add_op("r_ab", {"X": ["a", "b"]}, {"Out": "c"})  # 3: RAW a from 2, b from 1; WAR c after 2
    assert _edges(block) == [
        (0, 1, [(RAW, "a")]),
        (0, 2, [(WAW, "a")]),
        (1, 2, [(WAR, "a")]),
        (1, 3, [(RAW, "b")]),
        (2, 3, [(RAW, "a"), (WAR, "c")]),
    ]


def test_in_place_op_sgd_style():
    """sgd reads Param and writes ParamOut = Param: every earlier reader must precede it."""
    block = _block("w", "g", "x", "y")
    mul = block.add_op("mul", {"X": "x", "Y": "w"}, {"Out": "y"})
    grad = block.add_op("mul_grad", {"Y": "w", "X": "x"}, {"Y@GRAD": "g"})
    sgd = block.add_op("sgd", {"Param": "w", "Grad": "g"}, {"ParamOut": "w"})
    graph = block.graph()
    assert graph.deps(mul, sgd) == [(WAR, "w")]
    assert graph.deps(grad, sgd) == [(RAW, "g"), (WAR, "w")]
    assert graph.predecessors(sgd) == [mul, grad]
    assert graph.successors(mul) == [sgd]
    assert graph.deps(sgd, mul) == []
    assert graph.producers("w") == [sgd] and graph.consumers("w") == [mul, grad, sgd]


def test_an_op_reading_and_writing_the_same_var_has_no_self_edge():
    block = _block("a")
    op = block.add_op("increment", {"X": "a"}, {"Out": "a"})
    again = block.add_op("increment", {"X": "a"}, {"Out": "a"})
    graph = block.graph()
    assert not graph.nx.has_edge(op, op)
    # The first op's read happened before its own write, so no WAR edge is needed.
    assert graph.deps(op, again) == [(RAW, "a"), (WAW, "a")]


def test_duplicate_arguments_give_one_dependency():
    block = _block("a", "b")
    w = block.add_op("w", outputs={"Out": "a"})
    r = block.add_op("r", {"X": ["a", "a"], "Y": "a"}, {"Out": "b"})
    assert block.graph().deps(w, r) == [(RAW, "a")]


def test_graph_is_rebuilt_after_an_edit():
    block = _block("a", "b")
    w = block.add_op("w", outputs={"Out": "a"})
    r = block.add_op("r", {"X": "b"})
    first = block.graph()
    assert block.graph() is first and first.deps(w, r) == []
    r.set_input("X", "a")
    assert block.graph() is not first and block.graph().deps(w, r) == [(RAW, "a")]


def test_ancestors_and_descendants():
    block = _block("a", "b", "c", "d")
    ops = [
        block.add_op("p", outputs={"Out": "a"}),
        block.add_op("q", {"X": "a"}, {"Out": "b"}),
        block.add_op("unrelated", outputs={"Out": "d"}),
        block.add_op("r", {"X": "b"}, {"Out": "c"}),
    ]
    graph = block.graph()
    assert graph.ancestors(ops[3]) == [ops[0], ops[1]]
    assert graph.descendants(ops[0]) == [ops[1], ops[3]]
    assert graph.ancestors(ops[2]) == [] and graph.descendants(ops[2]) == []


def test_fixture_graph_orders_sgd_after_its_readers():
    program = Program.load(PADDLE_PROGRAMS / "fluid18_basic_sgd_2ps" / "main.pb")
    block = program.global_block()
    graph = block.graph()
    assert graph.nx.number_of_nodes() == len(block)
    sgd_w = next(op for op in block.ops if op.type == "sgd" and op.input("Param") == ("fc_w",))
    mul = next(op for op in block.ops if op.type == "mul")
    mul_grad = next(op for op in block.ops if op.type == "mul_grad")
    assert graph.deps(mul, sgd_w) == [(WAR, "fc_w")]
    assert (RAW, "fc_w@GRAD") in graph.deps(mul_grad, sgd_w)
    assert graph.deps(mul, mul_grad) == []  # mul_grad reads mul's inputs, not its output
    # Every edge points forward in a program Paddle built.
    assert all(graph.index(s) < graph.index(d) for s, d, _ in graph.edges())
    kinds = {kind for _s, _d, deps in graph.edges() for kind, _v in deps}
    assert kinds == {RAW, WAR}


@pytest.mark.parametrize("case", ["mlp_adam_2ps", "fluid18_lr_piecewise_2ps", "ctr_v1_dist_sgd_2ps"])
def test_topological_order_of_a_fixture_is_its_order(case):
    program = Program.load(PADDLE_PROGRAMS / case / "main.pb")
    for block in program.blocks:
        assert block.graph().topological_order() == list(block.ops)


def test_topological_order_is_stable_and_keyed():
    block = _block("a", "b", "c")
    w = block.add_op("w", outputs={"Out": "a"})
    x = block.add_op("x", outputs={"Out": "b"})
    r = block.add_op("r", {"X": "a"}, {"Out": "c"})
    y = block.add_op("y")
    graph = block.graph()
    assert graph.topological_order() == [w, x, r, y]
    assert graph.topological_order() == graph.topological_order()
    # Key: bring `r` (and so its dependency `w`) as early as possible, others by position.
    early = graph.topological_order(key=lambda op: 0 if op.type in ("r", "w") else 1)
    assert early == [w, r, x, y]
    late = graph.topological_order(key=lambda op: -graph.index(op))
    assert late == [y, x, w, r]


def test_reorder_with_a_key():
    block = _block("g1", "g2", "w")
    grads = [block.add_op("grad", outputs={"Out": g}) for g in ("g1", "g2")]
    block.add_op("compute", {"X": "w"}, {"Out": "w"})
    sends = [block.add_op("send", {"X": g}) for g in ("g1", "g2")]
    # Every send as early as its inputs allow.
    order = block.graph().topological_order(key=lambda op: 0 if op.type == "send" else 1)
    block.reorder(order)
    assert [op.type for op in block.ops] == ["grad", "send", "grad", "send", "compute"]
    assert block.ops[1] is sends[0] and block.ops[2] is grads[1]
    assert [op.index for op in block.ops] == list(range(5))
    assert block.readers("g2") == [sends[1]]


def test_reorder_rejects_an_order_that_breaks_a_dependency():
    block = _block("a", "b")
    w = block.add_op("w", outputs={"Out": "a"})
    r = block.add_op("r", {"X": "a"}, {"Out": "b"})
    with pytest.raises(IRError, match=r"puts r before w.*raw a"):
        block.reorder([r, w])
    assert list(block.ops) == [w, r], "a rejected reorder changes nothing"


def test_reorder_rejects_a_war_violation():
    block = _block("a")
    r = block.add_op("r", {"X": "a"})
    w = block.add_op("w", outputs={"Out": "a"})
    with pytest.raises(IRError, match="war a"):
        block.reorder([w, r])


def test_reorder_rejects_something_other_than_a_permutation():
    block = _block()
    a, b = block.add_op("a"), block.add_op("b")
    with pytest.raises(IRError, match="exactly once"):
        block.reorder([a])
    with pytest.raises(IRError, match="exactly once"):
        block.reorder([a, a])
    with pytest.raises(IRError, match="exactly once"):
        block.reorder([a, b, block.add_op("c").clone()])
