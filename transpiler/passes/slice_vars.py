"""Pass: cut each parameter into blocks and place the blocks on pservers.

Grads are cut exactly like their params (the optimizer updates block i of the param
with block i of the grad), so one slicing and one dispatch serve both: a param block
and its grad block always share an endpoint. (Paddle dispatches grads and params
separately; with `HashName` that would put them on different servers.)

A param whose optimizer reads its whole norm (`lars_momentum`, `lamb`: the catalogue's
`whole_norm`) is never cut: on one pserver its norm, and so its update, is local training's. In sync mode a LARS
or LAMB param (`exchanged_norms`) updated by its optimizer alone, or after L2 decay only
(`ELEMENTWISE_BEFORE_NORM`), is cut: the pservers holding
its blocks run those ops and sum their norms (transpiler/passes/pserver_norm_reduce.py).
(Paddle cuts it, and each block's update then uses the block's norm.)

Unsliced round robin deals the params in Paddle's order: with `slice_var_up=False`
Paddle 1.8 and 2.6 shuffle their grads (in optimizer order) with
`np.random.seed(program.random_seed); np.random.shuffle(...)` before dispatching (PR
#12152: with `fc_w, fc_b` pairs on an even pserver count, program order put every weight
on one half of the pservers). `RandomState(seed).shuffle` of a list is that legacy
stream, the same in every numpy and every process. Other dispatchers see program order
(`hash_name` does not depend on it; `balanced` sorts by size).
"""

from __future__ import annotations

from dataclasses import replace

from ops.catalogue.optimizer_ops import optimizer_slots
from transpiler.config import TranspileOptions
from transpiler.errors import TranspileError
from transpiler.naming import band_name, flat_name
from transpiler.passes.bundle import Bundle
from transpiler.passes.contract import Pass
from transpiler.partition import ParamInfo, checked_assignment, checked_partitions
from transpiler.plan import ParamPlan, Plan, TablePlan, make_blocks, make_partition_blocks, slice_sizes

# Pserver ops that read a norm of the whole param (or row): a column partition would change
# what they compute, so a param they update is refused a column cut.
NEEDS_WHOLE_PARAM = frozenset({"lars_momentum", "lamb", "dgc_momentum", "clip_by_norm", "squared_l2_norm", "norm",
                               "p_norm"})


# Ops that may stand between the grad and a LARS / LAMB optimizer of a param cut into
# blocks (L2 decay's `scale` + `sum`, in place on the grad): element-wise, so each pserver
# runs them on its blocks ahead of the norms it sums (pserver_norm_reduce moves them
# there). Not a by-value `clip`: it writes a new var, and the param block would no longer
# read the grad its `grad_to_block_id` names; such a param is kept whole.
ELEMENTWISE_BEFORE_NORM = frozenset({"scale", "sum"})

# Trainer ops that leave a SelectedRows grad with its duplicate rows merged (the `sum` of
# several lookups' grads is Paddle's MergeAdd): the trainer then sends a row per distinct id.
MERGING_GRAD_OPS = frozenset({"sum", "merge_selected_rows"})


def _merges_rows(grad_producer) -> bool:
    """Whether the op that writes a grad leaves its duplicate rows merged."""
    return grad_producer.type in MERGING_GRAD_OPS


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    block = bundle.origin.global_block()
    plan = Plan(
        endpoints=options.endpoints,
        trainers=options.trainers,
        sync_mode=options.sync_mode,
        slice_var_up=options.slice_var_up,
        split_method=options.split_method_name,
        min_block_size=options.min_block_size,
        partitioner=options.partitioner_name,
    )
    slice_count = len(options.endpoints) if options.slice_var_up else 1
    tables = bundle.analysis.tables
    for chain in bundle.analysis.chains:
        var = block.var(chain.param)
        shape = tuple(var.shape)
        # LARS / LAMB read the whole param's norm: kept whole, the pserver's norm is exact.
        # So is a param clipped by its norm on the pserver (clip_mode="exact").
        slots = optimizer_slots(chain.optimizer.type)
        exchanged = slots.exchanged_norms and options.sync_mode and all(
            op is chain.optimizer or op.type in ELEMENTWISE_BEFORE_NORM for op in chain.ops)
        whole = slots.whole_norm and not exchanged
        sizes = slice_sizes(shape, 1 if whole else slice_count, options.min_block_size)
        lookups = tables.get(chain.param)
        plan.params.append(
            ParamPlan(
                param=chain.param,
                grad=chain.grad,
                shape=shape,
                dtype=var.dtype,
                optimizer=chain.optimizer.type,
                blocks=make_blocks(chain.param, shape, sizes),
                sparse=chain.sparse,
                remote_prefetch=lookups is not None and lookups.remote_prefetch,
                merged_grad=chain.sparse and _merges_rows(chain.grad_producer),
            )
        )
    table = bundle.analysis.distributed_table
    if table is not None and options.partitioner is not None:
        # Cut by the partitioner like any param: auto-grown pieces, prefetched from every
        # column piece of a row's band (`distributed_lookup_table`), grads split the same way.
        var = block.var(table.param)
        plan.params.append(ParamPlan(param=table.param, grad=table.grad, shape=tuple(var.shape), dtype=var.dtype,
                                     optimizer=table.optimizer.type, sparse=True, remote_prefetch=True,
                                     distributed=True, merged_grad=_merges_rows(table.grad_producer)))
    elif table is not None:
        var = block.var(table.param)
        plan.table = TablePlan(table.param, table.grad, tuple(var.shape), var.dtype, options.endpoints,
                               tables[table.param].padding_idx,
                               merged_grad=_merges_rows(table.grad_producer))
    if options.partitioner is not None:
        _partition(plan, options, [*bundle.analysis.chains, *([table] if table is not None else [])])
        if table is not None:
            _keep_table_sharded(plan, options, tables[table.param].padding_idx)
        _check_names_free(block, plan)
        return replace(bundle, plan=plan)
    _check_names_free(block, plan)

    dispatcher = options.dispatcher(list(options.endpoints))
    dispatcher.reset()
    order = dispatch_order(plan.params, options)
    all_blocks = [b for i in order for b in plan.params[i].blocks]
    endpoints = list(dispatcher.dispatch(all_blocks))
    if len(endpoints) != len(all_blocks) or any(ep not in options.endpoints for ep in endpoints):
        raise TranspileError(
            f"dispatcher {options.split_method_name} returned {endpoints!r} for {len(all_blocks)} blocks; "
            "it must return one of the pserver endpoints per block"
        )
    cursor = 0
    for i in order:
        param = plan.params[i]
        param.endpoints = endpoints[cursor : cursor + len(param.blocks)]
        cursor += len(param.blocks)
    return replace(bundle, plan=plan)


