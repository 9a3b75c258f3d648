"""Pass: the trainer's main program.

From a copy of the original program:

1. drop the optimize and lr-decay ops (they run on the pservers), the sub-blocks only
   they used, and the vars only they used (Paddle leaves the lr sub-blocks behind as
   orphan blocks; nothing can run them, so they go);
2. lookups that fetch rows from the pservers replace the `lookup_table` ops of their
   table, placed after the last op that writes any of the ids:
   * a `remote_prefetch` sparse table: one `distributed_lookup_table` that fetches each
     row from the block holding it (by row range, `height_sections`);
   * the distributed table: `split_ids` (shard ids by `id % #pservers`) → `prefetch` →
     `merge_ids` back into the lookups' outputs;
3. after the last op that writes each param's grad: `split_byref` (dense) or
   `split_selected_rows` (sparse) into the param's blocks when it is cut, then `send`
   (attr `epmap`: the block endpoints). In sync mode with several trainers the sent vars
   are `<grad>[.block<i>].trainer_<id>`. The distributed table's grad is `split_ids`
   into one SelectedRows per pserver and sent to all;
4. sync mode: one `send_barrier` after all sends;
5. a `recv` per param (its blocks, its epmap) — not for prefetched tables, whose rows
   are fetched as needed; sync: `fetch_barrier`; then a `concat` per cut param.

`runtime_split_send_recv` (async only) sends and receives whole vars and lets `send` /
`recv` split by `sections` / `send_varnames` / `recv_varnames` at run time instead.
Sends follow the param order when several grads share a producer.
"""

from __future__ import annotations

from dataclasses import replace

from ops.catalogue import make_op
from transpiler.config import TranspileOptions
from transpiler.errors import TranspileError
from transpiler.ir import Block, CloneMap, Op, OpRole, Program
from transpiler.naming import trainer_name
from transpiler.passes.bundle import Analysis, Bundle, TableLookups
from transpiler.plan import ParamPlan, Plan, TablePlan


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    analysis, plan = bundle.analysis, bundle.plan
    assert analysis is not None and plan is not None, "run find_optimize and slice_vars first"
    trainer, copies = bundle.origin.clone_with_map()
    block = trainer.global_block()
    chains = [*analysis.chains, *([analysis.distributed_table] if analysis.distributed_table else [])]
    anchors = {chain.param: copies.op(chain.grad_producer) for chain in chains}
    moved = [copies.op(op) for op in (*analysis.optimize_ops, *analysis.lr_ops)]
    orphan_blocks = _sub_blocks_of(trainer, moved)
    touched = {name for op in moved for name in (*op.input_names, *op.output_names)}
    block.remove_ops(moved)
    _replace_prefetched_lookups(block, copies, analysis, plan, options)

    tid = options.trainer_id
    send_outs: dict[str, str] = {}
    after_anchor: dict[Op, Op] = {}
    renames: dict[str, str] = {}
    for param in plan.params:
        anchor = anchors[param.param]
        last = after_anchor.get(anchor, anchor)
        sent, split = _grad_vars_to_send(trainer, plan, param, options, renames)
        if split is not None:
            last = block.insert_after(last, split)
        ctrl = bundle.new_control_var(trainer)
        send = make_op(
            "send",
            {"X": sent},
            {"Out": [ctrl]},
            _send_attrs(param, options),
            role=OpRole.RPC,
            role_vars=(param.param, param.grad),
        )
        after_anchor[anchor] = block.insert_after(last, send)
        send_outs[param.param] = ctrl
    block.rename_vars(renames)  # whole grads become `<grad>.trainer_<id>`, in one pass
    if plan.table is not None:
        anchor = anchors[plan.table.table]
        ctrl = bundle.new_control_var(trainer) if options.sync_mode else None
        _send_table_grad(block, after_anchor.get(anchor, anchor), plan, options, ctrl)
        if ctrl is not None:
            send_outs[plan.table.table] = ctrl

    if not options.sync_mode and analysis.lr_counter is not None:
        ctrl = bundle.new_control_var(trainer)
        block.add_op(
            make_op(
                "send",
                {"X": [trainer_name(analysis.lr_counter, tid)]},
                {"Out": [ctrl]},
                {"epmap": list(options.endpoints), "trainer_id": tid, "merge_add": True, "use_send_handler": False},
                role=OpRole.RPC,
            )
        )

    barrier = None
    if options.sync_mode or options.half_async:
        barrier = bundle.new_control_var(trainer)
        block.add_op(
            make_op(
                "send_barrier",
                {"X": list(send_outs.values())},
                {"Out": [barrier]},
                {"endpoints": list(options.endpoints), "trainer_id": tid, "half_async": options.half_async},
                role=OpRole.RPC,
            )
        )

    received: list[str] = []
    for param in received_params(plan):
        outs = _param_vars_to_recv(trainer, param, options)
        received.extend(outs)
        block.add_op(
            make_op(
                "recv",
                {"X": [barrier if barrier and options.sync_mode else send_outs[param.param]]},
                {"Out": outs},
                _recv_attrs(param, options),
                role=OpRole.RPC,
                role_vars=(param.param, param.grad),
            )
        )
    if options.sync_mode:
        block.add_op(
            make_op(
                "fetch_barrier",
                {"X": [barrier]},
                {"Out": received},
                {"endpoints": list(options.endpoints), "trainer_id": tid},
                role=OpRole.RPC,
            )
        )
    if not options.runtime_split_send_recv:
        for param in received_params(plan):
            if param.sliced:
                block.add_op(concat_op(param))
    _drop_unused(trainer, orphan_blocks, touched)
    return replace(bundle, trainer=trainer)


