"""The `listen_and_serv` kernel: block 0 of a pserver program.

It reads the op's attrs into a `ServeConfig`, starts a `PServer` over the scope the
program runs in (the scope the pserver's startup program initialised), and returns
when every trainer has completed. Optimize blocks run in that same scope, as
children of this op's frame: params, accumulators and the learning rate persist
across steps, and what a block declares itself stays local to the block's run.

Runtime options come from the executor's env (`Executor(env={...})`):

| key | meaning |
|---|---|
| `rpc_timeout` | seconds a pserver waits for a silent trainer (default `PSTRANSPILE_RPC_TIMEOUT` or 120) |
| `bind_endpoint` | listen here instead of the `endpoint` attr (e.g. `0.0.0.0:6174`, or port 0 in tests) |
| `pserver_ready` | called with the `PServer` once it listens (tests read `.port`, call `.stop()`) |
| `pserver_log` | called with a line at start and end (default: print to stderr; None: quiet) |
"""

from __future__ import annotations

from typing import Any

from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register
from ops.rpc.server import PServer, ServeConfig, print_log
from ops.rpc.service import default_timeout
from transpiler.ir.types import EMPTY_VAR_NAME

LISTEN_DEFAULTS = {
    "endpoint": "127.0.0.1:6164",
    "optimize_blocks": (),
    "grad_to_block_id": (),
    "sparse_grad_to_param": (),
    "prefetch_var_name_to_block_id": (),
    "distributed_mode": 0,
    "Fanin": 1,
    "pserver_id": -1,
    "lr_decay_block_id": -1,
    "sync_mode": True,
}


def parse_grad_to_block(entries: Any, endpoint: str) -> dict[str, int]:
    """`["fc_w@GRAD.block1:3", ...]` → `{"fc_w@GRAD.block1": 3}` (names may hold ':')."""
    mapping: dict[str, int] = {}
    for entry in entries or ():
        name, sep, idx = str(entry).rpartition(":")
        if not sep or not name or not idx.lstrip("-").isdigit():
            raise KernelError(f"listen_and_serv on {endpoint}: malformed grad_to_block_id entry {entry!r}")
        mapping[name] = int(idx)
    return mapping


def serve_config(ctx: OpContext) -> ServeConfig:
    endpoint = str(ctx.attr("endpoint"))
    sync_mode = bool(ctx.attr("sync_mode"))
    mode = int(ctx.attr("distributed_mode"))
    if sync_mode != (mode == 0):
        raise KernelError(f"listen_and_serv on {endpoint}: sync_mode={sync_mode} contradicts distributed_mode={mode}")
    program = ctx.run.program
    blocks = tuple(int(b) for b in ctx.attr("optimize_blocks"))
    lr_block = int(ctx.attr("lr_decay_block_id"))
    grad_to_block = parse_grad_to_block(ctx.attr("grad_to_block_id"), endpoint)
    for idx in (*blocks, *grad_to_block.values(), *([lr_block] if lr_block >= 0 else [])):
        if not 0 < idx < program.num_blocks:
            raise KernelError(f"listen_and_serv on {endpoint}: block {idx} does not exist (the program has {program.num_blocks})")
    block = ctx.block
    received = ctx.input_names("X")
    templates = {}
    for name in received:
        var = block.find_var(name)
        if var is not None and var.shape is not None and var.dtype is not None:
            templates[name] = (tuple(var.shape), var.dtype.to_numpy())
    declared = frozenset(n for n in block.vars if n != EMPTY_VAR_NAME)
    persistables = tuple(sorted(n for n, v in block.vars.items() if v.persistable))
    timeout = ctx.env.get("rpc_timeout")
    return ServeConfig(
        endpoint=endpoint,
        fanin=int(ctx.attr("Fanin")),
        sync_mode=sync_mode,
        received=received,
        optimize_blocks=blocks,
        grad_to_block=grad_to_block,
        lr_decay_block=lr_block,
        pserver_id=int(ctx.attr("pserver_id")),
        timeout=float(timeout) if timeout is not None else default_timeout(),
        bind=ctx.env.get("bind_endpoint"),
        known_vars=declared | frozenset(received),
        templates=templates,
        persistables=persistables,
    )


@register("listen_and_serv", defaults=LISTEN_DEFAULTS)
def listen_and_serv(ctx: OpContext) -> None:
    """Serve the pserver protocol until every trainer completed (see `ops.rpc.server`)."""
    config = serve_config(ctx)
    scope, frame = ctx.scope, ctx.frame
    log = ctx.env.get("pserver_log", print_log)
    server = PServer(config, scope, lambda idx: ctx.run.run_block(idx, scope, frame), log=log)
    server.serve(on_ready=ctx.env.get("pserver_ready"))
