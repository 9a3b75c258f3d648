"""Pass: the trainer fetches the rows of prefetched tables from the pservers.

The `lookup_table` ops of such a table are replaced, after the last op that writes any
of their ids, by:

* a `remote_prefetch` sparse table: one `distributed_lookup_table` that fetches each row
  from the block holding it (by row range, `height_sections`);
* the distributed table: `split_ids` (shard ids by `id % #pservers`) → `prefetch` →
  `merge_ids` back into the lookups' outputs; cut by a partitioner other than `paddle` it
  is a `remote_prefetch` param of the plan (`ParamPlan.distributed`) and gets the
  `distributed_lookup_table` above, its pieces auto-grown on the pservers.

Tables are handled in param order, the distributed table last.
"""

from __future__ import annotations

from ops.catalogue import make_op
from transpiler.config import TranspileOptions
from transpiler.errors import TranspileError
from transpiler.ir import AttrType, Block, Op, OpRole
from transpiler.passes.bundle import Bundle, TableLookups
from transpiler.passes.contract import Pass
from transpiler.plan import ParamPlan, TablePlan


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    analysis, plan, copies = bundle.analysis, bundle.plan, bundle.trainer_ops
    block = bundle.trainer.global_block()
    after_anchor: dict[Op | None, Op] = {}
    for param in plan.params:
        if param.remote_prefetch:
            lookups = analysis.tables[param.param]
            lookup_ops = [copies.op(op) for op in lookups.lookups]
            _place(block, lookup_ops, lookups, [_distributed_lookup_table(lookup_ops, lookups, param, options)],
                   after_anchor)
    if plan.table is not None:
        lookups = analysis.tables[plan.table.table]
        lookup_ops = [copies.op(op) for op in lookups.lookups]
        _place(block, lookup_ops, lookups, _prefetch_ops(block, lookup_ops, plan.table, options), after_anchor)
    return bundle


def _place(block: Block, lookup_ops: list[Op], lookups: TableLookups, new_ops: list[Op], after_anchor: dict) -> None:
    """Replace `lookup_ops` by `new_ops` after the last writer of their ids (the block's
    start when none); tables sharing that writer follow each other in call order."""
    ids = [name for op in lookup_ops for name in op.input("Ids")]
    outs = [name for op in lookup_ops for name in op.output("Out")]
    block.remove_ops(lookup_ops)
    producers = [op for name in ids for op in block.writers(name)]
    anchor = max(producers, key=block.index_of) if producers else None
    consumers = [op for name in outs for op in block.readers(name)]
    if consumers and anchor is not None and min(map(block.index_of, consumers)) <= block.index_of(anchor):
        raise TranspileError(
            f"the lookups of table {lookups.table!r} cannot be merged: an output is read before the last of its "
            "ids is written"
        )
    last = after_anchor.get(anchor, anchor)
    for op in new_ops:
        last = block.insert_after(last, op) if last is not None else block.add_op(op, index=0)
    after_anchor[anchor] = last


def _distributed_lookup_table(lookup_ops: list[Op], lookups: TableLookups, param: ParamPlan,
                              options: TranspileOptions) -> Op:
    op = _lookup_op(lookup_ops, lookups, param, options)
    if param.cuts_columns:  # ours (not Fluid's): each block's width and first column, for 2-D partitions
        op.set_attr("column_sections", [b.cols if b.cols is not None else b.shape[1] for b in param.blocks],
                    AttrType.LONGS)
        op.set_attr("column_offsets", [b.col_offset for b in param.blocks], AttrType.LONGS)
    return op


def _lookup_op(lookup_ops: list[Op], lookups: TableLookups, param: ParamPlan, options: TranspileOptions) -> Op:
    return make_op(
        "distributed_lookup_table",
        {"Ids": [n for op in lookup_ops for n in op.input("Ids")], "W": [param.param]},
        {"Outputs": [n for op in lookup_ops for n in op.output("Out")]},
        {
            "table_names": [b.name for b in param.blocks],
            "height_sections": [b.rows for b in param.blocks],
            "endpoints": list(param.endpoints),
            "trainer_id": options.trainer_id,
            "lookup_table_version": lookups.op_type,
            "padding_idx": lookups.padding_idx,
            "dtype": int(param.dtype),
        },
        role=OpRole.RPC,
    )


def _prefetch_ops(block: Block, lookup_ops: list[Op], table: TablePlan, options: TranspileOptions) -> list[Op]:
    ids = [n for op in lookup_ops for n in op.input("Ids")]
    outs = [n for op in lookup_ops for n in op.output("Out")]
    shards = range(len(table.endpoints))
    ins = [table.prefetch_in(i) for i in shards]
    fetched = [table.prefetch_out(i) for i in shards]
    for name in ins:
        _declare_like(block, block.var(ids[0]), name, (-1, 1))
    for name in fetched:
        _declare_like(block, block.var(outs[0]), name, (-1, *table.shape[1:]))
    return [
        make_op("split_ids", {"Ids": ids}, {"Out": ins}, role=OpRole.RPC),
        make_op("prefetch", {"X": ins}, {"Out": fetched}, {"epmap": list(table.endpoints),
                                                            "trainer_id": options.trainer_id}, role=OpRole.RPC),
        make_op("merge_ids", {"Ids": ids, "Rows": ins, "X": fetched}, {"Out": outs}, role=OpRole.RPC),
    ]


def _declare_like(block: Block, source, name: str, shape: tuple[int, ...]) -> None:
    if not block.has_var(name):
        var = source.copy(name)
        var.shape, var.lod_level = shape, 0
        block.add_var(var)


PASS = Pass("distribute_lookups", run, requires=("analysis", "plan", "trainer", "trainer_ops"), produces=("trainer",))
