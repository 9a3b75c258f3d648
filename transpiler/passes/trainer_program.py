"""Pass: the trainer's main program.

From a copy of the original program:

1. drop the optimize and lr-decay ops (they run on the pservers), the sub-blocks only
   they used, and the vars only they used (Paddle leaves the lr sub-blocks behind as
   orphan blocks; nothing can run them, so they go);
2. after the last op that writes each param's grad: `split_byref` into the param's
   blocks when it is cut, then `send` (attr `epmap`: the block endpoints). In sync mode
   with several trainers the sent vars are `<grad>[.block<i>].trainer_<id>`;
3. sync mode: one `send_barrier` after all sends;
4. a `recv` per param (its blocks, its epmap); sync: `fetch_barrier`; then a `concat`
   per cut param back into the whole param.

`runtime_split_send_recv` (async only) sends and receives whole vars and lets `send` /
`recv` split by `sections` / `send_varnames` / `recv_varnames` at run time instead.
Sends follow the param order when several grads share a producer.
"""

from __future__ import annotations

from dataclasses import replace

from transpiler.config import TranspileOptions
from transpiler.ir import Op, OpRole, Program
from transpiler.passes.async_lr_decay import counter_name
from transpiler.passes.bundle import Bundle
from ops.catalogue import make_op
from transpiler.plan import ParamPlan, Plan


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    analysis, plan = bundle.analysis, bundle.plan
    assert analysis is not None and plan is not None, "run find_optimize and slice_vars first"
    trainer = bundle.origin.clone()
    block = trainer.global_block()
    ops = block.ops  # aligned with the original program's indices
    anchors = {chain.param: ops[chain.grad_producer] for chain in analysis.chains}
    moved = [ops[i] for i in sorted({*analysis.optimize_ops, *analysis.lr_ops})]
    orphan_blocks = _sub_blocks_of(trainer, moved)
    touched = {name for op in moved for name in (*op.input_names, *op.output_names)}
    block.remove_ops(moved)

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
            _send_attrs(plan, param, options),
            role=OpRole.RPC,
            role_vars=(param.param, param.grad),
        )
        after_anchor[anchor] = block.insert_after(last, send)
        send_outs[param.param] = ctrl
    block.rename_vars(renames)  # whole grads become `<grad>.trainer_<id>`, in one pass

    if not options.sync_mode and analysis.lr_counter is not None:
        ctrl = bundle.new_control_var(trainer)
        block.add_op(
            make_op(
                "send",
                {"X": [counter_name(analysis.lr_counter, tid)]},
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
                {"X": [send_outs[p.param] for p in plan.params]},
                {"Out": [barrier]},
                {"endpoints": list(options.endpoints), "trainer_id": tid, "half_async": options.half_async},
                role=OpRole.RPC,
            )
        )

    received: list[str] = []
    for param in plan.params:
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
        for param in plan.params:
            if param.sliced:
                block.add_op(concat_op(param))
    _drop_unused(trainer, orphan_blocks, touched)
    return replace(bundle, trainer=trainer)


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


def _grad_vars_to_send(trainer: Program, plan: Plan, param: ParamPlan, options: TranspileOptions,
                       renames: dict[str, str]):
    """(names of the vars `send` ships, the `split_byref` op that makes them or None).
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
    split = make_op(
        "split_byref",
        {"X": [param.grad]},
        {"Out": names},
        {"sections": [b.rows for b in param.blocks]},
        role=OpRole.Dist,
        role_vars=(param.param, param.grad),
    )
    return names, split


def _param_vars_to_recv(trainer: Program, param: ParamPlan, options: TranspileOptions) -> list[str]:
    if options.runtime_split_send_recv or not param.sliced:
        return [param.param]
    return declare_param_blocks(trainer, param)


def _send_attrs(plan: Plan, param: ParamPlan, options: TranspileOptions) -> dict:
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
