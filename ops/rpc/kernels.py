"""The trainer-side RPC kernels: `send`, `recv`, `send_barrier`, `fetch_barrier`,
`checkpoint_notify` (the prefetch kernels are in `ops.rpc.prefetch`).

Each reaches the trainer's `RpcClient` through `ctx.env["rpc"]`, else through
`get_client(trainer_id attr)`. A step is few messages (see `ops.rpc.client`): `send`
only queues its vars (a big dense grad of a sync step starts at once on the bulk
channel: early sends, `ops.rpc.client`); the `send_barrier` sends each pserver one
message with its vars and the barrier. Without a later `send` or `send_barrier` in the block (async mode), the
last `send` flushes the queue, one message per pserver. A `recv` followed by a
`fetch_barrier` before anything reads what it receives (the sync trainer program, every
trainer startup) only registers what it wants: the `fetch_barrier` fetches it all, one
message per pserver with the barrier, and writes the values (or, with early receives,
returns before they are in: `ops.rpc.early_recv`). Which of these applies is
a fact of the op's place in its block, worked out once per prepared block (`ctx.memo`).
A `send_barrier` followed by `recv`s and a `fetch_barrier` (the sync trainer program)
defers its message: the `fetch_barrier` sends each pserver one `SendFetchBatch`, grads
and both barriers and the params it wants, so a sync step is one RPC per pserver.

`runtime_split_send_recv` programs carry whole vars: `send` with `send_varnames`
splits X by the row counts of `sections` and sends block i as `send_varnames[i]` to
`epmap[i]`; `recv` with `recv_varnames` fetches block i from `epmap[i]` and
concatenates them (axis 0) into its one output. A `send` of one var to several
endpoints without sections (the async lr-decay counter) goes to every one of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Container, Iterator, Mapping
from typing import Any

import numpy as np

from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register
from ops.rpc import early_recv
from ops.rpc.client import RpcClient, get_client
from ops.tensor import LoDTensor, SelectedRows
from transpiler.ir import Op



def client_of(ctx: OpContext) -> RpcClient:
    client = ctx.env.get("rpc")
    if client is not None:
        return client
    return get_client(int(ctx.attr("trainer_id", 0)))


def split_rows(value: Any, sections: list[int]) -> list[Any]:
    """Blocks of `sections` rows of a dense value (views) or a SelectedRows (rows re-based)."""
    if isinstance(value, SelectedRows):
        starts = np.concatenate(([0], np.cumsum(sections)[:-1])).astype(np.int64)
        which = np.searchsorted(starts[1:], value.rows, side="right")
        active = value.active_value()
        return [
            SelectedRows(value.rows[which == k] - starts[k], active[which == k], int(sections[k]))
            for k in range(len(sections))
        ]
    array = value.array if isinstance(value, LoDTensor) else np.asarray(value)
    if sum(sections) != array.shape[0]:
        raise KernelError(f"sections {sections} do not add up to the {array.shape[0]} rows of the var")
    return np.split(array, np.cumsum(sections)[:-1], axis=0)


@register("send")
def send(ctx: OpContext) -> None:
    client = client_of(ctx)
    names = ctx.input_names("X")
    epmap = [str(ep) for ep in ctx.attr("epmap")]
    merge_add = bool(ctx.attr("merge_add"))
    send_varnames = [str(n) for n in ctx.attr("send_varnames")]
    if send_varnames:
        if len(names) != 1:
            raise KernelError(f"send with send_varnames splits one var, got {len(names)}")
        if len(send_varnames) != len(epmap):
            raise KernelError(f"send: {len(send_varnames)} send_varnames for {len(epmap)} endpoints")
        value = ctx.value("X")
        sections = [int(s) for s in ctx.attr("sections")]
        blocks = split_rows(value, sections) if len(sections) > 1 else [value]
        if len(blocks) != len(send_varnames):
            raise KernelError(f"send: {len(blocks)} blocks for {len(send_varnames)} send_varnames")
        for name, endpoint, block in zip(send_varnames, epmap, blocks, strict=True):
            client.send_async(endpoint, name, block, merge_add=merge_add, early=_barrier_after(ctx))
        _maybe_flush(ctx, client)
        return
    if len(names) == 1 and len(epmap) > 1:
        targets = [(names[0], ep) for ep in epmap]  # one var to every pserver
    elif len(epmap) == len(names):
        targets = list(zip(names, epmap, strict=True))
    else:
        raise KernelError(f"send: {len(names)} vars for {len(epmap)} endpoints in epmap")
    for name, endpoint in targets:
        value = ctx.scope.find_var(name)
        if value is None:
            raise KernelError(f"send: var {name!r} has no value in the scope")
        client.send_async(endpoint, name, value, merge_add=merge_add, early=_barrier_after(ctx))
    _maybe_flush(ctx, client)


def _barrier_after(ctx: OpContext) -> bool:
    """True when a `send_barrier` comes later in the block (a sync or half-async step): the
    var may start at once on the bulk channel (`RpcClient.send_async`, early sends) rather
    than wait for the step's last message. Memoised."""
    found = ctx.memo.get("barrier_after")
    if found is None:
        found = ctx.memo["barrier_after"] = any(op.type == "send_barrier" for op in _ops_after(ctx))
    return found


