"""The `listen_and_serv` kernel: block 0 of a pserver program.

It reads the op's attrs into a `ServeConfig`, starts a `PServer` over the scope the
program runs in (the scope the pserver's startup program initialised), and returns
when every trainer has completed. Optimize blocks run in that same scope, as
children of this op's frame: params, accumulators and the learning rate persist
across steps, and what a block declares itself stays local to the block's run.

The distributed lookup table adds three things the attrs name: its update block in
`grad_to_block_id` (its grads are not in `X`: in sync mode the vars the trainers send
for it are found from the block, `trainer_sent_vars`), prefetch blocks
(`prefetch_var_name_to_block_id`, `"<ids var>:<block>"`; each runs in a scope of its
own per request and answers with the var it writes, `prefetch_output`), and the
checkpoint block (`checkpint_block_id`, sic), run on a lookup-table checkpoint notice
after `kLookupTablePath` is bound to the notice's path.

Runtime options come from the executor's env (`Executor(env={...})`):

| key | meaning |
|---|---|
| `refuse_nonfinite` | refuse a received grad holding a NaN or an Inf (default `PSTRANSPILE_REFUSE_NONFINITE=1`, else off) |
| `lost_grace` | seconds a trainer whose connection closed (killed) has to come back before the pserver fails (default 3) |
| `rpc_timeout` | seconds a pserver waits for a silent trainer (default `PSTRANSPILE_RPC_TIMEOUT` or 120) |
| `bind_endpoint` | listen here instead of the `endpoint` attr (e.g. `0.0.0.0:6174`, or port 0 in tests) |
| `pserver_ready` | called with the `PServer` once it listens (tests read `.port`, call `.stop()`) |
| `pserver_log` | called with a line at start and end (default: print to stderr; None: quiet) |
| `pserver_auth` | the `ops.rpc.auth.ServerAuth` (token, TLS, `insecure`; default: from the environment) |
| `plan_fingerprint` | the job's plan fingerprint, for the handshake (default: not compared) |
| `checkpointer` | an `ops.rpc.checkpoint.Checkpointer`: where checkpoint notices write (none: refused) |
| `restorer` | an `ops.rpc.own_dirs.PartRestorer`: var RPCs wait for the restore trainer 0 agrees |
"""

from __future__ import annotations

from typing import Any

from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register
from ops.rpc import reduce
from ops.rpc.arrival_sum import find_plans
from ops.rpc.auth import ServerAuth
from ops.rpc.server import PServer, ServeConfig, print_log
from ops.rpc.service import LOST_GRACE, default_timeout, refuse_nonfinite_default
from transpiler.ir import Block, Program
from transpiler.ir.types import EMPTY_VAR_NAME, VarKind
from transpiler.naming import LOOKUP_TABLE_PATH, MalformedEntryError, decode_block_ids

LISTEN_EXTRA_DEFAULTS = {"sync_mode": True}  # older Paddles' attr; the catalogue holds 1.8's


def parse_grad_to_block(entries: Any, endpoint: str, attr: str = "grad_to_block_id") -> dict[str, int]:
    """`["fc_w@GRAD.block1:3", ...]` → `{"fc_w@GRAD.block1": 3}` (names may hold ':')."""
    try:
        return decode_block_ids(entries, attr)
    except MalformedEntryError as exc:
        raise KernelError(f"listen_and_serv on {endpoint}: {exc}") from None


def trainer_sent_vars(program: Program, grad_to_block: dict[str, int], listed: tuple[str, ...]) -> tuple[str, ...]:
    """What trainers send for the blocks of `grad_to_block_id` that `X` (`listed`) does
    not name (the distributed table's per-trainer shard grads): the vars a block reads
    (and its key) that no op of the program writes and block 0 declares without keeping
    them, or keeps as the block's key. In block order, then op order."""
    block0 = program.global_block()
    written = {name for blk in program.blocks for op in blk.ops for name in op.output_names}
    found: list[str] = []
    for name, idx in sorted(grad_to_block.items(), key=lambda item: (item[1], item[0])):
        reads = [name, *(arg for op in program.block(idx).ops for arg in op.input_names)]
        for arg in reads:
            var = block0.find_var(arg)
            if var is None or arg in written or arg in listed or arg in found:
                continue
            if arg == name or not var.persistable:
                found.append(arg)
    return tuple(found)


def prefetch_output(program: Program, idx: int, endpoint: str) -> str:
    """The var a prefetch block answers with: the last var its ops write that block 0
    declares and does not keep (Paddle's request names it; ours need not)."""
    block0 = program.global_block()
    outs = [
        name
        for op in program.block(idx).ops
        for name in op.output_names
        if name != EMPTY_VAR_NAME and block0.has_var(name) and not block0.var(name).persistable
    ]
    if not outs:
        raise KernelError(f"listen_and_serv on {endpoint}: prefetch block {idx} writes no var block 0 declares")
    return outs[-1]