def _partition(plan: Plan, options: TranspileOptions, chains) -> None:
    """Cut and place every param with `options.partitioner` (each param's partitions
    checked: `checked_partitions`), replacing the blocks Paddle's slicing made."""
    partitioner = options.partitioner
    who = options.partitioner_name
    partitioner.servers = len(options.endpoints)
    partitioner.trainers = options.trainers
    partitioner.sync_mode = options.sync_mode
    partitioner.reset()
    whole_rows = {chain.param for chain in chains if any(op.type in NEEDS_WHOLE_PARAM for op in chain.ops)}
    infos = [ParamInfo(param.param, param.shape, param.dtype, param.optimizer, param.sparse, param.remote_prefetch,
                       param.distributed, row_cuts_only=param.param in whole_rows, merged_grad=param.merged_grad)
             for param in plan.params]
    partitioner.prepare(infos)
    for param, info in zip(plan.params, infos, strict=True):
        parts = checked_partitions(info, partitioner.partitions(info), who)
        servers = checked_assignment(info, parts, partitioner.assign(parts), who, len(options.endpoints))
        param.blocks = make_partition_blocks(param.param, param.shape, parts)
        param.endpoints = [options.endpoints[s] for s in servers]
    by_name = {param.param: param for param in plan.params}
    for chain in chains:
        param = by_name[chain.param]
        whole = next((op.type for op in chain.ops if op.type in NEEDS_WHOLE_PARAM), None)
        if param.cuts_columns and whole is not None:
            raise TranspileError(f"partitioner {who}: param {param.param!r} is cut by columns, but its pserver op "
                                 f"{whole!r} needs whole rows (a norm of the param); cut it by rows only")


def _keep_table_sharded(plan: Plan, options: TranspileOptions, padding_idx: int) -> None:
    """A partitioner that keeps the distributed table sharded as Paddle does (`id % k` over
    k distinct pservers; `table_shards` returns their indices, e.g. the planner's `mod`
    candidate) gets a `TablePlan` on those pservers instead of the table's param blocks."""
    shards_of = getattr(options.partitioner, "table_shards", None)
    param = next((p for p in plan.params if p.distributed), None)
    if shards_of is None or param is None:
        return
    info = ParamInfo(param.param, param.shape, param.dtype, param.optimizer, param.sparse, param.remote_prefetch,
                     param.distributed)
    servers = shards_of(info)
    if servers is None:
        return
    count = len(options.endpoints)
    if not servers or len(set(servers)) != len(servers) or any(not 0 <= s < count for s in servers):
        raise TranspileError(f"partitioner {options.partitioner_name}: table_shards({param.param!r}) returned "
                             f"{servers!r}; it must name distinct pservers 0..{count - 1}")
    plan.params.remove(param)
    plan.table = TablePlan(param.param, param.grad, param.shape, param.dtype,
                           tuple(options.endpoints[s] for s in servers), padding_idx, merged_grad=param.merged_grad)


def dispatch_order(params: list[ParamPlan], options: TranspileOptions) -> list[int]:
    """The order the dispatcher sees the params in: program order, or for unsliced round
    robin Paddle's seeded shuffle of it (see the module docstring)."""
    order = list(range(len(params)))
    if not options.slice_var_up and options.split_method_name == "round_robin":
        import numpy as np  # only here: Paddle's numpy shuffle, which nothing else of a transpile needs

        np.random.RandomState(options.random_seed).shuffle(order)
    return order


def _check_names_free(block, plan: Plan) -> None:
    """A block var name the program already uses for something else would alias it."""
    for param in plan.params:
        if not param.sliced:
            continue
        for var_block in param.blocks:
            for name in (var_block.name, param.grad_block_name(var_block.index)):
                if block.has_var(name):
                    raise TranspileError(f"cannot slice {param.param!r}: the program already declares {name!r}")
        if param.cuts_columns:  # the trainer's row bands of a 2-D cut (`naming.band_name`)
            names = [n for j in range(len(param.bands())) for n in (band_name(param.param, j), band_name(param.grad, j))]
            if len(param.shape) > 2:  # the trainer's [rows, cols] views of a rank-3+ param (`naming.flat_name`)
                names += [n for v in (param.param, param.grad) for n in (flat_name(v), flat_name(v) + "@XShape")]
            for name in names:
                if block.has_var(name):
                    raise TranspileError(f"cannot cut {param.param!r}: the program already declares {name!r}")


PASS = Pass("slice_vars", run, requires=("analysis",), produces=("plan",))
