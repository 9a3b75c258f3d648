"""Pass: the trainer sends its grads to the pservers.

After the last op the trainer keeps that writes each param's grad: `split_byref` (dense)
or `split_selected_rows` (sparse) into the param's blocks when it is cut (for 2-D
partitions, into row bands and then by columns: `_split_2d`), then `send`
(attr `epmap`: the block endpoints). In sync mode with several trainers the sent vars
are `<grad>[.block<i>].trainer_<id>`. The distributed table's grad is `split_ids` into
one SelectedRows per pserver and sent to all. In async mode with lr decay, the trainer's
step counter is sent to every pserver (`merge_add`). Sync mode (and half-async): one
`send_barrier` after all sends.

`runtime_split_send_recv` (async only) sends whole vars and lets `send` split by
`sections` / `send_varnames` at run time instead. Sends follow the param order when
several grads share a producer.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ops.catalogue import make_op
from transpiler.config import TranspileOptions
from transpiler.ir import Block, Op, OpRole, Program
from transpiler.naming import band_name, flat_name, trainer_name
from transpiler.passes.bundle import Bundle, TrainerSends
from transpiler.passes.contract import Pass
from transpiler.plan import ParamPlan, Plan


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    analysis, plan, trainer = bundle.analysis, bundle.plan, bundle.trainer
    block = trainer.global_block()
    chains = [*analysis.chains, *([analysis.distributed_table] if analysis.distributed_table else [])]
    anchors = {chain.param: bundle.trainer_ops.op(chain.grad_producer) for chain in chains}
    tid = options.trainer_id
    sends = TrainerSends()
    after_anchor: dict[Op, Op] = {}
    renames: dict[str, str] = {}
    for param in plan.params:
        anchor = anchors[param.param]
        last = after_anchor.get(anchor, anchor)
        sent, split = _grad_vars_to_send(trainer, plan, param, options, renames)
        for op in split if isinstance(split, list) else [split] if split is not None else []:
            last = block.insert_after(last, op)
        ctrl = bundle.new_control_var(trainer)
        send = make_op("send", {"X": sent}, {"Out": [ctrl]}, _send_attrs(param, options), role=OpRole.RPC,
                       role_vars=(param.param, param.grad))
        after_anchor[anchor] = block.insert_after(last, send)
        sends.control[param.param] = ctrl
    block.rename_vars(renames)  # whole grads become `<grad>.trainer_<id>`, in one pass
    if plan.table is not None:
        anchor = anchors[plan.table.table]
        ctrl = bundle.new_control_var(trainer) if options.sync_mode else None
        _send_table_grad(block, after_anchor.get(anchor, anchor), plan, options, ctrl)
        if ctrl is not None:
            sends.control[plan.table.table] = ctrl

    if not options.sync_mode and analysis.lr_counter is not None:
        ctrl = bundle.new_control_var(trainer)
        block.add_op(make_op(
            "send", {"X": [trainer_name(analysis.lr_counter, tid)]}, {"Out": [ctrl]},
            {"epmap": list(options.endpoints), "trainer_id": tid, "merge_add": True, "use_send_handler": False},
            role=OpRole.RPC,
        ))

    if options.sync_mode or options.half_async:
        sends.barrier = bundle.new_control_var(trainer)
        block.add_op(make_op(
            "send_barrier", {"X": list(sends.control.values())}, {"Out": [sends.barrier]},
            {"endpoints": list(options.endpoints), "trainer_id": tid, "half_async": options.half_async},
            role=OpRole.RPC,
        ))
    return replace(bundle, trainer_sends=sends)


def _grad_vars_to_send(trainer: Program, plan: Plan, param: ParamPlan, options: TranspileOptions,
                       renames: dict[str, str]) -> tuple[list[str], Op | list[Op] | None]:
    """(names of the vars `send` ships, the op that splits the grad into them or None).
    A whole grad is renamed rather than copied: `renames` collects old -> new."""
    block = trainer.global_block()
    names = [plan.trainer_grad_name(param, b.index, options.trainer_id) for b in param.blocks]
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
    if param.cuts_columns:
        return names, _split_2d(block, param, names)
    rows = [b.rows for b in param.blocks]
    if param.sparse:
        split = make_op("split_selected_rows", {"X": [param.grad]}, {"Out": names}, {"height_sections": rows},
                        role=OpRole.Dist, role_vars=(param.param, param.grad))
    else:
        split = make_op("split_byref", {"X": [param.grad]}, {"Out": names}, {"sections": rows},
                        role=OpRole.Dist, role_vars=(param.param, param.grad))
    return names, split


def _split_2d(block: Block, param: ParamPlan, names: list[str]) -> list[Op]:
    """The ops cutting a grad into 2-D partitions: into row bands when there are several
    (`split_byref`; a SelectedRows grad `split_selected_rows`, rows re-based to the band),
    then each band of several column ranges by columns (`split` axis 1; a SelectedRows
    grad `split_selected_rows_by_columns`, the same rows in every piece)."""
    if param.sparse:
        by_rows, rows_attr, by_columns, column_attrs = "split_selected_rows", "height_sections", \
            "split_selected_rows_by_columns", {}
    else:
        by_rows, rows_attr, by_columns, column_attrs = "split_byref", "sections", "split", {"axis": 1}
    role = {"role": OpRole.Dist, "role_vars": (param.param, param.grad)}
    bands = param.bands()
    grad = block.var(param.grad)
    ops = []
    source, row_shape = param.grad, tuple(grad.shape[1:])
    if len(param.shape) > 2 and not param.sparse:  # a rank-3+ grad is cut as its [rows, cols] matrix
        source, row_shape = flat_name(param.grad), (math.prod(param.shape[1:]),)
        xshape = f"{source}@XShape"
        for name, shape in ((source, (param.shape[0], *row_shape)), (xshape, (0, *param.shape))):
            if not block.has_var(name):
                copy = grad.copy(name)
                copy.shape, copy.persistable = shape, False
                block.add_var(copy)
        ops.append(make_op("reshape2", {"X": [param.grad]}, {"Out": [source], "XShape": [xshape]},
                           {"shape": [param.shape[0], row_shape[0]]}, **role))
    out_of = dict(zip((b.index for b in param.blocks), names, strict=True))
    band_vars = []
    for j, band in enumerate(bands):
        if len(band) == 1:
            band_vars.append(out_of[band[0].index])
            continue
        name = band_name(param.grad, j) if len(bands) > 1 else source
        if len(bands) > 1 and not block.has_var(name):
            copy = grad.copy(name)
            copy.shape = (band[0].rows, *row_shape)
            copy.persistable = False
            block.add_var(copy)
        band_vars.append(name)
    if len(bands) > 1:
        ops.append(make_op(by_rows, {"X": [source]}, {"Out": band_vars},
                           {rows_attr: [band[0].rows for band in bands]}, **role))
    for band, name in zip(bands, band_vars, strict=True):
        if len(band) > 1:
            ops.append(make_op(by_columns, {"X": [name]}, {"Out": [out_of[b.index] for b in band]},
                               {**column_attrs, "sections": [b.cols for b in band]}, **role))
    return ops


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


def _send_attrs(param: ParamPlan, options: TranspileOptions) -> dict:
    attrs = {"epmap": list(param.endpoints), "trainer_id": options.trainer_id}
    if options.runtime_split_send_recv:
        attrs["sections"] = [b.rows for b in param.blocks]
        attrs["send_varnames"] = [param.grad_block_name(b.index) for b in param.blocks]
    return attrs


PASS = Pass("insert_sends", run, requires=("analysis", "plan", "trainer", "trainer_ops"), produces=("trainer_sends",))
