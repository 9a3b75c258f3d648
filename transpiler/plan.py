"""The partition plan: how each parameter is cut into blocks and where each block lives.

The plan is the single record of "where did this var come from": passes read names from
it rather than re-parsing `.block<i>` / `.trainer_<id>` suffixes. It depends only on the
program, the endpoints and the options, never on the trainer id, so every trainer that
transpiles independently computes the same placement (`plan.json` lets you check).

Slicing (`slice_var_up`): per var, `max = max(1, floor(numel / min_block_size))`,
`count = min(#pservers, max)`, `block = ceil(numel / count)` rounded up to whole rows
(a multiple of `prod(shape[1:])`), `count = ceil(numel / block)`; the last block may be
shorter. The Fluid design doc says "round up" for `max`, but its own rule that no block
be smaller than `min_block_size`, and Paddle's code, both give floor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from transpiler import naming
from transpiler.errors import TranspileError
from transpiler.ir.types import DType


def slice_sizes(shape: tuple[int, ...], slice_count: int, min_block_size: int) -> list[int]:
    """Element counts of the blocks a var of `shape` is cut into (Paddle's `slice_variable`)."""
    if min_block_size < 1:
        raise TranspileError(f"min_block_size must be at least 1, got {min_block_size}")
    numel = math.prod(shape)
    if numel <= 0:
        return [numel]
    max_count = max(1, numel // min_block_size)
    count = min(slice_count, max_count)
    block = math.ceil(numel / count)
    row_width = math.prod(shape[1:]) if len(shape) >= 2 else 1
    if block % row_width:
        block += row_width - block % row_width
    count = math.ceil(numel / block)
    return [min(block, numel - i * block) for i in range(count)]


@dataclass(frozen=True)
class VarBlock:
    """One block (partition) of a var: rows `[row_offset, row_offset + rows)` of its first
    dimension and, when `cols` is set, columns `[col_offset, col_offset + cols)` of the
    product of the others (a 2-D partition, `transpiler.partition`); `cols=None` is a
    block of whole rows, Paddle's.

    `name` is the block var's name (`fc_w.block1`, or the var itself when it is not cut),
    which is what dispatchers see (`block.name`).
    """

    origin: str
    index: int
    row_offset: int
    rows: int
    shape: tuple[int, ...]
    name: str
    col_offset: int = 0
    cols: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def cuts_columns(self) -> bool:
        return self.cols is not None


@dataclass
class ParamPlan:
    """Placement of one parameter (and of the grad the trainer sends for it)."""

    param: str
    grad: str
    shape: tuple[int, ...]
    dtype: DType
    optimizer: str
    blocks: list[VarBlock] = field(default_factory=list)
    endpoints: list[str] = field(default_factory=list)  # one per block
    sparse: bool = False  # SELECTED_ROWS grads (an is_sparse embedding table)
    remote_prefetch: bool = False  # trainers fetch rows from the blocks instead of receiving the table
    # The trainer merges the sparse grad's rows before sending (it sums several lookups'
    # grads, a MergeAdd): a trainer sends a row per distinct id, not per lookup. Read from
    # the trainer program; the cost model's grad rows (not in the plan's JSON).
    merged_grad: bool = False
    # The distributed lookup table (`is_distributed`) cut by a partitioner: each block is an
    # auto-grown SELECTED_ROWS piece on its pserver (rows created on first touch, addressed
    # by `id - row_offset`), prefetched like a `remote_prefetch` table.
    distributed: bool = False

    @property
    def sliced(self) -> bool:
        return len(self.blocks) > 1

    @property
    def cuts_columns(self) -> bool:
        """Some block holds a column range only (a 2-D partition)."""
        return any(b.cuts_columns for b in self.blocks)

    def bands(self) -> list[list[VarBlock]]:
        """The blocks grouped by row range, in row order (each band's blocks in column order)."""
        bands: list[list[VarBlock]] = []
        for b in self.blocks:
            if bands and bands[-1][0].row_offset == b.row_offset:
                bands[-1].append(b)
            else:
                bands.append([b])
        return bands

    def grad_block_name(self, index: int) -> str:
        """The merged grad of block `index` as the pserver names it."""
        return naming.block_name(self.grad, index) if self.sliced else self.grad

    def blocks_on(self, endpoint: str) -> list[VarBlock]:
        return [b for b, ep in zip(self.blocks, self.endpoints, strict=True) if ep == endpoint]


@dataclass
class TablePlan:
    """The distributed lookup table: pserver `i` of `M` holds the rows with `id % M == i`
    (at most `shard_rows` of them, created on first use)."""

    table: str
    grad: str
    shape: tuple[int, ...]
    dtype: DType
    endpoints: tuple[str, ...]
    padding_idx: int = -1
    merged_grad: bool = False  # the trainer sends a row per distinct id (`ParamPlan.merged_grad`)

    @property
    def shard_rows(self) -> int:
        return math.ceil(self.shape[0] / len(self.endpoints))

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.shard_rows, *self.shape[1:])

    def shard_grad_name(self, shard: int, trainer: int | None) -> str:
        """What a trainer calls the rows of the table grad it sends to pserver `shard`."""
        grad = self.grad if trainer is None else naming.trainer_name(self.grad, trainer)
        return naming.shard_name(grad, shard)

    @staticmethod
    def prefetch_in(shard: int) -> str:
        return naming.prefetch_in(shard)

    @staticmethod
    def prefetch_out(shard: int) -> str:
        return naming.prefetch_out(shard)


@dataclass
class Plan:
    endpoints: tuple[str, ...]
    trainers: int
    sync_mode: bool
    slice_var_up: bool
    split_method: str
    min_block_size: int
    params: list[ParamPlan] = field(default_factory=list)
    table: TablePlan | None = None
    partitioner: str = "paddle"

    @property
    def cuts_columns(self) -> bool:
        return any(p.cuts_columns for p in self.params)

    @property
    def per_trainer_grads(self) -> bool:
        """Sync mode with several trainers: each trainer's grad arrives as `<grad>.trainer_<id>`."""
        return self.sync_mode and self.trainers > 1

    def param(self, name: str) -> ParamPlan:
        for plan in self.params:
            if plan.param == name:
                return plan
        raise KeyError(name)

    def trainer_grad_name(self, param: ParamPlan, index: int, trainer: int) -> str:
        """What trainer `trainer` calls the grad of block `index` it sends."""
        base = param.grad_block_name(index)
        return naming.trainer_name(base, trainer) if self.per_trainer_grads else base

    def trainer_grad_names(self, param: ParamPlan, index: int) -> list[str]:
        """`trainer_grad_name` of block `index` for every trainer, in trainer order (what a
        sync pserver sums), the block's name worked out once."""
        base = param.grad_block_name(index)
        if not self.per_trainer_grads:
            return [base] * self.trainers
        return [naming.trainer_name(base, trainer) for trainer in range(self.trainers)]

    def on(self, endpoint: str) -> list[tuple[ParamPlan, VarBlock]]:
        """Every (param, block) placed on `endpoint`, in param order."""
        return [(p, b) for p in self.params for b in p.blocks_on(endpoint)]

    def by_endpoint(self) -> dict[str, list[tuple[ParamPlan, VarBlock]]]:
        """`on(endpoint)` for every endpoint holding a block, in one walk of the params
        (rather than one per endpoint)."""
        placed: dict[str, list[tuple[ParamPlan, VarBlock]]] = {}
        for param in self.params:
            for block, endpoint in zip(param.blocks, param.endpoints, strict=True):
                found = placed.get(endpoint)
                if found is None:
                    placed[endpoint] = [(param, block)]
                else:
                    found.append((param, block))
        return placed

    # -- reports
    def load_by_endpoint(self) -> list[dict[str, Any]]:
        """Per endpoint: blocks, elements, bytes and share of the total."""
        rows = {ep: {"endpoint": ep, "blocks": 0, "elements": 0, "bytes": 0} for ep in self.endpoints}
        for param in self.params:
            itemsize = param.dtype.itemsize
            for block, ep in zip(param.blocks, param.endpoints, strict=True):
                rows[ep]["blocks"] += 1
                rows[ep]["elements"] += block.numel
                rows[ep]["bytes"] += block.numel * itemsize
        if self.table is not None:
            itemsize = self.table.dtype.itemsize
            for ep in self.table.endpoints:
                rows[ep]["blocks"] += 1
                rows[ep]["elements"] += math.prod(self.table.shard_shape)
                rows[ep]["bytes"] += math.prod(self.table.shard_shape) * itemsize
        total = sum(r["elements"] for r in rows.values()) or 1
        for row in rows.values():
            row["share"] = row["elements"] / total
        return list(rows.values())

    def imbalance(self) -> float:
        """max / mean elements per endpoint (1.0 is perfect balance)."""
        elements = [row["elements"] for row in self.load_by_endpoint()]
        mean = sum(elements) / len(elements)
        return max(elements) / mean if mean else 1.0

    def to_json(self) -> dict[str, Any]:
        out = self._to_json()
        if self.partitioner != "paddle" or self.cuts_columns:  # a paddle plan's json as it always was
            out["partitioner"] = self.partitioner
            for param, entry in zip(self.params, out["params"], strict=True):
                entry["grid"] = [len(band) for band in param.bands()]
                for block, blk in zip(param.blocks, entry["blocks"], strict=True):
                    blk["col_offset"] = block.col_offset
                    blk["cols"] = block.cols if block.cols is not None else math.prod(param.shape[1:])
                if param.distributed:
                    entry["distributed"] = True
        return out

    def _to_json(self) -> dict[str, Any]:
        return {
            "endpoints": list(self.endpoints),
            "trainers": self.trainers,
            "sync_mode": self.sync_mode,
            "slice_var_up": self.slice_var_up,
            "split_method": self.split_method,
            "min_block_size": self.min_block_size,
            "imbalance": round(self.imbalance(), 6),
            "load": self.load_by_endpoint(),
            "params": [
                {
                    "param": p.param,
                    "grad": p.grad,
                    "shape": list(p.shape),
                    "dtype": p.dtype.name,
                    "optimizer": p.optimizer,
                    "sparse": p.sparse,
                    "remote_prefetch": p.remote_prefetch,
                    "blocks": [
                        {
                            "name": b.name,
                            "grad": p.grad_block_name(b.index),
                            "index": b.index,
                            "endpoint": ep,
                            "row_offset": b.row_offset,
                            "rows": b.rows,
                            "shape": list(b.shape),
                        }
                        for b, ep in zip(p.blocks, p.endpoints, strict=True)
                    ],
                }
                for p in self.params
            ],
            "table": None
            if self.table is None
            else {
                "table": self.table.table,
                "grad": self.table.grad,
                "shape": list(self.table.shape),
                "dtype": self.table.dtype.name,
                "sharding": "id % pservers",
                "shard_shape": list(self.table.shard_shape),
                "endpoints": list(self.table.endpoints),
            },
        }

    def to_json_text(self) -> str:
        return json.dumps(self.to_json(), indent=1) + "\n"


def make_blocks(name: str, shape: tuple[int, ...], sizes: list[int]) -> list[VarBlock]:
    """Turn element counts from `slice_sizes` into row-aligned `VarBlock`s."""
    row_width = math.prod(shape[1:]) if len(shape) >= 2 else 1
    blocks, row = [], 0
    for index, size in enumerate(sizes):
        rows = size // row_width if row_width else 0
        block_shape = (rows, *shape[1:]) if shape else ()
        block_name = naming.block_name(name, index) if len(sizes) > 1 else name
        blocks.append(VarBlock(name, index, row, rows, block_shape, block_name))
        row += rows
    return blocks


def make_partition_blocks(name: str, shape: tuple[int, ...], partitions) -> list[VarBlock]:
    """`VarBlock`s of checked partitions (`transpiler.partition.checked_partitions`, in
    row-major order): whole-row partitions as `make_blocks` makes them, a column range as a
    `[rows, cols]` block with `cols` set. One partition keeps the var's own name."""
    width = math.prod(shape[1:]) if len(shape) >= 2 else 1
    # A rank-3+ param cut by columns is a [rows, cols] matrix in every block (the trainer
    # reshapes its grad and param: `naming.flat_name`), whole-width blocks included.
    flat = len(shape) > 2 and any(p.start_col != 0 or p.end_col != width for p in partitions)
    blocks = []
    for index, part in enumerate(partitions):
        block_name = naming.block_name(name, index) if len(partitions) > 1 else name
        if part.start_col == 0 and part.end_col == width and not flat:
            block_shape = (part.end_row - part.start_row, *shape[1:]) if shape else ()
            blocks.append(VarBlock(name, index, part.start_row, part.end_row - part.start_row, block_shape, block_name))
        else:
            rows, cols = part.end_row - part.start_row, part.end_col - part.start_col
            blocks.append(VarBlock(name, index, part.start_row, rows, (rows, cols), block_name, part.start_col, cols))
    return blocks


def format_plan(plan: Plan) -> str:
    """The human report of `pstranspile plan`: load per pserver, then every var's blocks
    (with a partitioner other than paddle: each param's grid, and its blocks' row and
    column ranges)."""
    two_d = plan.partitioner != "paddle" or plan.cuts_columns
    lines = [
        f"{len(plan.params)} params on {len(plan.endpoints)} pservers, {plan.trainers} trainer(s), "
        f"{'sync' if plan.sync_mode else 'async'}, split {plan.split_method}, "
        f"min_block_size {plan.min_block_size}{'' if plan.slice_var_up else ', no slicing'}"
        + ("" if not two_d else f", partitioner {plan.partitioner}"),
        "",
        f"{'pserver':<24} {'blocks':>6} {'elements':>12} {'bytes':>14} {'share':>7}",
    ]
    for row in plan.load_by_endpoint():
        lines.append(
            f"{row['endpoint']:<24} {row['blocks']:>6} {row['elements']:>12,} {row['bytes']:>14,} {row['share']:>7.1%}"
        )
    lines.append(f"imbalance (max / mean elements): {plan.imbalance():.3f}")
    lines.append("")
    lines.append(f"{'var / block':<40} {'endpoint':<24} {'rows,cols' if two_d else 'rows':>14} {'shape':<16}")
    for param in plan.params:
        kind = ", sparse" + (" prefetched" if param.remote_prefetch else "") if param.sparse else ""
        if param.distributed:
            kind = ", distributed table, auto-grown"

        grid = ""
        if two_d:
            widths = [len(band) for band in param.bands()]
            grid = f", grid {len(widths)}x{widths[0]}" if len(set(widths)) == 1 else f", grid {len(widths)} bands x {widths}"
        lines.append(f"{param.param} {list(param.shape)} {param.dtype.short} ({param.optimizer}{kind}, grad {param.grad}"
                     f"{grid})")
        for block, endpoint in zip(param.blocks, param.endpoints, strict=True):
            rows = f"{block.row_offset}:{block.row_offset + block.rows}"
            if block.cols is not None:
                rows += f",{block.col_offset}:{block.col_offset + block.cols}"
            lines.append(f"  {block.name:<38} {endpoint:<24} {rows:>14} {str(list(block.shape)):<16}")
    table = plan.table
    if table is not None:
        lines.append(f"{table.table} {list(table.shape)} {table.dtype.short} (distributed table, rows id % "
                     f"{len(table.endpoints)}, sgd, grad {table.grad})")
        for shard, endpoint in enumerate(table.endpoints):
            rows = f"id%{len(table.endpoints)}=={shard}"
            lines.append(f"  {table.table + ' shard ' + str(shard):<38} {endpoint:<24} {rows:>14} "
                         f"{str(list(table.shard_shape)):<16}")
    return "\n".join(line.rstrip() for line in lines) + "\n"


def plan_svg(plan: Plan, *, max_params: int = 24, width: int = 480) -> str:
    """An SVG picture of the plan (`pstranspile plan --svg`): the largest params (at most
    `max_params`, by elements; a note counts the rest), each drawn as its rows x columns
    grid of partitions, every partition coloured by the pserver holding it, with a legend
    of the pservers and their share of the elements. Deterministic text."""
    colour = {ep: f"hsl({(i * 360) // max(len(plan.endpoints), 1)},65%,{60 if i % 2 else 72}%)"
              for i, ep in enumerate(plan.endpoints)}
    shown = sorted(plan.params, key=lambda p: (-math.prod(p.shape), p.param))[:max_params]
    left, y = 10, 10
    body: list[str] = []
    load = plan.load_by_endpoint()
    body.append(f'<text x="{left}" y="{y + 12}" font-size="13">{len(plan.params)} params on {len(plan.endpoints)} '
                f'pservers, partitioner {_xml(plan.partitioner)}, imbalance {plan.imbalance():.3f}</text>')
    y += 22
    for i, row in enumerate(load):
        x = left + (i % 4) * 180
        if i and i % 4 == 0:
            y += 18
        body.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{colour[row["endpoint"]]}" stroke="#333"/>'
                    f'<text x="{x + 16}" y="{y + 10}" font-size="11">{_xml(row["endpoint"])} {row["share"]:.1%}</text>')
    y += 28
    for param in shown:
        rows = param.shape[0] if param.shape else 1
        cols = math.prod(param.shape[1:]) if len(param.shape) >= 2 else 1
        height = max(16, min(160, round(width * rows / max(cols, 1))))
        body.append(f'<text x="{left}" y="{y + 11}" font-size="11">{_xml(param.param)} {list(param.shape)} '
                    f'{len(param.blocks)} partition(s)</text>')
        y += 15
        for block, endpoint in zip(param.blocks, param.endpoints, strict=True):
            bcols = block.cols if block.cols is not None else cols
            x0 = left + width * block.col_offset / max(cols, 1)
            y0 = y + height * block.row_offset / max(rows, 1)
            w = width * bcols / max(cols, 1)
            h = height * block.rows / max(rows, 1)
            body.append(f'<rect x="{x0:.2f}" y="{y0:.2f}" width="{w:.2f}" height="{h:.2f}" fill="{colour[endpoint]}" '
                        f'stroke="#333" stroke-width="0.5"><title>{_xml(block.name)} rows {block.row_offset}:'
                        f'{block.row_offset + block.rows} cols {block.col_offset}:{block.col_offset + bcols} on '
                        f'{_xml(endpoint)}</title></rect>')
        y += height + 12
    if len(plan.params) > len(shown):
        body.append(f'<text x="{left}" y="{y + 11}" font-size="11">... and {len(plan.params) - len(shown)} smaller '
                    'params</text>')
        y += 16
    if plan.table is not None:
        body.append(f'<text x="{left}" y="{y + 11}" font-size="11">{_xml(plan.table.table)} {list(plan.table.shape)}: '
                    f'distributed table, rows id % {len(plan.table.endpoints)}</text>')
        y += 16
    total_width = max(width, 4 * 180) + 2 * left
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_width}" height="{y + 10}" '
            f'font-family="sans-serif">\n' + "\n".join(body) + "\n</svg>\n")


def _xml(text: str) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
