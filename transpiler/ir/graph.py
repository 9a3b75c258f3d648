"""The dependency graph of one block's ops, as a networkx `DiGraph`.

A `ProgramDesc` is not SSA (`sgd` writes `ParamOut` into the var it reads as `Param`),
so three kinds of edge order the ops, each labelled with the var that causes it:

* `raw` (read after write): the last writer of `v` → a later reader of `v`;
* `war` (write after read): a reader of `v` → the next writer of `v`;
* `waw` (write after write): a writer of `v` → the next writer of `v`.

Nodes are the `Op` objects (with their position as node attr `index`); edge attr `deps`
lists `(kind, var)` pairs in discovery order. Building is linear in the number of slot
arguments. The graph is a view: it is rebuilt after any edit of the block and editing it
does not change the program (edit through `Block`).

Dependencies carried by sub-blocks (a `conditional_block` whose sub-block reads a var
the op does not list) are not edges; Fluid lists them in the op's own slots.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import networkx as nx

from transpiler.errors import IRError
from transpiler.ir.program import Block, Op

RAW, WAR, WAW = "raw", "war", "waw"


class BlockGraph:
    def __init__(self, block: Block) -> None:
        # Weak, as the block caches its graph: no cycle through the block (networkx's own
        # cached views are cycles, which the GC frees, but they do not hold the program).
        self._block = block._ref
        self.nx = nx.DiGraph()
        ops = block.ops
        last_writer: dict[str, Op] = {}
        readers_since_write: dict[str, list[Op]] = {}
        for index, op in enumerate(ops):
            self.nx.add_node(op, index=index)
            for name in dict.fromkeys(op.input_names):
                writer = last_writer.get(name)
                if writer is not None and writer is not op:
                    self._add(writer, op, RAW, name)
                readers_since_write.setdefault(name, []).append(op)
            for name in dict.fromkeys(op.output_names):
                for reader in readers_since_write.get(name, ()):
                    if reader is not op:
                        self._add(reader, op, WAR, name)
                writer = last_writer.get(name)
                if writer is not None and writer is not op:
                    self._add(writer, op, WAW, name)
                last_writer[name] = op
                readers_since_write[name] = []

    def _add(self, src: Op, dst: Op, kind: str, var: str) -> None:
        data = self.nx.get_edge_data(src, dst)
        if data is None:
            self.nx.add_edge(src, dst, deps=[(kind, var)])
        elif (kind, var) not in data["deps"]:
            data["deps"].append((kind, var))

    @property
    def block(self) -> Block:
        block = self._block()
        if block is None:
            raise IRError("the block of this graph is gone")
        return block

    # -- queries
    def index(self, op: Op) -> int:
        return self.nx.nodes[op]["index"]

    def producers(self, name: str) -> list[Op]:
        """Ops that write `name`, in op order."""
        return self.block.writers(name)

    def consumers(self, name: str) -> list[Op]:
        """Ops that read `name`, in op order."""
        return self.block.readers(name)

    def deps(self, src: Op, dst: Op) -> list[tuple[str, str]]:
        """The `(kind, var)` pairs that order `dst` after `src` directly ([] if none)."""
        data = self.nx.get_edge_data(src, dst)
        return list(data["deps"]) if data else []

    def predecessors(self, op: Op) -> list[Op]:
        return sorted(self.nx.predecessors(op), key=self.index)

    def successors(self, op: Op) -> list[Op]:
        return sorted(self.nx.successors(op), key=self.index)

    def ancestors(self, op: Op) -> list[Op]:
        return sorted(nx.ancestors(self.nx, op), key=self.index)

    def descendants(self, op: Op) -> list[Op]:
        return sorted(nx.descendants(self.nx, op), key=self.index)

    def edges(self) -> Iterable[tuple[Op, Op, list[tuple[str, str]]]]:
        """Every edge as (src, dst, deps), ordered by (src, dst) position."""
        ordered = sorted(self.nx.edges(data="deps"), key=lambda e: (self.index(e[0]), self.index(e[1])))
        return [(src, dst, list(deps)) for src, dst, deps in ordered]

    def topological_order(self, key: Callable[[Op], Any] | None = None) -> list[Op]:
        """A topological order of the ops; among ops that are free at the same time the
        smallest `key` goes first (default: current position).

        With the default key this gives back the current order exactly (every edge
        points forward), so emitting a block this way is stable. A pass that wants ops
        scheduled differently (say, every `send` as early as its inputs allow) passes a
        key and then calls `Block.reorder` with the result.
        """
        rank = self.index if key is None else (lambda op: (key(op), self.index(op)))
        return list(nx.lexicographical_topological_sort(self.nx, key=rank))


def reorder_block(block: Block, order: Iterable[Op]) -> None:
    """Relink `block`'s ops in `order`, which must be a permutation of them that keeps
    every dependency edge pointing forward (raises `IRError` otherwise)."""
    order = list(order)
    current = block.ops
    if len(order) != len(current) or set(order) != set(current):
        raise IRError(f"reorder of block {block.idx} must list each of its {len(current)} ops exactly once")
    position = {op: i for i, op in enumerate(order)}
    for src, dst in block.graph().nx.edges():
        if position[src] > position[dst]:
            kinds = ", ".join(f"{k} {v}" for k, v in block.graph().deps(src, dst))
            raise IRError(
                f"reorder of block {block.idx} puts {dst.type} before {src.type}, which it depends on ({kinds})"
            )
    block._relink(order)