def received_params(plan: Plan) -> list[ParamPlan]:
    """Params the trainer receives whole; prefetched tables are read row by row instead."""
    return [param for param in plan.params if not param.remote_prefetch]


def concat_op(param: ParamPlan) -> Op:
    return make_op("concat", {"X": [b.name for b in param.blocks]}, {"Out": [param.param]}, {"axis": 0}, role=OpRole.Dist)


def declare_param_blocks(program: Program, param: ParamPlan, *, persistable: bool = False) -> list[str]:
    """Declare the param's block vars (once) and return their names."""
    block = program.global_block()
    whole = block.var(param.param)
    for var_block in param.blocks:
        if param.sliced and not block.has_var(var_block.name):
            copy = whole.copy(var_block.name)
            copy.shape = var_block.shape
            copy.persistable = persistable
            copy.is_parameter = False
            block.add_var(copy)
    return [b.name for b in param.blocks]


# ----------------------------------------------------------------- grads out


def _grad_vars_to_send(trainer: Program, plan: Plan, param: ParamPlan, options: TranspileOptions,
                       renames: dict[str, str]):
    """(names of the vars `send` ships, the op that splits the grad into them or None).
    A whole grad is renamed rather than copied: `renames` collects old -> new."""
    block = trainer.global_block()
    tid = options.trainer_id
    names = [plan.trainer_grad_name(param, b.index, tid) for b in param.blocks]
    if options.runtime_split_send_recv:
        return [param.grad], None
    if not param.sliced:
        if names[0] != param.grad:
            renames[param.grad] = names[0]
        return names, None
    grad = block.var(param.grad)
    for var_block, name in zip(param.blocks, names, strict=True):
        copy = grad.copy(name)
        copy.shape = var_block.shape
        copy.persistable = False
        block.add_var(copy)
    rows = [b.rows for b in param.blocks]
    if param.sparse:
        split = make_op("split_selected_rows", {"X": [param.grad]}, {"Out": names}, {"height_sections": rows},
                        role=OpRole.Dist, role_vars=(param.param, param.grad))
    else:
        split = make_op("split_byref", {"X": [param.grad]}, {"Out": names}, {"sections": rows},
                        role=OpRole.Dist, role_vars=(param.param, param.grad))
    return names, split


