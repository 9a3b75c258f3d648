"""Pass: each pserver's shard of the distributed lookup table.

Pserver `i` holds the table rows with `id % M == i` (a SELECTED_ROWS var). (A table cut by
a partitioner is a param of the plan instead: pserver_optimize_blocks makes its pieces.) It gets an
update block (a child of the lr-decay block when there is one): sync mode with several
trainers `sum` of the trainers' shard grads → `scale` 1/trainers → the table's own
optimizer op. Its param-shaped accumulators (the catalogue's `sliced` slots: Adam's
moments, a velocity) are SELECTED_ROWS shards like the table, with the shard's shape, so
the pserver startup initialises them as it does the table and the kernel grows them with
the table's rows (`ops.kernels.table_update`); scalar ones (Adam's beta powers) are
whole per shard. Then a prefetch block (`lookup_sparse_table`, the `prefetch_var_name_to_block_id` attr)
and a checkpoint block (`save`, `checkpint_block_id`), both children of the update block.
"""

from __future__ import annotations

from ops.catalogue import make_op
from ops.catalogue.optimizer_ops import optimizer_slots
from transpiler.config import TranspileOptions
from transpiler.ir import DType, OpRole, Program, VarKind
from transpiler.naming import LOOKUP_TABLE_PATH, encode_pairs
from transpiler.passes.bundle import Bundle, ParamChain, PserverPrograms
from transpiler.passes.contract import Pass
from transpiler.passes.pserver_vars import declare
from transpiler.plan import Plan


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    if bundle.plan.table is None:
        return bundle
    for endpoint, progs in bundle.pservers.items():
        if endpoint not in bundle.plan.table.endpoints:  # a table kept `id % k` on k of the pservers
            continue
        _table_blocks(bundle.origin, bundle.plan, bundle.analysis.distributed_table, progs, endpoint)
    return bundle


def _table_blocks(origin: Program, plan: Plan, chain: ParamChain, progs: PserverPrograms, endpoint: str) -> None:
    table, program = plan.table, progs.main
    globals_ = program.global_block()
    shard = list(table.endpoints).index(endpoint)
    table_var = declare(progs, origin, table.table, table.table, table.shard_shape, persistable=True, index=shard)
    globals_.var(table_var).kind = VarKind.SELECTED_ROWS
    block = program.create_block(progs.optimize_parent)
    if plan.per_trainer_grads:
        merged = declare(progs, origin, table.grad, table.grad, persistable=True)
        received = [table.shard_grad_name(shard, k) for k in range(plan.trainers)]
        for name in received:
            declare(progs, origin, table.grad, name, persistable=False)
        block.add_op(make_op("sum", {"X": received}, {"Out": [merged]}, role=OpRole.Optimize,
                             role_vars=(table.table, merged)))
        # Paddle sums the trainers' table grads without averaging them (PR #13277 was never
        # merged), so a table learnt `trainers` times faster than local training; scale as
        # for every other param.
        block.add_op(make_op("scale", {"X": [merged]}, {"Out": [merged]}, {"scale": 1.0 / plan.trainers},
                             role=OpRole.Optimize, role_vars=(table.table, merged)))
    else:
        merged = declare(progs, origin, table.grad, table.shard_grad_name(shard, None), persistable=True)
    optimizer = chain.optimizer.clone()
    known = {table.grad: merged, table.table: table_var}
    for slot in optimizer_slots(optimizer.type).sliced:
        for name in optimizer.input(slot):
            known[name] = declare(progs, origin, name, name, table.shard_shape, persistable=True, index=shard)
            globals_.var(name).kind = VarKind.SELECTED_ROWS
    for slot, args in optimizer.inputs.items():
        optimizer.set_input(slot, [known[a] if a in known else declare(progs, origin, a) for a in args])
    block.add_op(optimizer)
    progs.optimize_blocks.append(block.idx)
    progs.grad_to_block.append((merged, block.idx))

    # The ids a trainer asks for and the rows it gets back (not state: nothing initialises them).
    prefetch_in, prefetch_out = table.prefetch_in(shard), table.prefetch_out(shard)
    for name, dtype, shape in ((prefetch_in, DType.INT64, (-1, 1)),
                               (prefetch_out, table.dtype, (-1, *table.shape[1:]))):
        if not globals_.has_var(name):
            globals_.create_var(name, VarKind.LOD_TENSOR, dtype, shape)
    prefetch = program.create_block(block.idx)
    prefetch.add_op(make_op("lookup_sparse_table", {"Ids": [prefetch_in], "W": [table.table]},
                            {"Out": [prefetch_out]}, {"padding_idx": table.padding_idx}, role=OpRole.RPC))
    if not globals_.has_var(LOOKUP_TABLE_PATH):
        globals_.create_var(LOOKUP_TABLE_PATH, VarKind.RAW, persistable=True)
    checkpoint = program.create_block(block.idx)
    checkpoint.add_op(make_op("save", {"X": [table.table]}, {}, {"file_path": "none"}, role=OpRole.RPC))
    progs.table_attrs = {
        "prefetch_var_name_to_block_id": encode_pairs([(prefetch_in, prefetch.idx)]),
        "checkpint_block_id": checkpoint.idx,  # sic: Paddle's attr name
    }


PASS = Pass("pserver_table_blocks", run, requires=("origin", "analysis", "plan", "pservers"), produces=("pservers",))
