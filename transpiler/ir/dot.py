"""Graphviz DOT drawing of a program's op graph.

One cluster per block; op nodes labelled `index: type`, filled by `OpRole` so the parts a
transpiler moves (backward, optimize, RPC, lr-schedule) stand out; the loss op gets a
double border. Edges are the read-after-write edges of `Block.graph()`, labelled with
the vars that flow along them (WAR / WAW edges only order ops and would bury the data
flow). An op with a BLOCK / BLOCKS attr gets a dashed edge to its sub-block's cluster.

The output is deterministic: nodes, edges and attributes come out in op order, never
from a set, so a drawing can be diffed or kept as a golden file.
"""

from __future__ import annotations

from collections.abc import Iterable

from transpiler.ir.graph import RAW
from transpiler.ir.program import Block, Op, Program
from transpiler.ir.types import OpRole

# Role classes in the order that decides an op's colour when it has several bits
# (Fluid marks some lr-decay ops Optimize|LRSched: they are lr-schedule ops).
ROLE_CLASSES: tuple[tuple[str, OpRole, str], ...] = (
    ("rpc", OpRole.RPC, "#d9c8f0"),
    ("dist", OpRole.Dist, "#f5c6cb"),
    ("lr-schedule", OpRole.LRSched, "#ffe8a1"),
    ("optimize", OpRole.Optimize, "#c3e6cb"),
    ("backward", OpRole.Backward, "#ffd8b1"),
)
FORWARD_COLOUR = "#cfe2ff"
MAX_EDGE_LABEL_VARS = 3


def role_class(op: Op) -> str:
    """`forward`, `backward`, `optimize`, `rpc`, `dist` or `lr-schedule`."""
    role = op.role
    for name, flag, _colour in ROLE_CLASSES:
        if role & flag:
            return name
    return "forward"


def _colour(name: str) -> str:
    for cls, _flag, colour in ROLE_CLASSES:
        if cls == name:
            return colour
    return FORWARD_COLOUR


def quote(text: str) -> str:
    """A DOT double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _node_id(block: int, index: int) -> str:
    return f"b{block}_op{index}"


def _edge_label(names: list[str]) -> str:
    shown = names[:MAX_EDGE_LABEL_VARS]
    if len(names) > len(shown):
        shown.append(f"(+{len(names) - len(shown)} more)")
    return "\n".join(shown)


def to_dot(program: Program, *, block: int | None = None, name: str = "program") -> str:
    """DOT text for one block (`block=N`) or all blocks (each a cluster)."""
    blocks = program.blocks if block is None else (program.block(block),)
    drawn = {b.idx for b in blocks}
    lines = [
        f"digraph {quote(name)} {{",
        "  graph [rankdir=TB, compound=true, fontname=\"Helvetica\", fontsize=11];",
        "  node [shape=box, style=\"rounded,filled\", fontname=\"Helvetica\", fontsize=10];",
        "  edge [fontname=\"Helvetica\", fontsize=8, color=\"#555555\"];",
    ]
    edges: list[str] = []
    for blk in blocks:
        lines.extend(_cluster(blk))
        edges.extend(_data_edges(blk))
        edges.extend(_sub_block_edges(program, blk, drawn))
    lines.extend(edges)
    lines.extend(_legend())
    lines.append("}")
    return "\n".join(lines) + "\n"


def _cluster(block: Block) -> Iterable[str]:
    yield f"  subgraph cluster_b{block.idx} {{"
    yield f"    label={quote(f'block {block.idx} (parent {block.parent_idx}, {len(block)} ops)')};"
    yield "    style=rounded; color=\"#999999\";"
    if len(block) == 0:
        yield f"    {_anchor_id(block)} [label=\"(no ops)\", shape=plaintext, style=\"\"];"
    for index, op in enumerate(block.ops):
        cls = role_class(op)
        attrs = [f"label={quote(f'{index}: {op.type}' + (chr(10) + '(loss)' if op.role & OpRole.Loss else ''))}"]
        attrs.append(f"fillcolor={quote(_colour(cls))}")
        attrs.append(f"tooltip={quote(op.role.describe())}")
        if op.role & OpRole.Loss:
            attrs.append("peripheries=2")
            attrs.append("penwidth=2")
        yield f"    {_node_id(block.idx, index)} [{', '.join(attrs)}];"
    yield "  }"


def _anchor_id(block: Block) -> str:
    return f"b{block.idx}_empty"


def _entry_id(block: Block) -> str:
    return _node_id(block.idx, 0) if len(block) else _anchor_id(block)


def _data_edges(block: Block) -> Iterable[str]:
    graph = block.graph()
    for src, dst, deps in graph.edges():
        names = list(dict.fromkeys(var for kind, var in deps if kind == RAW))
        if not names:
            continue
        src_id = _node_id(block.idx, graph.index(src))
        dst_id = _node_id(block.idx, graph.index(dst))
        yield f"  {src_id} -> {dst_id} [label={quote(_edge_label(names))}];"


def _sub_block_edges(program: Program, block: Block, drawn: set[int]) -> Iterable[str]:
    for index, op in enumerate(block.ops):
        for target in op.sub_block_indices():
            if target not in drawn or not 0 <= target < program.num_blocks or target == block.idx:
                continue
            sub = program.blocks[target]
            yield (
                f"  {_node_id(block.idx, index)} -> {_entry_id(sub)} "
                f"[style=dashed, color=\"#888888\", lhead=cluster_b{target}, label=\"block[{target}]\"];"
            )


def _legend() -> Iterable[str]:
    yield "  subgraph cluster_legend {"
    yield "    label=\"op role\"; style=rounded; color=\"#cccccc\"; fontsize=10;"
    entries = [("forward", FORWARD_COLOUR)] + [(cls, colour) for cls, _flag, colour in reversed(ROLE_CLASSES)]
    previous = None
    for cls, colour in entries:
        node = "legend_" + cls.replace("-", "_")
        yield f"    {node} [label={quote(cls)}, fillcolor={quote(colour)}];"
        if previous is not None:
            yield f"    {previous} -> {node} [style=invis];"
        previous = node
    yield f"    legend_loss [label=\"loss\", fillcolor={quote(FORWARD_COLOUR)}, peripheries=2, penwidth=2];"
    yield f"    {previous} -> legend_loss [style=invis];"
    yield "  }"
