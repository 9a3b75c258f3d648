"""Angel's custom-partitioner example: a [3, 10,000,000] matrix on 8 pservers, row 0 cut
into 4 column partitions, rows 1 and 2 into 2 each (8 partitions, one per pserver).

    python3 examples/angel_custom_partitioner.py            # prints the plan of that matrix
    pstranspile plan main.pb --pservers ... --trainers 2 \\
        --partitioner angel_custom_partitioner:ThreeBands   # the same cut on any program
                                                            # (examples/ on PYTHONPATH)

`ThreeBands` generalises it to any param: rows in three bands (`[0, ceil(R/3))`,
`[ceil(R/3), ceil(2R/3))`, the rest), the first cut into 4 column ranges and the others
into 2 (fewer when the param has fewer columns); partition i on pserver `i % S`. A
program of Angel's matrix: `x[3]` times a `[3, 10M]` weight (`w`), trained by SGD; only
declared, never allocated (the transpile does not touch values).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

try:
    import transpiler  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transpiler.partition import Partition, Partitioner


def _columns(rows: tuple[int, int], cols: int, parts: int) -> list[Partition]:
    parts = max(1, min(parts, cols))
    base, extra = divmod(cols, parts)
    out, start = [], 0
    for i in range(parts):
        width = base + (1 if i < extra else 0)
        out.append(Partition(rows[0], rows[1], start, start + width))
        start += width
    return out


class ThreeBands(Partitioner):
    """Angel's documented custom example, for any param (see the module docstring)."""

    name = "three_bands"
    COLUMN_PARTS = (4, 2, 2)

    def partitions(self, param):
        rows, cols = param.rows, param.cols
        if len(param.shape) > 2 and (param.sparse or param.table):
            cols_parts = (1, 1, 1)  # a rank-3+ table is cut by rows only
        else:
            cols_parts = self.COLUMN_PARTS  # a rank-3+ dense param: columns of [d0, d1 * d2 * ...]
        edges = sorted({0, math.ceil(rows / 3), math.ceil(2 * rows / 3), rows})
        out = []
        for band, (start, end) in enumerate(zip(edges, edges[1:])):
            out.extend(_columns((start, end), cols, cols_parts[min(band, 2)]))
        return out

    def assign(self, partitions):
        return [i % self.servers for i in range(len(partitions))]


def angel_matrix(rows: int = 3, cols: int = 10_000_000):
    """The example's program: loss = mean(x @ w), w [rows, cols], SGD."""
    from transpiler.frontend import ParamAttr, Program, data, layers, optimizer, program_guard, unique_name

    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        x = data(name="x", shape=[None, rows], dtype="float32")
        y = layers.fc(input=x, size=cols, param_attr=ParamAttr(name="w"), bias_attr=False)
        loss = layers.mean(y)
        optimizer.SGD(learning_rate=0.1).minimize(loss)
    return main, startup


def main() -> int:
    from transpiler.api import transpile
    from transpiler.plan import format_plan

    program, startup = angel_matrix()
    pservers = ",".join(f"127.0.0.1:{6170 + i}" for i in range(8))
    result = transpile(program, startup, pservers=pservers, trainers=2, partitioner=ThreeBands)
    print(format_plan(result.plan), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