def _maybe_flush(ctx: OpContext, client: RpcClient) -> None:
    """Start the queued sends unless a later `send` or `send_barrier` of the block will."""
    last = ctx.memo.get("last_send")
    if last is None:
        last = ctx.memo["last_send"] = not any(op.type in ("send", "send_barrier") for op in _ops_after(ctx))
    if last:
        client.flush()


def _ops_after(ctx: OpContext) -> tuple[Op, ...]:
    """The ops after this one in its block."""
    return ctx.block.ops[_op_index(ctx) + 1 :]


def _op_index(ctx: OpContext) -> int:
    """This op's index in its block."""
    ops = ctx.block.ops
    return next((i for i, op in enumerate(ops) if op is ctx.op), len(ops))


@register("recv")
def recv(ctx: OpContext) -> None:
    if int(ctx.attr("do_not_run")):
        return
    client = client_of(ctx)
    outs = ctx.output_names("Out")
    epmap = [str(ep) for ep in ctx.attr("epmap")]
    recv_varnames = [str(n) for n in ctx.attr("recv_varnames")]
    if recv_varnames:
        if len(outs) != 1 or len(recv_varnames) != len(epmap):
            raise KernelError(f"recv with recv_varnames: {len(recv_varnames)} names, {len(epmap)} endpoints, {len(outs)} outputs")
        blocks = client.get_many(list(zip(epmap, recv_varnames, strict=True)))
        value = blocks[0] if len(blocks) == 1 else LoDTensor(np.concatenate([_dense(b) for b in blocks], axis=0))
        _check_shape(ctx, outs[0], value)
        ctx.set_output("Out", value)
        return
    remote = [str(n) for n in ctx.attr("varnames")] or list(outs)
    if len(remote) != len(outs) or len(epmap) != len(outs):
        raise KernelError(f"recv: {len(outs)} outputs, {len(remote)} names, {len(epmap)} endpoints in epmap")
    requests = list(zip(epmap, remote, strict=True))
    if _barrier_follows(ctx, outs):
        ctx.env.setdefault(DEFERRED_KEY, []).append((ctx, requests))
    else:
        _write_outs(ctx, client.get_many(requests))


DEFERRED_KEY = "_deferred_recvs"  # per run: RunContext.env is a fresh dict each run


def _write_outs(ctx: OpContext, values: list[Any]) -> None:
    for i, (name, value) in enumerate(zip(ctx.output_names("Out"), values, strict=True)):
        _check_shape(ctx, name, value)
        ctx.set_output("Out", value, i=i)


def _barrier_follows(ctx: OpContext, outs: tuple[str, ...]) -> bool:
    """True when a fetch_barrier comes after this op before any op reads `outs`."""
    wanted = set(outs)
    return _fetch_barrier_before(ctx, "barrier_follows",
                                 lambda op: bool(wanted & set(op.input_names)) or bool(op.sub_block_indices()))


def _fetch_barrier_before(ctx: OpContext, memo_key: str, stops: Callable[[Op], bool]) -> bool:
    """True when a `fetch_barrier` comes after this op before any op that `stops` the
    scan; memoised under `memo_key` for as long as the block is unchanged."""
    found = ctx.memo.get(memo_key)
    if found is None:
        found = False
        for op in _ops_after(ctx):
            if op.type == "fetch_barrier":
                found = True
                break
            if stops(op):
                break
        ctx.memo[memo_key] = found
    return found


def _dense(value: Any) -> np.ndarray:
    if isinstance(value, SelectedRows):
        return value.to_dense()
    return value.array


def _check_shape(ctx: OpContext, name: str, value: Any) -> None:
    """A received tensor must fit its declaration (-1 matches any size)."""
    var = ctx.decl(name)
    if var is None or var.shape is None or not isinstance(value, LoDTensor):
        return
    got, want = tuple(value.array.shape), tuple(var.shape)
    if len(got) != len(want) or any(w >= 0 and g != w for g, w in zip(got, want, strict=True)):
        raise KernelError(f"recv: the pserver sent {name!r} with shape {list(got)}, the program declares {list(want)}")


