"""Replay a trainer's pserver traffic without its forward and backward passes.

A trainer program's RPC ops, run as `ops/rpc/kernels.py` runs them: every `send` of a grad
(block) of its declared shape and dtype, the send barrier (deferred into the fetch barrier
when `recv`s and a `fetch_barrier` follow, as the kernels do), every `recv` and the fetch
barrier. `pstranspile calibrate` measures a real sync pserver's per-round, per-block and
per-byte CPU with it; `benchmarks/cost_accuracy.py` drives ResNet-50's pservers with it.
Dense grads only: `rpc_ops` refuses a trainer program with a sparse lookup (a prefetch, a
SelectedRows grad).

A trainer program with a prefetched table is replayed by `sparse_replay` instead: the
program itself, reduced to its RPC ops and the ops that turn a lookup's grad into the
SelectedRows blocks sent, run by the executor's real kernels on each batch's ids, with
the forward and backward compute replaced by fed grads (`examples/train_ctr.py --replay`,
`benchmarks/planner.py`'s `replay` mode: the same bytes as the real job, step by step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from transpiler.errors import TranspileError


@dataclass
class RpcOps:
    """A trainer program's RPC ops: sends `(endpoint, wire name, var name, (sections, i) or
    None)`, recvs `(endpoint, remote name)`, the barriers' endpoints (None: no barrier)."""

    sends: list[tuple[str, str, str, tuple[list[int], int] | None]] = field(default_factory=list)
    recvs: list[tuple[str, str]] = field(default_factory=list)
    send_barrier: list[str] | None = None
    fetch_barrier: list[str] | None = None

    @property
    def endpoints(self) -> list[str]:
        return sorted({ep for ep, *_ in self.sends} | {ep for ep, _ in self.recvs})


def rpc_ops(program) -> RpcOps:
    """The RPC ops of `program`'s global block (see the module docstring)."""
    out = RpcOps()
    for op in program.global_block().ops:
        def attr(key: str, op=op):
            return op.attrs[key].value if key in op.attrs else ()

        if op.type in ("distributed_lookup_table", "prefetch", "lookup_sparse_table") or op.type.startswith("split_selected"):
            raise TranspileError(f"replay: the trainer program has a {op.type} op (a sparse table); only dense "
                                 "traffic is replayed")
        if op.type == "send":
            names, epmap = list(op.inputs["X"]), [str(e) for e in attr("epmap")]
            varnames = [str(n) for n in attr("send_varnames")]
            if varnames:
                sections = [int(s) for s in attr("sections")]
                out.sends += [(ep, name, names[0], (sections, i) if len(sections) > 1 else None)
                              for i, (name, ep) in enumerate(zip(varnames, epmap, strict=True))]
            elif len(names) == 1 and len(epmap) > 1:
                out.sends += [(ep, names[0], names[0], None) for ep in epmap]
            else:
                out.sends += [(ep, name, name, None) for name, ep in zip(names, epmap, strict=True)]
        elif op.type == "recv":
            if int(attr("do_not_run") or 0):
                continue
            outs, epmap = list(op.outputs["Out"]), [str(e) for e in attr("epmap")]
            remote = [str(n) for n in attr("recv_varnames")] or [str(n) for n in attr("varnames")] or outs
            out.recvs += list(zip(epmap, remote, strict=True))
        elif op.type == "send_barrier":
            out.send_barrier = [str(e) for e in attr("endpoints")]
        elif op.type == "fetch_barrier":
            out.fetch_barrier = [str(e) for e in attr("endpoints")]
    return out


def grad_values(program, ops: RpcOps, seed: int = 0) -> list[tuple[str, str, object]]:
    """`(endpoint, wire name, array)` of every send: random values of the declared shape
    and dtype (a row section of it for a split send)."""
    import numpy as np

    from transpiler.ir.types import DType

    rng = np.random.default_rng(seed)
    block = program.global_block()
    out = []
    for ep, name, var_name, sections in ops.sends:
        var = block.vars.get(var_name)
        if var is None or var.shape is None or any(int(d) < 0 for d in var.shape):
            raise TranspileError(f"replay: cannot size the sent var {var_name!r} (shape {getattr(var, 'shape', None)})")
        shape = [int(d) for d in var.shape]
        if sections is not None:
            shape[0] = sections[0][sections[1]]
        out.append((ep, name, (rng.standard_normal(shape) * 1e-3).astype(DType(var.dtype).to_numpy())))
    return out


def replay(client, main, startup, steps: int, on_step: Callable[[int], None] | None = None) -> None:
    """The startup's recvs and fetch barrier, then `steps` steps of `main`'s sends, send
    barrier, recvs and fetch barrier, through `client` (an `RpcClient` of the trainer's id);
    `on_step(k)` after each step (0: after the startup). Completes the trainer at the end."""
    first = rpc_ops(startup)
    if first.recvs or first.fetch_barrier:
        client.fetch_barrier(first.fetch_barrier or [], first.recvs)
    ops = rpc_ops(main)
    values = grad_values(main, ops, seed=client.trainer_id)
    defer = ops.send_barrier is not None and ops.fetch_barrier is not None
    if on_step:
        on_step(0)
    for step in range(1, steps + 1):
        for ep, name, value in values:
            client.send_async(ep, name, value)
        if ops.send_barrier is not None:
            client.send_barrier(ops.send_barrier, defer=defer)
        if ops.fetch_barrier is not None:
            client.fetch_barrier(ops.fetch_barrier, ops.recvs)
        elif ops.recvs:
            client.get_many(ops.recvs)
        else:
            client.wait_pending()
        if on_step:
            on_step(step)
    client.complete(ops.endpoints)


# ops a sparse replay keeps besides the RPC ops: what turns a lookup's grad into the
# SelectedRows blocks a trainer sends (the grad of the lookup's output is fed instead),
# and what turns the ids into a prefetch's requests (the distributed table's `split_ids`)
SPARSE_PLUMBING = ("lookup_table_grad", "lookup_table_v2_grad", "sum", "split_selected_rows",
                   "split_selected_rows_by_columns", "merge_selected_rows", "split_ids")
PREFETCHES = ("distributed_lookup_table", "prefetch")
RPC_OPS = ("send", "send_barrier", "recv", "fetch_barrier", *PREFETCHES)


@dataclass
class SparseReplay:
    """A trainer program reduced to its pserver traffic, its sparse part real.

    `program` keeps the trainer's RPC ops (the table's prefetch, every send, the barriers,
    the recvs) and the ops between a table lookup's grad and its sends (`SPARSE_PLUMBING`:
    `lookup_table_grad`, the `sum` of the slots' grads, the split into the table's blocks),
    which the real kernels run; the forward and backward compute is gone. Each step is fed
    the batch's ids (the lookups prefetch those rows, and their grads are SelectedRows of
    those rows, as in the job) and, in place of the compute, the grad of every lookup's
    output (`grad_of_lookups`: random rows of the table's width, one per id) and every
    dense grad sent (`dense_grads`: random values of the declared shape, drawn once)."""

    program: object
    id_slots: list[str]
    grad_of_lookups: list[tuple[str, str]]  # (the lookup's output grad fed, its Ids slot)
    dense_grads: dict[str, object]
    width: int
    dtype: object

    def __post_init__(self) -> None:
        self._rows = _grad_rows(4096, self.width, self.dtype)

    def feed(self, batch) -> dict:
        """The feeds of one replayed step from the job's feeds `batch` (its id slots used,
        the rest ignored)."""
        import numpy as np

        from ops.tensor import LoDTensor

        out = {slot: batch[slot] for slot in self.id_slots}
        for grad, slot in self.grad_of_lookups:
            ids = out[slot]
            count = int(np.asarray(ids.array if isinstance(ids, LoDTensor) else ids).size)
            if count > self._rows.shape[0]:
                self._rows = _grad_rows(count * 2, self.width, self.dtype)
            value = self._rows[:count]
            out[grad] = LoDTensor(value, ids.lod) if isinstance(ids, LoDTensor) and ids.lod else value
        return out | self.dense_grads


def _grad_rows(count: int, width: int, dtype) -> object:
    import numpy as np

    return (np.random.default_rng(count).standard_normal((count, width)) * 1e-3).astype(dtype)


def sparse_replay(program, seed: int = 0) -> SparseReplay:
    """`program` (a transpiled trainer program with a prefetched or distributed table)
    reduced to its traffic (see `SparseReplay`). An op that produces a sent var and is
    neither compute to replace nor `SPARSE_PLUMBING` raises `TranspileError`."""
    import numpy as np

    from transpiler.ir.types import DType, VarKind

    replay_program = program.clone()
    block = replay_program.global_block()
    writers = {name: op for op in block.ops for name in op.output_names}
    fed: dict[str, str | None] = {}  # var fed -> the Ids slot of its lookup (None: a dense grad)
    lookups = [op for op in block.ops if op.type in PREFETCHES]
    if not lookups:
        raise TranspileError("replay: the trainer program prefetches no table (no distributed_lookup_table or "
                             "prefetch op); replay its dense traffic with `replay`")
    keep = {i for i, op in enumerate(block.ops) if op.type in RPC_OPS}
    index_of = {id(op): i for i, op in enumerate(block.ops)}
    tables: set[str] = set()
    slots: set[str] = set()
    # backwards from what the RPC ops read: the plumbing kept, compute fed, a var nothing writes (an id feed) read
    todo = [name for op in block.ops if op.type in ("send", *PREFETCHES)
            for name in (op.input("Ids") if op.type == "distributed_lookup_table" else op.input("X"))]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        op = writers.get(name)
        if name in seen or (op is not None and op.type in RPC_OPS):
            continue
        seen.add(name)
        if op is None:
            slots.add(name)
            continue
        if op.type not in SPARSE_PLUMBING:
            var = block.vars.get(name)
            if var is not None and var.kind == VarKind.SELECTED_ROWS:
                raise TranspileError(f"replay: the sent SelectedRows {name!r} comes from a {op.type} op, which the "
                                     "replay cannot stand in for")
            fed[name] = None  # compute the replay replaces: fed
            continue
        keep.add(index_of[id(op)])
        if op.type.startswith("lookup_table"):
            tables.add(op.input("W")[0])
            fed[op.input("Out@GRAD")[0]] = op.input("Ids")[0]
            slots.add(op.input("Ids")[0])
        else:
            todo += list(op.input_names)
    block.remove_ops([op for i, op in enumerate(block.ops) if i not in keep])
    if len(tables) != 1:
        raise TranspileError(f"replay: the trainer sends the grads of {len(tables)} looked-up tables "
                             f"({', '.join(sorted(tables)) or 'none'}); one prefetched table is replayed")
    table = block.var(next(iter(tables)))
    width = int(np.prod([int(d) for d in table.shape[1:]]))
    dtype = DType(table.dtype).to_numpy()
    rng = np.random.default_rng(seed)
    dense = {}
    for name, slot in sorted(fed.items()):
        if slot is not None:
            continue
        var = block.vars.get(name)
        if var is None or var.shape is None or any(int(d) < 0 for d in var.shape):
            raise TranspileError(f"replay: cannot size the sent var {name!r} (shape {getattr(var, 'shape', None)})")
        dense[name] = (rng.standard_normal([int(d) for d in var.shape]) * 1e-3).astype(DType(var.dtype).to_numpy())
    return SparseReplay(replay_program, sorted(slots), sorted((g, s) for g, s in fed.items() if s is not None), dense,
                        width, dtype)
