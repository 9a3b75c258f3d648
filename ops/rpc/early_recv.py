"""Early receives (issue 30, `PSTRANSPILE_EARLY_RECV=auto|off|on`, `auto` by default): a sync trainer's
`fetch_barrier` that returns before the params are in.

The sync trainer program ends `send_barrier, recv..., fetch_barrier, concat...`: the
pservers' replies carry every param block, and the `concat`s join the blocks into the
params the next step's forward reads, first layer first. With early receives the
`fetch_barrier` sends its one `SendFetchBatch` per pserver (`RpcClient.fetch_barrier_early`)
and returns; the replies come in on the client's `recv` thread while the run ends and the
next one starts. Until a var is complete its name is pending in the scope
(`Scope.expect`): every read or write of it waits there, bounded, so an op (the next
step's `mul`, a user's `scope.find_var`, a fetch of the param, a checkpoint save) waits
only for the params it touches, and nothing reads a half-written array.

What is pending: each `recv` output that no `concat` joins (a param fetched whole) until
its value is in; each param a `concat` right after the barrier joins, until all its
blocks are in. Those `concat`s are done here and skipped by the executor
(`RunContext.skip_ops`): blocks the bulk channel received straight into the param's rows
(`ops.rpc.kernels._destinations`) tile it already (the `concat` would copy nothing),
others are joined with `np.concatenate`, the same bits as the `concat` kernel. The block
vars are not bound in the scope (the `concat` was their only reader, which the plan
checks; else the `fetch_barrier` waits as without early receives).

The replies list each pserver's vars in the order the block first reads them (forward
order), so the first layer's param arrives first. A var whose reply fails, or whose
shape is not the declared one, stays pending with the error: a read raises it, naming
the var (the client's next call raises the call's failure too), and a param received
into is dropped from the scope, as without early receives.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ops.kernels.context import KernelError, OpContext
from ops.kernels.tensor_ops import tiles_rows
from ops.rpc.client import RpcClient
from ops.rpc.errors import RpcError
from ops.scope import Scope
from ops.tensor import LoDTensor

UNREAD = 1 << 40  # the order of a var the block never reads
Deferred = list[tuple[OpContext, list[tuple[str, str]]]]  # (recv op's context, its (endpoint, name) requests)


class _Arrival:
    """A pending name's wait (`ops.scope.Pending`): set once the var is in or failed."""

    __slots__ = ("event", "error", "limit", "what")

    def __init__(self, limit: float, what: str) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None
        self.limit = limit
        self.what = what

    def wait(self, name: str, read: bool) -> None:
        if not self.event.wait(self.limit):
            raise RpcError(f"{self.what}: var {name!r} was still not received after {self.limit:g} s")
        if read and self.error is not None:
            raise self.error


@dataclass(frozen=True)
class _Shape:
    """What a block's structure allows, worked out once per prepared block (`ctx.memo`)."""

    concats: tuple[tuple[int, str, tuple[str, ...]], ...]  # (op index, param, its blocks) of the concats after
    first_read: dict[str, int]  # var -> index of the block's first op reading it


class _Target:
    """One pending name: where it is bound, its wait, whether it is settled."""

    __slots__ = ("name", "scopes", "arrival", "done")

    def __init__(self, name: str, scopes: list[Scope], arrival: _Arrival) -> None:
        self.name, self.scopes, self.arrival, self.done = name, scopes, arrival, False


class _Group:
    """A param a `concat` joins: its blocks in order, what has arrived, the array they
    were received into (None: not received into)."""

    __slots__ = ("target", "blocks", "values", "received_into")

    def __init__(self, target: _Target, blocks: tuple[str, ...], received_into: bool) -> None:
        self.target, self.blocks, self.received_into = target, blocks, received_into
        self.values: dict[str, Any] = {}


def _shape(ctx: OpContext, deferred: Deferred) -> _Shape | None:
    """The block's concats after this `fetch_barrier`, or None when early receives cannot
    apply (a block var someone else reads, a join other than an axis-0 `concat` of
    fetched blocks)."""
    key = "early_recv_shape"
    if key in ctx.memo:
        return ctx.memo[key]
    from ops.rpc.kernels import joins_after  # (ops.rpc.kernels imports this module)

    outs = {name for recv_ctx, _ in deferred for name in recv_ctx.output_names("Out")}
    ops = ctx.block.ops
    concats = []
    joined: set[str] = set()
    for i, op, param, xs in joins_after(ctx, outs):
        if op.inputs.get("AxisTensor") or any(x in joined for x in xs):
            break
        joined.update(xs)
        concats.append((i, param, xs))
    first_read: dict[str, int] = {}
    shape: _Shape | None = _Shape(tuple(concats), first_read)
    for i, op in enumerate(ops):
        for name in op.input_names:
            first_read.setdefault(name, i)
            if name in joined and not (op.type == "concat" and any(i == c[0] for c in concats)):
                shape = None  # a block read elsewhere: it would have to be bound
    program = ctx.block.program
    if shape is not None and program is not None:
        for other in program.blocks:
            if other is not ctx.block and any(joined & set(op.input_names) for op in other.ops):
                shape = None
    ctx.memo[key] = shape
    return shape


