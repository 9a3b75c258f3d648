"""Pass: block 0 of each pserver program gets its one op, `listen_and_serv`.

Its attrs gather what the pserver block passes collected: `optimize_blocks` (an empty
block is added when nothing is placed on the pserver, so the list is never empty),
`grad_to_block_id`, `sparse_grad_to_param`, `lr_decay_block_id` and the distributed
table's blocks, with the endpoint, `Fanin` (the trainer count) and the mode.

`rpc_{get,send,prefetch}_thread_num` are 12, as Paddle's transpiler writes them (its
`ServerRuntimeConfig`, FLAGS_rpc_*_thread_num's default); the op's own default is 1. Fluid
1.8.5's `listen_and_serv` starts that many gRPC handler threads per kind. With one, a sync
pserver stalled when a trainer's step-0 grads arrived before another trainer's startup
fetch: the one send thread waits in `RequestSendHandler` for the send phase, and the late
trainer's `GetRPC` went unanswered (gRPC error 14 after about 25 s) in 6 runs of 24; with
12, in none of 62 (docs/interop.md). Our runtime does not read them.
"""

from __future__ import annotations

from ops.catalogue import make_op
from transpiler.config import TranspileOptions
from transpiler.ir import OpRole
from transpiler.naming import encode_pairs
from transpiler.passes.bundle import Bundle
from transpiler.passes.contract import Pass

# Paddle's ServerRuntimeConfig: FLAGS_rpc_{get,send,prefetch}_thread_num, default 12 (a
# constant here: the programs do not depend on the environment they are transpiled in).
RPC_THREAD_NUM = 12


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    for endpoint, progs in bundle.pservers.items():
        if not progs.optimize_blocks:
            progs.optimize_blocks.append(progs.main.create_block(0).idx)
        attrs = {
            "endpoint": endpoint,
            "pserver_id": options.endpoints.index(endpoint),
            "Fanin": options.trainers,
            "sync_mode": options.sync_mode,
            "distributed_mode": int(options.distributed_mode),
            "optimize_blocks": list(progs.optimize_blocks),
            "grad_to_block_id": encode_pairs(progs.grad_to_block),
            "sparse_grad_to_param": encode_pairs(progs.sparse_grad_to_param),
            "lr_decay_block_id": progs.lr_block,
            "rpc_get_thread_num": RPC_THREAD_NUM,
            "rpc_send_thread_num": RPC_THREAD_NUM,
            "rpc_prefetch_thread_num": RPC_THREAD_NUM,
            **progs.table_attrs,
        }
        serve = make_op("listen_and_serv", {"X": progs.received}, {}, attrs, role=OpRole.RPC)
        progs.main.global_block().add_op(serve, index=0)
    return bundle


PASS = Pass("pserver_serve", run, requires=("plan", "pservers"), produces=("pservers.optimize_blocks",))
