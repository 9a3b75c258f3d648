"""Cross-pserver sums: the `pserver_allreduce_sum` kernel and the `PeerReduce` that runs it.

In a sync round, after the pservers averaged the trainers' grads, each one computes a
partial sum (of the squares of the grad blocks it holds: transpiler/passes/
pserver_norm_reduce.py) and every pserver needs the total. Pserver to pserver: each sends
its partial to every other pserver (`SendVariable`, named `@PEER_PARTIAL@<step>@<rank>@<var>`,
with the job token like every RPC; the receiving `PServer` hands it here before its
trainer bookkeeping), then waits for the others' and adds all of them in pserver order,
own included: every pserver computes the same bits. A peer that does not answer (its
process gone, or not sending) fails the step within the RPC timeout, naming the peer.

Cost per step and pserver: P - 1 messages of one [1] tensor each way (a few hundred bytes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register
from ops.rpc.auth import ClientAuth
from ops.rpc.wire import WireVar, encode_var
from ops.tensor import LoDTensor

PREFIX = "@PEER_PARTIAL@"
ENV_KEY = "peer_reduce"  # the executor env's PeerReduce (set by the listen_and_serv kernel)
STEP_KEY = "pserver_step"  # a callable: the sync round being run (1, 2, ...)


def partial_name(step: int, rank: int, var: str) -> str:
    return f"{PREFIX}{step}@{rank}@{var}"


def parse_partial_name(name: str) -> tuple[int, int, str]:
    if not name.startswith(PREFIX):
        raise ValueError(f"{name!r} is not a peer partial")
    step, rank, var = name[len(PREFIX):].split("@", 2)
    return int(step), int(rank), var


Send = Callable[[str, str, np.ndarray, float], None]  # (peer endpoint, message name, value, timeout)


class PeerReduce:
    """This pserver's side of the sums: its rank among `endpoints`, what peers sent."""

    def __init__(self, endpoint: str, endpoints: Sequence[str], timeout: float, *,
                 auth: ClientAuth | None = None, send: Send | None = None) -> None:
        self.endpoints = tuple(endpoints)
        if endpoint not in self.endpoints:
            raise KernelError(f"pserver_allreduce_sum: {endpoint} is not among its endpoints {list(self.endpoints)}")
        self.endpoint = endpoint
        self.rank = self.endpoints.index(endpoint)
        self.timeout = float(timeout)
        self._auth = auth
        self._send = send or self._grpc_send
        self._channels: dict[str, Any] = {}
        self._mail: dict[tuple[int, str], dict[int, np.ndarray]] = {}
        self._cond = threading.Condition()
        self.bytes_sent = 0
        self.seconds = 0.0  # spent in `allreduce` (sending, then waiting for the peers)
        self.calls = 0

    # ---------------------------------------------------------------- receiving
    def receive(self, var: WireVar) -> None:
        """A peer's partial (called by the PServer's SendVariable handler)."""
        step, rank, name = parse_partial_name(var.name)
        if not 0 <= rank < len(self.endpoints) or rank == self.rank:
            raise ValueError(f"peer partial {var.name!r}: rank {rank} is not another pserver's")
        if not isinstance(var.value, LoDTensor):
            raise ValueError(f"peer partial {var.name!r} carries no dense tensor")
        with self._cond:
            got = self._mail.setdefault((step, name), {})
            if rank in got:
                raise ValueError(f"peer partial {var.name!r} arrived twice")
            got[rank] = np.array(var.value.array)
            self._cond.notify_all()

    # ---------------------------------------------------------------- the sum
    def allreduce(self, var: str, value: np.ndarray, step: int) -> np.ndarray:
        start = time.perf_counter()
        for rank, peer in enumerate(self.endpoints):
            if rank != self.rank:
                try:
                    self._send(peer, partial_name(step, self.rank, var), value, self.timeout)
                except Exception as exc:  # noqa: BLE001  (a gRPC error or a refused call: the step cannot go on)
                    reason = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                    raise KernelError(f"pserver {self.endpoint}: step {step}: sending the partial sum {var!r} to "
                                      f"peer pserver {peer} failed: {reason}") from None
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                got = self._mail.get((step, var), {})
                missing = [self.endpoints[r] for r in range(len(self.endpoints)) if r != self.rank and r not in got]
                if not missing:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KernelError(f"pserver {self.endpoint}: step {step}: no partial sum {var!r} from peer "
                                      f"pserver(s) {', '.join(missing)} within {self.timeout:g} s (lost or stalled)")
                self._cond.wait(min(left, 1.0))
            parts = self._mail.pop((step, var))
        parts[self.rank] = np.asarray(value)
        total = parts[0].copy()
        for rank in range(1, len(self.endpoints)):
            total = total + parts[rank]
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return total

    # ---------------------------------------------------------------- transport
    def _grpc_send(self, peer: str, name: str, value: np.ndarray, timeout: float) -> None:
        from ops.rpc.client import _Endpoint, RpcStats  # the trainer client's channel setup

        ep = self._channels.get(peer)
        if ep is None:
            auth = self._auth or ClientAuth.from_env()
            ep = self._channels[peer] = _Endpoint(peer, RpcStats(), auth, auth.metadata(None))
        message = encode_var(name, LoDTensor(np.ascontiguousarray(value)))
        self.bytes_sent += len(message)
        ep.calls["SendVariable"](message, timeout=timeout, wait_for_ready=True)

    def close(self) -> None:
        for ep in self._channels.values():
            ep.channel.close()
        self._channels.clear()


@register("pserver_allreduce_sum")
def pserver_allreduce_sum(ctx: OpContext) -> None:
    """Out = the sum of X over every pserver (see the module docstring)."""
    reducer = ctx.env.get(ENV_KEY)
    step = ctx.env.get(STEP_KEY)
    if reducer is None or step is None:
        raise KernelError("pserver_allreduce_sum runs in a sync pserver's optimize blocks (listen_and_serv), "
                          "where it reaches the other pservers")
    value = np.asarray(ctx.input("X"))
    ctx.set_output("Out", reducer.allreduce(ctx.output_names("Out")[0], value, int(step())))


def needs_peers(program: Any) -> list[str] | None:
    """The endpoints of the program's first `pserver_allreduce_sum`, None without one."""
    for block in program.blocks:
        for op in block.ops:
            if op.type == "pserver_allreduce_sum":
                return [str(e) for e in op.attr("endpoints")]
    return None
