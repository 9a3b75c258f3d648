"""Pass: the trainer's startup program.

From a copy of the original startup program: drop the initializers of optimizer state
(every input of an optimize op that is not a param or grad: learning rate, moments,
beta powers), since that state lives on the pservers; then receive every param from
its pservers the way the main program does (`recv` per param, one `fetch_barrier`,
`concat` per cut param), so all trainers start from the pservers' values.

Tables whose rows are fetched on demand (remote-prefetch sparse tables, the distributed
table) are never received: their initializer becomes a `fake_init` that only declares
the shape, so a trainer never allocates a table it cannot hold. A sparse table that is
*not* prefetched is received like any param (Paddle 2.6 fake-inits it too, leaving the
trainer's first lookups reading an uninitialised table).
"""

from __future__ import annotations

from dataclasses import replace

from ops.catalogue import make_op
from transpiler.config import TranspileOptions
from transpiler.ir import OpRole
from transpiler.passes.bundle import Bundle
from transpiler.passes.contract import Pass
from transpiler.passes.trainer_vars import concat_ops, recv_attrs, recv_outputs, received_params


def optimizer_state_vars(bundle: Bundle) -> set[str]:
    """Inputs of optimize ops that are not params or grads: Paddle 1.7+'s
    `_delete_trainer_optimizer(is_startup=True)` removes their initialisers the same way."""
    inputs: set[str] = set()
    role_vars: set[str] = set()
    for op in bundle.analysis.optimize_ops:
        inputs.update(op.input_names)
        role_vars.update(op.role_vars)
    for chain in bundle.analysis.chains:
        role_vars.update((chain.param, chain.grad))
    return inputs - role_vars


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    plan = bundle.plan
    startup = bundle.origin_startup.clone()
    block = startup.global_block()
    state = optimizer_state_vars(bundle)
    block.remove_ops([op for op in block.ops if not state.isdisjoint(op.output_names)])
    for name in sorted(state):
        if block.has_var(name):
            block.remove_var(name)

    fetched_tables = [p.param for p in plan.params if p.remote_prefetch]
    if plan.table is not None:
        fetched_tables.append(plan.table.table)
    if fetched_tables:
        fetched = set(fetched_tables)
        block.remove_ops([op for op in block.ops if not fetched.isdisjoint(op.output_names)])

    ops = []  # all appended, so added at once (`Block.add_ops`)
    for param in received_params(plan):
        if not block.has_var(param.param):
            block.add_var(bundle.origin.global_block().var(param.param).copy())
        outs = recv_outputs(startup, param, options)
        ops.append(make_op("recv", {"X": []}, {"Out": outs}, recv_attrs(param, options), role=OpRole.RPC))
    ops.append(
        make_op(
            "fetch_barrier",
            {"X": []},
            {"Out": [bundle.new_control_var(startup)]},
            {"endpoints": list(options.endpoints), "trainer_id": options.trainer_id},
            role=OpRole.RPC,
        )
    )
    if not options.runtime_split_send_recv:
        ops.extend(op for param in received_params(plan) if param.sliced for op in concat_ops(startup, param))
    block.add_ops(ops)
    for table in fetched_tables:
        if not block.has_var(table):
            block.add_var(bundle.origin.global_block().var(table).copy())
        shape = list(block.var(table).shape)
        block.add_op(make_op("fake_init", {}, {"Out": [table]}, {"shape": shape}, role=OpRole.Forward))
    return replace(bundle, trainer_startup=startup)


PASS = Pass("trainer_startup", run, requires=("origin", "origin_startup", "analysis", "plan"), produces=("trainer_startup",))