@register("send_barrier")
def send_barrier(ctx: OpContext) -> None:
    """Send the queued vars and the barrier; deferred to the `fetch_barrier` (one message
    per pserver for both) when it follows with only `recv`s between, as in every sync
    trainer program: nothing between reads what the pservers hold."""
    client = client_of(ctx)
    client.send_barrier([str(ep) for ep in ctx.attr("endpoints")], defer=_fetch_barrier_follows(ctx))


def _fetch_barrier_follows(ctx: OpContext) -> bool:
    """True when the ops after this one are `recv`s up to a `fetch_barrier` (memoised)."""
    return _fetch_barrier_before(ctx, "fetch_barrier_follows", lambda op: op.type != "recv")


@register("fetch_barrier")
def fetch_barrier(ctx: OpContext) -> None:
    """Fetch what the run's deferred recvs want and the barrier, one message per
    pserver, and write the values."""
    client = client_of(ctx)
    deferred = ctx.env.pop(DEFERRED_KEY, [])
    requests = [request for _, wanted in deferred for request in wanted]
    into, params = _destinations(ctx, deferred)
    endpoints = [str(ep) for ep in ctx.attr("endpoints")]
    # Early receives (`ops.rpc.early_recv`): `auto` where the bulk channel receives some
    # param straight into its array, `on` wherever the block allows.
    if (deferred and client.receives_early()
            and (client.early_recv == "on" or any(client.has_bulk(ep) for ep, _ in into))
            and early_recv.receive_early(ctx, client, endpoints, deferred, into, params)):
        return
    try:
        values = iter(client.fetch_barrier(endpoints, requests, into) if into
                      else client.fetch_barrier(endpoints, requests))
    except BaseException:
        # A param received into may be half written: drop it, so that a later read fails
        # ("not in the scope") instead of computing with it.
        ctx.scope.erase(*params)
        raise
    into.bind()
    for recv_ctx, wanted in deferred:
        _write_outs(recv_ctx, [next(values) for _ in wanted])


def _destinations(ctx: OpContext, deferred: list[tuple[OpContext, list[tuple[str, str]]]]
                  ) -> tuple[_Destinations, list[str]]:
    """Where the bulk channel may receive the fetched param blocks: the rows of the param
    they are joined into, when the ops right after this one are `concat`s (axis 0) of
    blocks it fetches, in order, into a param that nothing but the scope holds
    (`OpContext.unshared_array`) and that no op before its `concat` names, or that the
    scope holds no value of (released after its last read, `ops.executor.Liveness`:
    then into a new array, made when its first block arrives). The `concat` then finds
    its blocks tiling the param and copies nothing (`_joined_already`): the same bits as
    a join of new arrays, no param-sized array per step. ((endpoint, name) -> view, the
    params concerned.)"""
    source = {}
    for recv_ctx, wanted in deferred:
        source.update(zip(recv_ctx.output_names("Out"), wanted, strict=True))
    into = _Destinations(ctx)
    params: list[str] = []
    if not source:
        return into, params
    for _, _, param, xs in joins_after(ctx, source):
        if len(xs) < 2:
            break
        if into.plan(param, [source[x] for x in xs], xs):
            params.append(param)
    return into, params


def joins_after(ctx: OpContext, fetched: Container[str]) -> list[tuple[int, Op, str, tuple[str, ...]]]:
    """The `concat`s right after this op (up to the first op that is not one of them)
    that join distinct `fetched` blocks along axis 0 into a var neither fetched nor among
    its blocks: (index in the block, the op, its Out, its X), in order. The `fetch_barrier`
    receives such blocks into the param's rows (`_destinations`), or joins them as they
    arrive (`ops.rpc.early_recv`)."""
    ops = ctx.block.ops
    joins = []
    for i in range(_op_index(ctx) + 1, len(ops)):
        op = ops[i]
        if op.type != "concat":
            break
        xs, outs = tuple(op.inputs.get("X", ())), op.outputs.get("Out", ())
        if (len(outs) != 1 or int(op.attr("axis", 0)) != 0 or outs[0] in fetched or outs[0] in xs
                or any(x not in fetched for x in xs) or len(set(xs)) != len(xs)):
            break
        joins.append((i, op, outs[0], xs))
    return joins


