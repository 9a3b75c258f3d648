"""Pass: the trainer receives its params back from the pservers.

A `recv` per param (its blocks, its epmap), after the `send_barrier` in sync mode, else
after that param's own `send` — not for prefetched tables, whose rows are fetched as
needed; sync mode: one `fetch_barrier`; then a `concat` per cut param (none when `recv`
splits at run time, `runtime_split_send_recv`).
"""

from __future__ import annotations

from ops.catalogue import make_op
from transpiler.config import TranspileOptions
from transpiler.ir import OpRole
from transpiler.passes.bundle import Bundle
from transpiler.passes.contract import Pass
from transpiler.passes.trainer_vars import concat_ops, recv_attrs, recv_outputs, received_params


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    plan, trainer, sends = bundle.plan, bundle.trainer, bundle.trainer_sends
    block = trainer.global_block()
    received: list[str] = []
    ops = []  # all appended, so added at once (`Block.add_ops`)
    for param in received_params(plan):
        outs = recv_outputs(trainer, param, options)
        received.extend(outs)
        after = sends.barrier if sends.barrier and options.sync_mode else sends.control[param.param]
        ops.append(make_op("recv", {"X": [after]}, {"Out": outs}, recv_attrs(param, options), role=OpRole.RPC,
                           role_vars=(param.param, param.grad)))
    if options.sync_mode:
        ops.append(make_op(
            "fetch_barrier", {"X": [sends.barrier]}, {"Out": received},
            {"endpoints": list(options.endpoints), "trainer_id": options.trainer_id}, role=OpRole.RPC,
        ))
    if not options.runtime_split_send_recv:
        ops.extend(op for param in received_params(plan) if param.sliced for op in concat_ops(trainer, param))
    block.add_ops(ops)
    return bundle


PASS = Pass("insert_recvs", run, requires=("plan", "trainer", "trainer_sends"), produces=("trainer",))
