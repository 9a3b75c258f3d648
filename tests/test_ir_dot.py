"""DOT drawing: deterministic, coloured by role, RAW edges labelled with their vars."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from conftest import PADDLE_PROGRAMS
from transpiler.ir import Attr, AttrType, Program
from transpiler.ir.dot import FORWARD_COLOUR, ROLE_CLASSES, quote, role_class, to_dot
from transpiler.ir.types import OpRole

PIECEWISE = PADDLE_PROGRAMS / "fluid18_lr_piecewise_2ps" / "main.pb"
COLOUR = {name: colour for name, _flag, colour in ROLE_CLASSES} | {"forward": FORWARD_COLOUR}


def _node(text: str, node_id: str) -> str:
    (line,) = [line for line in text.splitlines() if line.strip().startswith(f"{node_id} [")]
    return line


def _edges(text: str) -> list[tuple[str, str, str]]:
    return re.findall(r"^\s*(b\d+_\w+) -> (b\d+_\w+) \[(.*)\];$", text, flags=re.M)


def test_dot_golden(golden):
    golden.check("dot/fluid18_lr_piecewise_2ps.main.dot", to_dot(Program.load(PIECEWISE), name="main.pb"))


def test_dot_is_deterministic():
    program = Program.load(PADDLE_PROGRAMS / "mlp_adam_2ps" / "main.pb")
    first = to_dot(program)
    assert to_dot(Program.load(PADDLE_PROGRAMS / "mlp_adam_2ps" / "main.pb")) == first
    assert to_dot(program.clone()) == first


@pytest.mark.parametrize(
    ("role", "cls"),
    [
        (OpRole.Forward, "forward"),
        (OpRole.Backward, "backward"),
        (OpRole.Optimize, "optimize"),
        (OpRole.RPC, "rpc"),
        (OpRole.Dist, "dist"),
        (OpRole.LRSched, "lr-schedule"),
        (OpRole.Optimize | OpRole.LRSched, "lr-schedule"),
        (OpRole.Backward | OpRole.Loss, "backward"),
        (OpRole.Loss, "forward"),
    ],
)
def test_ops_are_coloured_by_role(role, cls):
    program = Program.empty()
    op = program.global_block().add_op("x", attrs={"op_role": int(role)})
    assert role_class(op) == cls
    line = _node(to_dot(program), "b0_op0")
    assert f'fillcolor="{COLOUR[cls]}"' in line
    assert ("peripheries=2" in line) == bool(role & OpRole.Loss)
    assert ("(loss)" in line) == bool(role & OpRole.Loss)


def test_every_role_class_has_its_own_colour_and_a_legend_entry():
    colours = list(COLOUR.values())
    assert len(set(colours)) == len(colours) == 6
    text = to_dot(Program.empty())
    for cls in COLOUR:
        assert f'label="{cls}", fillcolor="{COLOUR[cls]}"' in text
    assert "legend_loss" in text


def test_raw_edges_carry_var_names_and_war_edges_are_not_drawn():
    program = Program.empty()
    block = program.global_block()
    for name in ("w", "g", "x", "y"):
        block.create_var(name, dtype="float32", shape=[1])
    block.add_op("mul", {"X": "x", "Y": "w"}, {"Out": "y"})  # 0
    block.add_op("grad", {"X": "y", "Y": "w"}, {"Out": "g"})  # 1: RAW y
    block.add_op("sgd", {"Param": "w", "Grad": "g"}, {"ParamOut": "w"})  # 2: RAW g from 1, WAR w from 0 and 1
    assert _edges(to_dot(program)) == [
        ("b0_op0", "b0_op1", 'label="y"'),
        ("b0_op1", "b0_op2", 'label="g"'),
    ]


def test_an_edge_with_many_vars_is_labelled_briefly():
    program = Program.empty()
    block = program.global_block()
    names = [f"v{i}" for i in range(5)]
    block.add_op("split", outputs={"Out": names})
    block.add_op("concat", {"X": names})
    ((_src, _dst, label),) = _edges(to_dot(program))
    assert label == 'label="v0\\nv1\\nv2\\n(+2 more)"'


def test_sub_blocks_are_clusters_linked_from_their_op():
    text = to_dot(Program.load(PIECEWISE))
    assert [line.strip() for line in text.splitlines() if "subgraph cluster_b" in line] == [
        f"subgraph cluster_b{i} {{" for i in range(4)
    ]
    links = [e for e in _edges(text) if "lhead" in e[2]]
    assert [(src, dst) for src, dst, _ in links] == [
        ("b0_op11", "b1_op0"),
        ("b0_op18", "b2_op0"),
        ("b0_op20", "b3_op0"),
    ]
    assert all("style=dashed" in attrs for _s, _d, attrs in links)


def test_one_block_only():
    text = to_dot(Program.load(PIECEWISE), block=2)
    assert "cluster_b2" in text and "cluster_b0" not in text and "b0_op" not in text
    text = to_dot(Program.load(PIECEWISE), block=0)
    assert not [e for e in _edges(text) if "lhead" in e[2]], "no link to an undrawn block"


def test_an_empty_block_gets_a_placeholder_the_link_can_reach():
    program = Program.empty()
    sub = program.create_block(0)
    program.global_block().add_op("while", attrs={"sub_block": Attr.of(sub.idx, AttrType.BLOCK)})
    text = to_dot(program)
    assert 'b1_empty [label="(no ops)"' in text
    assert [(s, d) for s, d, _ in _edges(text)] == [("b0_op0", "b1_empty")]


def test_quoting():
    assert quote('a"b\\c\nd') == '"a\\"b\\\\c\\nd"'
    program = Program.empty()
    program.global_block().add_op('we"ird')
    assert '[label="0: we\\"ird"' in to_dot(program, name='x"y')
    assert to_dot(program, name='x"y').startswith('digraph "x\\"y" {')


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_graphviz_accepts_the_output(tmp_path):
    done = subprocess.run(["dot", "-Tsvg"], input=to_dot(Program.load(PIECEWISE)), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "<svg" in done.stdout and not done.stderr.strip()