def _template(block: Block, name: str) -> tuple[tuple[int, ...], object] | None:
    var = block.find_var(name)
    if var is None or var.shape is None or var.dtype is None:
        return None
    return tuple(var.shape), var.dtype.to_numpy()


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
    prefetch = parse_grad_to_block(ctx.attr("prefetch_var_name_to_block_id"), endpoint,
                                   "prefetch_var_name_to_block_id")
    checkpoint = int(ctx.attr("checkpint_block_id"))
    named = [*blocks, *grad_to_block.values(), *prefetch.values(), *(b for b in (lr_block, checkpoint) if b >= 0)]
    for idx in named:
        if not 0 < idx < program.num_blocks:
            raise KernelError(f"listen_and_serv on {endpoint}: block {idx} does not exist (the program has {program.num_blocks})")
    block = ctx.block
    received = ctx.input_names("X")
    if sync_mode:
        received = (*received, *trainer_sent_vars(program, grad_to_block, received))
    declared = frozenset(n for n in block.vars if n != EMPTY_VAR_NAME)
    checked = (*received, *grad_to_block, *sorted(declared))
    templates = {name: t for name in checked if (t := _template(block, name)) is not None}
    decls = {name: block.find_var(name) for name in checked}
    sparse = frozenset(n for n, var in decls.items() if var is not None and var.kind == VarKind.SELECTED_ROWS)
    persistables = tuple(sorted(n for n, v in block.vars.items() if v.persistable and v.kind != VarKind.RAW))
    timeout = ctx.env.get("rpc_timeout")
    nonfinite = ctx.env.get("refuse_nonfinite")
    grace = ctx.env.get("lost_grace")
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
        sparse_vars=sparse,
        prefetch_blocks={name: (idx, prefetch_output(program, idx, endpoint)) for name, idx in prefetch.items()},
        checkpoint_block=checkpoint,
        checkpoint_path_var=LOOKUP_TABLE_PATH,
        auth=ctx.env.get("pserver_auth") or ServerAuth.from_env(),
        plan_fingerprint=ctx.env.get("plan_fingerprint"),
        checkpointer=ctx.env.get("checkpointer"),
        restorer=ctx.env.get("restorer"),
        refuse_nonfinite=bool(nonfinite) if nonfinite is not None else refuse_nonfinite_default(),
        lost_grace=float(grace) if grace is not None else LOST_GRACE,
        arrival_sums=find_plans(program, blocks, received, templates, sparse, persistables) if sync_mode else (),
    )


@register("listen_and_serv", defaults=LISTEN_EXTRA_DEFAULTS)
def listen_and_serv(ctx: OpContext) -> None:
    """Serve the pserver protocol until every trainer completed (see `ops.rpc.server`)."""
    config = serve_config(ctx)
    # Sync rounds: every read of a round (fetches, prefetches, checkpoints) ends before the
    # trainer's send barrier, so before the optimize blocks run: they may update in place.
    ctx.run.update_in_place = config.sync_mode
    ctx.run.concurrent_readers = True
    scope, frame = ctx.scope, ctx.frame
    log = ctx.env.get("pserver_log", print_log)
    server = PServer(
        config,
        scope,
        lambda idx: ctx.run.run_block(idx, scope, frame),
        log=log,
        run_in=lambda idx, own: ctx.run.run_block(idx, own, None),
    )
    ctx.run.skip_ops = server.skip_ops  # the `sum`s the server does on arrival (filled when it starts)
    ctx.run.lend_scratch = server.lend_chunk_buffer  # its idle chunk buffers, to the optimize blocks' kernels
    peers = reduce.needs_peers(ctx.run.program)  # a cross-pserver sum in the blocks (ops.rpc.reduce)
    if peers is not None:
        server.peer_reduce = reduce.PeerReduce(config.endpoint, peers, config.timeout)
        ctx.env[reduce.ENV_KEY] = server.peer_reduce
        ctx.env[reduce.STEP_KEY] = lambda: server.rounds + 1
    try:
        server.serve(on_ready=ctx.env.get("pserver_ready"))
    finally:
        reducer = server.peer_reduce
        if reducer is not None:
            reducer.close()
            if reducer.calls and log is not None:
                log(f"pserver {config.endpoint}: {reducer.calls} cross-pserver sum(s), "
                    f"{1000 * reducer.seconds / reducer.calls:.2f} ms and "
                    f"{reducer.bytes_sent / reducer.calls:.0f} bytes sent each")