def receive_early(ctx: OpContext, client: RpcClient, endpoints: list[str], deferred: Deferred,
                  into: dict[tuple[str, str], np.ndarray], params: list[str]) -> bool:
    """Start the step's fetch with early receives when the block allows (module
    docstring); False (nothing done) when it does not."""
    shape = _shape(ctx, deferred)
    if shape is None or any(x in ctx.run.keep for _, _, xs in shape.concats for x in xs):
        return False
    group_of: dict[str, str] = {x: out for _, out, xs in shape.concats for x in xs}
    limit = client.deadline + 5.0
    what = f"trainer {client.trainer_id}"
    targets: dict[str, _Target] = {}

    def target(name: str) -> _Target:
        found = targets.get(name)
        if found is None:
            scopes = [ctx.frame.target(name)]
            holder = ctx.scope.find_scope(name)
            if holder is not None and holder is not scopes[0]:
                scopes.append(holder)  # where it is read from until the new value shadows it
            found = targets[name] = _Target(name, scopes, _Arrival(limit, what))
        return found

    # (endpoint, name) -> [(recv op's context, output name)]
    routes: dict[tuple[str, str], list[tuple[OpContext, str]]] = {}
    for recv_ctx, wanted in deferred:
        for out, request in zip(recv_ctx.output_names("Out"), wanted, strict=True):
            routes.setdefault(request, []).append((recv_ctx, out))
            if out not in group_of:
                target(out)
    param_set = set(params)
    groups: dict[str, _Group] = {}
    for _, param, xs in shape.concats:
        # Where its blocks went is asked once they are in: a released param's array is made
        # only when its first block arrives (`ops.rpc.kernels._Destinations`), after the grads left.
        groups[param] = _Group(target(param), xs, param in param_set)
    lock = threading.Lock()

    def settle(tgt: _Target, value: Any = None) -> None:
        if tgt.done:
            return
        tgt.done = True
        for i, scope in enumerate(tgt.scopes):
            if value is not None and i == 0:
                scope.settle(tgt.name, tgt.arrival, value)
            else:
                scope.settle(tgt.name, tgt.arrival)
        tgt.arrival.event.set()

    def fail(tgt: _Target, error: BaseException) -> None:
        if tgt.done:
            return
        tgt.done = True
        tgt.arrival.error = error
        for scope in tgt.scopes:
            scope.fail(tgt.name, tgt.arrival)
        tgt.arrival.event.set()

    def arrived(endpoint: str, name: str, value: Any) -> None:
        with lock:
            for recv_ctx, out in routes.get((endpoint, name), ()):
                param = group_of.get(out)
                tgt = targets[param] if param is not None else targets[out]
                if tgt.done:
                    continue
                try:
                    _check_shape(recv_ctx, out, value)
                except KernelError as exc:
                    fail(tgt, RpcError(f"{what}: var {tgt.name!r}: {exc}"))
                    continue
                if param is None:
                    settle(tgt, value)
                    continue
                group = groups[param]
                group.values[out] = value
                if len(group.values) == len(group.blocks):
                    try:
                        settle(tgt, _joined(group, into))
                    except ValueError as exc:  # blocks that do not join (np.concatenate's reason)
                        fail(tgt, RpcError(f"{what}: var {tgt.name!r}: its blocks do not join ({exc})"))
                    group.values.clear()

    def failed(error: BaseException) -> None:
        with lock:
            for tgt in targets.values():
                fail(tgt, RpcError(f"{what}: var {tgt.name!r} was not received: {error}"))

    for tgt in targets.values():
        for scope in tgt.scopes:
            scope.expect(tgt.name, tgt.arrival)
    ctx.run.skip_ops = frozenset(ctx.run.skip_ops) | {(ctx.block.idx, i) for i, _, _ in shape.concats}

    def order(request: tuple[str, str]) -> int:  # the block's first read of what the request fills
        outs = [group_of.get(out, out) for _, out in routes[request]]
        return min(shape.first_read.get(out, UNREAD) for out in outs)

    requests = sorted(routes, key=order)
    try:
        client.fetch_barrier_early(endpoints, requests, into, arrived, failed)
    except BaseException as exc:
        failed(exc)
        raise
    return True


def _joined(group: _Group, into: Any) -> Any:
    """The param's value once its blocks are all in: None (keep the scope's) when they were
    received straight into its rows and tile it, the array they were received into when
    that is a new one (a param released after its last read, `ops.executor.Liveness`),
    else their concatenation (the `concat` kernel's bits)."""
    arrays = [_dense(group.values[name]) for name in group.blocks]
    if group.received_into:
        whole, new = into.whole(group.target.name)
        if whole is not None and tiles_rows(whole, arrays):
            return LoDTensor(whole) if new else None
    return LoDTensor(np.concatenate(arrays, axis=0))


def _dense(value: Any) -> np.ndarray:
    from ops.rpc.kernels import _dense as dense  # the recv kernel's own (ops.rpc.kernels imports this module)

    return dense(value)


def _check_shape(ctx: OpContext, name: str, value: Any) -> None:
    from ops.rpc.kernels import _check_shape as check  # the recv kernel's own check

    check(ctx, name, value)
