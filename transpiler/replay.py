"""Replay a trainer's pserver traffic without its forward and backward passes.

A trainer program's RPC ops, run as `ops/rpc/kernels.py` runs them: every `send` of a grad
(block) of its declared shape and dtype, the send barrier (deferred into the fetch barrier
when `recv`s and a `fetch_barrier` follow, as the kernels do), every `recv` and the fetch
barrier. `pstranspile calibrate` measures a real sync pserver's per-round, per-block and
per-byte CPU with it; `benchmarks/cost_accuracy.py` drives ResNet-50's pservers with it.
Dense grads only: a trainer program with a sparse lookup (a prefetch, a SelectedRows grad)
is refused.
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

