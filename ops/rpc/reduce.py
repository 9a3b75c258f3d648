"""Cross-pserver sums: the `pserver_allreduce_sum` kernel and the `PeerReduce` that runs it.

In a sync round, after the pservers averaged the trainers' grads, each one computes a
partial sum (of the squares of the grad blocks it holds: transpiler/passes/
pserver_norm_reduce.py) and every pserver needs the total. Pserver to pserver: each sends
its partial to every other pserver of the op's `endpoints` (`SendVariable`, named
`@PEER_PARTIAL@<step>@<sender endpoint>@<var>`, with the job token like every RPC; the
receiving `PServer` hands it here before its trainer bookkeeping), then waits for the
others' and adds all of them in the order of `endpoints`, own included: every pserver
computes the same bits. A sum may involve some pservers only (those holding blocks of one
param: LARS's norms). A peer that does not answer (its
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


def partial_name(step: int, sender: str, var: str) -> str:
    return f"{PREFIX}{step}@{sender}@{var}"


def parse_partial_name(name: str) -> tuple[int, str, str]:
    if not name.startswith(PREFIX):
        raise ValueError(f"{name!r} is not a peer partial")
    try:
        step, sender, var = name[len(PREFIX):].split("@", 2)
        return int(step), sender, var
    except ValueError:
        raise ValueError(f"{name!r} is not a peer partial (@PEER_PARTIAL@<step>@<endpoint>@<var>)") from None


Send = Callable[[str, str, np.ndarray, float], None]  # (peer endpoint, message name, value, timeout)


class PeerReduce:
    """This pserver's side of the sums: what its peers sent, by step, var and sender."""

    def __init__(self, endpoint: str, peers: Sequence[str], timeout: float, *,
                 auth: ClientAuth | None = None, send: Send | None = None) -> None:
        self.endpoint = endpoint
        self.peers = frozenset(peers) - {endpoint}  # every pserver this one sums with
        self.timeout = float(timeout)
        self._auth = auth
        self._send = send or self._grpc_send
        self._channels: dict[str, Any] = {}
        self._mail: dict[tuple[int, str], dict[str, np.ndarray]] = {}
        self._cond = threading.Condition()
        self.bytes_sent = 0
        self.seconds = 0.0  # spent in `allreduce` (sending, then waiting for the peers)
        self.calls = 0

    # ---------------------------------------------------------------- receiving
    def receive(self, var: WireVar) -> None:
        """A peer's partial (called by the PServer's SendVariable handler)."""
        step, sender, name = parse_partial_name(var.name)
        if sender not in self.peers:
            raise ValueError(f"peer partial {var.name!r}: {sender} is not a peer pserver of {self.endpoint}")
        if not isinstance(var.value, LoDTensor):
            raise ValueError(f"peer partial {var.name!r} carries no dense tensor")
        with self._cond:
            got = self._mail.setdefault((step, name), {})
            if sender in got:
                raise ValueError(f"peer partial {var.name!r} arrived twice")
            got[sender] = np.array(var.value.array)
            self._cond.notify_all()

    # ---------------------------------------------------------------- the sum
    def allreduce(self, var: str, value: np.ndarray, step: int, endpoints: Sequence[str]) -> np.ndarray:
        """The sum of `value` over `endpoints` (this pserver among them), in their order."""
        if self.endpoint not in endpoints:
            raise KernelError(f"pserver_allreduce_sum {var!r}: {self.endpoint} is not among its endpoints {list(endpoints)}")
        start = time.perf_counter()
        for peer in endpoints:
            if peer != self.endpoint:
                try:
                    self._send(peer, partial_name(step, self.endpoint, var), value, self.timeout)
                except Exception as exc:  # noqa: BLE001  (a gRPC error or a refused call: the step cannot go on)
                    reason = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                    raise KernelError(f"pserver {self.endpoint}: step {step}: sending the partial sum {var!r} to "
                                      f"peer pserver {peer} failed: {reason}") from None
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                got = self._mail.get((step, var), {})
                missing = [ep for ep in endpoints if ep != self.endpoint and ep not in got]
                if not missing:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KernelError(f"pserver {self.endpoint}: step {step}: no partial sum {var!r} from peer "
                                      f"pserver(s) {', '.join(missing)} within {self.timeout:g} s (lost or stalled)")
                self._cond.wait(min(left, 1.0))
            parts = self._mail.pop((step, var))
        parts[self.endpoint] = np.asarray(value)
        total = parts[endpoints[0]].copy()
        for ep in endpoints[1:]:
            total = total + parts[ep]
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
    endpoints = [str(e) for e in ctx.attr("endpoints")]
    ctx.set_output("Out", reducer.allreduce(ctx.output_names("Out")[0], value, int(step()), endpoints))


def needs_peers(program: Any) -> list[str] | None:
    """Every pserver the program's `pserver_allreduce_sum` ops sum with, None without one."""
    peers: dict[str, None] = {}
    for block in program.blocks:
        for op in block.ops:
            if op.type == "pserver_allreduce_sum":
                peers.update(dict.fromkeys(str(e) for e in op.attr("endpoints")))
    return list(peers) if peers else None