def _send_table_grad(block: Block, after: Op, plan: Plan, options: TranspileOptions, ctrl: str | None) -> None:
    """`split_ids` the distributed table's grad into one SelectedRows per pserver, then send them."""
    table = plan.table
    trainer = options.trainer_id if plan.per_trainer_grads else None
    names = [table.shard_grad_name(i, trainer) for i in range(len(table.endpoints))]
    grad = block.var(table.grad)
    for name in names:
        block.add_var(grad.copy(name))
    split = make_op("split_ids", {"Ids": [table.grad]}, {"Out": names}, role=OpRole.RPC,
                    role_vars=(table.table, table.grad))
    send = make_op("send", {"X": names}, {"Out": [ctrl] if ctrl else []},
                   {"epmap": list(table.endpoints), "trainer_id": options.trainer_id}, role=OpRole.RPC,
                   role_vars=(table.table, table.grad))
    block.insert_after(block.insert_after(after, split), send)


# ------------------------------------------------------------------ lookups


def _replace_prefetched_lookups(block: Block, copies: CloneMap, analysis: Analysis, plan: Plan,
                                options: TranspileOptions) -> None:
    """Put the lookups of prefetched tables where their ids are ready, in param order."""
    after_anchor: dict[Op | None, Op] = {}
    for param in plan.params:
        if param.remote_prefetch:
            lookup_ops = [copies.op(op) for op in analysis.tables[param.param].lookups]
            new_ops = [_distributed_lookup_table(lookup_ops, analysis.tables[param.param], param, options)]
            _place_lookup(block, lookup_ops, analysis.tables[param.param], new_ops, after_anchor)
    if plan.table is not None:
        lookups = analysis.tables[plan.table.table]
        lookup_ops = [copies.op(op) for op in lookups.lookups]
        _place_lookup(block, lookup_ops, lookups, _prefetch_ops(block, lookup_ops, plan.table, options), after_anchor)


def _place_lookup(block: Block, lookup_ops: list[Op], lookups: TableLookups, new_ops: list[Op],
                  after_anchor: dict) -> None:
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


# ----------------------------------------------------------------- params in


def _param_vars_to_recv(trainer: Program, param: ParamPlan, options: TranspileOptions) -> list[str]:
    if options.runtime_split_send_recv or not param.sliced:
        return [param.param]
    return declare_param_blocks(trainer, param)


def _send_attrs(param: ParamPlan, options: TranspileOptions) -> dict:
    attrs = {"epmap": list(param.endpoints), "trainer_id": options.trainer_id}
    if options.runtime_split_send_recv:
        attrs["sections"] = [b.rows for b in param.blocks]
        attrs["send_varnames"] = [param.grad_block_name(b.index) for b in param.blocks]
    return attrs


def _recv_attrs(param: ParamPlan, options: TranspileOptions) -> dict:
    attrs = {"epmap": list(param.endpoints), "trainer_id": options.trainer_id}
    if options.runtime_split_send_recv:
        attrs["recv_varnames"] = [b.name for b in param.blocks]
    return attrs


# ------------------------------------------------------------------- cleanup


def _sub_blocks_of(program: Program, ops: list[Op]) -> set[int]:
    """Blocks reachable only through `ops` (the lr ops' conditional bodies)."""
    found: set[int] = set()
    stack = [i for op in ops for i in op.sub_block_indices()]
    while stack:
        idx = stack.pop()
        if idx in found or not 0 < idx < program.num_blocks:
            continue
        found.add(idx)
        for op in program.block(idx).ops:
            stack.extend(op.sub_block_indices())
    return found


def _drop_unused(program: Program, candidate_blocks: set[int], names: set[str]) -> None:
    """Drop the candidate blocks nothing reaches any more, then the global vars in
    `names` that no remaining op of any block uses."""
    reachable = set(program.reachable_blocks())
    program.drop_blocks(sorted(candidate_blocks - reachable))
    used = {name for blk in program.blocks for name in blk.var_names_used()}
    block = program.global_block()
    for name in sorted(names - used):
        if block.has_var(name):
            block.remove_var(name)