class _Destinations(Mapping):
    """(endpoint, name) -> the rows of its param a fetched block is received into. A
    param the scope holds no value of gets a new array when its first block arrives (on
    a receiving thread: this trainer's grads are sent by then, so malloc may give it
    their memory); `bind` puts those in the scope afterwards, on the op's thread."""

    def __init__(self, ctx: OpContext) -> None:
        self._ctx = ctx
        self._views: dict[tuple[str, str], np.ndarray] = {}
        self._later: dict[tuple[str, str], tuple[str, int, int]] = {}  # -> (param, first row, last row + 1)
        self._made: dict[str, np.ndarray] = {}
        self._held: dict[str, np.ndarray] = {}  # param -> the scope's array its blocks are received into
        self._lock = threading.Lock()

    def plan(self, param: str, requests: list[tuple[str, str]], blocks: tuple[str, ...]) -> bool:
        """Receive `requests` (the `blocks` of `param`, in order) into `param`'s rows when
        their declared shapes tile it; False (nothing planned) otherwise."""
        ctx = self._ctx
        shapes = [_fixed_shape(ctx.decl(name)) for name in blocks]
        if None in shapes:
            return False
        rows, start = [], 0
        for shape in shapes:
            rows.append((start, start + shape[0]))
            start += shape[0]
        if ctx.scope.find_var(param) is None:
            shape = _declared(ctx, param)
            if shape is None or not _tiles(shapes, shape):
                return False
            for request, (first, stop) in zip(requests, rows, strict=True):
                self._later[request] = (param, first, stop)
            return True
        array = ctx.unshared_array(param)
        if array is None or not _tiles(shapes, array.shape):
            return False
        for request, (first, stop) in zip(requests, rows, strict=True):
            self._views[request] = array[first:stop]
        self._held[param] = array
        return True

    def whole(self, param: str) -> tuple[np.ndarray | None, bool]:
        """The array `param`'s blocks were received into, and whether it is a new one (a
        released param's, which its reader must bind: an early receive, `ops.rpc.early_recv`);
        (None, False) before any block of a released param arrived, or for an unplanned one."""
        held = self._held.get(param)
        if held is not None:
            return held, False
        with self._lock:
            made = self._made.get(param)
        return made, made is not None

    def __getitem__(self, key: tuple[str, str]) -> np.ndarray:
        view = self._views.get(key)
        if view is not None:
            return view
        param, start, stop = self._later[key]
        with self._lock:
            array = self._made.get(param)
            if array is None:
                var = self._ctx.decl(param)
                array = self._made[param] = np.empty(tuple(var.shape), var.dtype.to_numpy())
        return array[start:stop]

    def __contains__(self, key: object) -> bool:
        return key in self._views or key in self._later

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter([*self._views, *self._later])

    def __len__(self) -> int:
        return len(self._views) + len(self._later)

    def bind(self) -> None:
        """Bind the new arrays made for released params (their blocks are in them)."""
        for param, array in self._made.items():
            self._ctx.frame.write(param, LoDTensor(array))
        self._made = {}


def _declared(ctx: OpContext, param: str) -> tuple[int, ...] | None:
    """`param`'s declared shape when it and its dtype are fully known and no other thread
    reads the scope (not on a pserver), else None."""
    var = ctx.decl(param)
    if ctx.run.concurrent_readers or ctx.run.update_in_place or var is None or var.dtype is None:
        return None
    return _fixed_shape(var)


def _fixed_shape(var) -> tuple[int, ...] | None:
    """A declared var's shape when it has one and every dim is known, else None."""
    if var is None or var.shape is None or not var.shape or any(d < 0 for d in var.shape):
        return None
    return tuple(var.shape)


def _tiles(shapes: list[tuple[int, ...]], whole: tuple[int, ...]) -> bool:
    """True when blocks of `shapes` stacked along axis 0 make `whole`."""
    return all(s[1:] == tuple(whole[1:]) for s in shapes) and sum(s[0] for s in shapes) == whole[0]


@register("checkpoint_notify")
def checkpoint_notify(ctx: OpContext) -> None:
    """Ask the pservers to checkpoint. `dir` is a name relative to each pserver's own
    checkpoint dir (a pserver refuses anything else, `ops.rpc.checkpoint`). With
    `lookup_table`, pserver `i` is sent `DIR/<lookup_table>_<i>` (Paddle's), where its
    checkpoint block saves its shard; without, `dir` names a whole checkpoint,
    `ckpt-<step>`, of which every pserver writes its part."""
    directory = str(ctx.attr("dir"))
    if not directory:
        raise KernelError("checkpoint_notify needs a `dir` attr")
    epmap = [str(ep) for ep in ctx.attr("epmap")]
    table = str(ctx.attr("lookup_table"))
    client = client_of(ctx)
    if table:
        client.checkpoint_notify_each([(ep, shard_path(directory, table, i)) for i, ep in enumerate(epmap)], table)
    else:
        client.checkpoint_notify(epmap, directory)


def shard_path(directory: str, table: str, index: int) -> str:
    """Where pserver `index` saves its shard of `table` (Paddle's `%s/%s_%d`)."""
    return f"{directory.rstrip('/')}/{table}_{index}"
