"""The trainer's side of the RPC: one `RpcClient` per trainer id per process.

Kernels reach it through `ctx.env["rpc"]` (what `transpiler.runtime.session.Session` sets),
else through `get_client(trainer_id)`. It keeps one channel per pserver, created on
first use and waited on until `connect_timeout`, so trainers may start before the
pservers.

The cost of an RPC on loopback is the message, not its bytes, so a step is few
messages: `send_async` only encodes and queues a var for its pserver; `send_barrier`
sends each pserver ONE `SendBatch` (its queued vars and the barrier), and
`fetch_barrier` asks each ONE `FetchBatch` (every var wanted from it and the barrier):
two RPCs per pserver per sync step. `send_barrier(defer=True)` (the kernel's choice when
the block's `fetch_barrier` follows with only `recv`s between) sends nothing yet: the
`fetch_barrier` then sends each pserver ONE `SendFetchBatch` (the queued vars, the send
barrier, the vars wanted and the fetch barrier), one RPC per pserver per sync step; any
other call sends a deferred barrier first, as `send_barrier` would have. Without barriers (async mode), `flush` starts one
`SendBatch` per pserver for what is queued, and any get, recv or `wait_pending` flushes
first, so a var is never read before the send queued ahead of it.

Early sends (issue 30, `PSTRANSPILE_EARLY_SEND=off|auto|on`, `early_choice`; `off` by
default, as they won nothing clear where measured: docs/runtime.md, "Early sends"): in a sync
step (`send_async(early=True)`, the kernel's choice when a `send_barrier` follows), a dense
var bound for a pserver's bulk channel — of `EARLY_MIN` bytes or more under `auto`, any
size under `on` — starts going at once, as a `SendBatch` of its own on that pserver's
ordered stream (one thread, at most `EARLY_QUEUE` sends waiting or in flight: a `send`
blocks, at most the call deadline, while its pserver's stream is full), so the grad moves
while the executor goes on with backward. The stream's `_Queued` holds the value (and a
view of its array) until the pserver took it, so the executor's reference counts
(`OpContext.reusable_input`, `output_buffer`) see it held and no kernel writes into it.
Any later call to that pserver (the step's `SendFetchBatch`, a get, a barrier) first waits
for its early sends and raises the first one's failure, as the send would have failed in
that call; the small vars stay queued for the one final message.

Early receives (issue 30, `PSTRANSPILE_EARLY_RECV=auto|off|on`, `recv_choice`, `auto` by
default: docs/runtime.md, "Early receives"): `fetch_barrier_early` sends the step's one `SendFetchBatch` per pserver
and returns without its replies; they come in on the client's own `recv` thread, and each
fetched var is handed to `arrived(endpoint, name, value)` as soon as it is in (the bulk
channel: var by var; gRPC: reply by reply), so the executor goes on with the next step
while the params arrive (`ops.rpc.kernels.fetch_barrier` makes the scope wait for each
one). Every later call (a send, a fetch, a barrier, `complete`, `close`) first waits for
it, at most the call deadline, and raises its failure once.

Every failure is an `RpcError` naming the call, the var and the pserver, and carrying
the pserver's own reason when it gave one (a trainer that vanished, say).

Once connected to a pserver, the client keeps one `Watch` call open on it (not counted in
`stats`): a process killed mid-run closes it at once, so the pserver names the trainer in
seconds; gRPC keepalive (`ops.rpc.service`) fails the calls to a frozen pserver in ~15 s.

Concurrent calls (one per pserver) run as blocking calls, the last on the caller's
thread and the others on the client's own thread pool: gRPC Python's `.future()` starts
a "channel spin" thread per call, which costs more than a small RPC itself (measured:
~0.5 ms of a ~0.8 ms loopback round trip).

`client.stats` counts the bytes of every message sent and received, per method (the
serialised messages: gRPC's HTTP/2 framing, a few dozen bytes a call, is not counted);
`stats.snapshot()` before and after a step and `RpcStats.delta(after, before)` give its traffic.

Prefetch (`prefetch`, `prefetch_block`, `prefetch_many`) asks pservers for rows of a
table: by table name (a `remote_prefetch` table's block, `distributed_lookup_table`), or
by the ids var a pserver's prefetch block is keyed by (the distributed table, whose
block runs `lookup_sparse_table`); several requests travel in parallel.
"""

from __future__ import annotations

import ssl
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures as _futures
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc
import numpy as np

from ops.rpc import bulk
from ops.rpc.auth import ClientAuth, Handshake
from ops.rpc.env_choice import EnvChoiceError, env_choice
from ops.rpc.errors import RpcError
from ops.rpc.malloc import keep_freed_memory
from ops.rpc.service import CHANNEL_OPTIONS, METHODS, SERVICE_NAME, WATCH_SECONDS, call_deadline, default_timeout
from ops.rpc.wire import Parts, WireVar, _size, encode_batch, encode_var, var_parts
from ops.tensor import LoDTensor
from proto import rpc_pb2


Counts = tuple[int, int, int]  # calls, bytes sent, bytes received

EARLY_ENV = "PSTRANSPILE_EARLY_SEND"
EARLY_CHOICES = ("off", "auto", "on")  # `off` the default: no clear win measured on 2 cores (docs/runtime.md)
EARLY_MIN = 1 << 20  # bytes: under `auto`, a dense var this big goes early (docs/runtime.md, "Early sends")
EARLY_QUEUE = 8  # early sends waiting or in flight per pserver
RECV_ENV = "PSTRANSPILE_EARLY_RECV"
RECV_CHOICES = ("auto", "off", "on")  # `auto` the default: it measured faster (docs/runtime.md, "Early receives")


class EarlyChoiceError(EnvChoiceError):
    """`PSTRANSPILE_EARLY_SEND` names no choice."""


def early_choice(environ: Mapping[str, str] | None = None) -> str:
    """`off` (the default), `auto` or `on`; `EarlyChoiceError` for anything else."""
    return env_choice(environ, EARLY_ENV, EARLY_CHOICES, EarlyChoiceError)


class RecvChoiceError(EnvChoiceError):
    """`PSTRANSPILE_EARLY_RECV` names no choice."""


def recv_choice(environ: Mapping[str, str] | None = None) -> str:
    """`auto` (the default), `off` or `on`; `RecvChoiceError` for anything else."""
    return env_choice(environ, RECV_ENV, RECV_CHOICES, RecvChoiceError)


Arrived = Callable[[str, str, Any], None]  # (endpoint, name, value) of a fetched var, as soon as it is in


class RpcStats:
    """Bytes and calls per RPC method, sent and received (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = {}  # method -> [calls, bytes sent, bytes received]

    def sent(self, method: str, data: bytes) -> bytes:
        with self._lock:
            row = self._counts.setdefault(method, [0, 0, 0])
            row[0] += 1
            row[1] += len(data)
        return data

    def received(self, method: str, data: bytes) -> bytes:
        with self._lock:
            self._counts.setdefault(method, [0, 0, 0])[2] += len(data)
        return data

    def add(self, method: str, sent: int, received: int) -> None:
        """Count one call of `method` that moved these bytes (the bulk channel's)."""
        with self._lock:
            row = self._counts.setdefault(method, [0, 0, 0])
            row[0] += 1
            row[1] += sent
            row[2] += received

    def snapshot(self) -> dict[str, Counts]:
        """method -> (calls, bytes sent, bytes received) so far."""
        with self._lock:
            return {method: (row[0], row[1], row[2]) for method, row in self._counts.items()}

    @property
    def bytes_sent(self) -> int:
        return sum(row[1] for row in self.snapshot().values())

    @property
    def bytes_received(self) -> int:
        return sum(row[2] for row in self.snapshot().values())

    @staticmethod
    def delta(after: dict[str, Counts], before: dict[str, Counts]) -> dict[str, Counts]:
        """What happened between two snapshots, per method."""
        zero = (0, 0, 0)
        return {
            method: tuple(a - b for a, b in zip(row, before.get(method, zero), strict=True))  # type: ignore[misc]
            for method, row in after.items()
        }

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()


@dataclass(frozen=True)
class PrefetchRequest:
    """Rows `ids` from `endpoint`: of table `table` when given, else of the table whose
    prefetch block is keyed by the ids var `name`."""

    endpoint: str
    name: str
    ids: np.ndarray
    table: str = ""


class _Endpoint:
    """One pserver's channel (TLS when `auth` says so) and its callables, which count
    their bytes in `stats` and carry `metadata` (the job token, the handshake) on every
    call: every RPC goes through `calls`, but the long-lived `watch_call`."""

    def __init__(self, endpoint: str, stats: RpcStats, auth: ClientAuth, metadata: tuple[tuple[str, str], ...]) -> None:
        self.endpoint = endpoint
        self.channel = auth.channel(endpoint, list(CHANNEL_OPTIONS))
        self.calls = {
            name: partial(
                self.channel.unary_unary(
                    m.path,
                    request_serializer=lambda request, enc=m.encode_request, n=name: stats.sent(n, enc(request)),
                    response_deserializer=lambda data, dec=m.decode_response, n=name: dec(stats.received(n, data)),
                ),
                metadata=metadata,
            )
            for name, m in METHODS.items()
            if name != "Watch"
        }
        # The open line a pserver watches (not counted in `stats`); it carries the token too.
        watch = METHODS["Watch"]
        self.watch_call = self.channel.unary_unary(
            watch.path, request_serializer=watch.encode_request, response_deserializer=watch.decode_response)
        self.metadata = metadata
        self.ready = False
        self.bulk: bulk.BulkClient | None = None  # the pserver's bulk channel, when it offers one
        self.lost: str | None = None  # why the Watch line broke (a frozen pserver's keepalive): no bulk calls then


@dataclass(eq=False)
class _Queued:
    """A var queued for a pserver: its message's pieces (gRPC) and its value (the bulk channel)."""

    name: str
    parts: Parts
    value: Any
    merge_add: bool

    def drop(self) -> None:
        """Let go of the value: the bulk channel holds its pieces until they are sent and
        no longer, so a grad's memory is free before the reply arrives (a released param's
        new array reuses it, `ops.executor.Liveness.released`)."""
        self.parts, self.value = (), None


class _EarlyStream:
    """One pserver's early sends (module docstring): an ordered stream on its own thread,
    at most `EARLY_QUEUE` sends waiting or in flight; `started` lists them (future, what,
    endpoint) until a later call to the pserver waits for them."""

    def __init__(self, name: str) -> None:
        self.pool = _futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.slots = threading.Semaphore(EARLY_QUEUE)
        self.started: list[tuple[Any, str, str]] = []


def _into_of(endpoint: str, names: Sequence[str], into: Mapping[tuple[str, str], np.ndarray],
             sent: _Sent | None = None) -> Mapping[str, np.ndarray]:
    """The destinations of `endpoint`'s fetched `names` (by name) that `into` holds, each
    looked up only when the reply needs it, and after `sent` (every call of the step has
    sent its vars): `ops.rpc.kernels` makes a released param's new array then, when this
    trainer's grads are freed."""
    return _Into(endpoint, [name for name in names if (endpoint, name) in into], into, sent) if into else {}


CALL_WORKERS = 16  # threads of a client's pool of parallel calls


class _Sent:
    """Set once each of `calls` calls has sent its vars (or failed): a countdown the
    receiving threads wait on before asking for a destination (`_Into`)."""

    def __init__(self, calls: int, deadline: float) -> None:
        self._left, self._deadline = calls, deadline
        self._lock = threading.Lock()
        self._event = threading.Event()
        if calls <= 0:
            self._event.set()

    def one(self) -> Callable[[], None]:
        """A call's signal: the first use counts, later ones do nothing."""
        used = []

        def signal() -> None:
            with self._lock:
                if used:
                    return
                used.append(True)
                self._left -= 1
                if self._left <= 0:
                    self._event.set()

        return signal

    def wait(self) -> None:
        if not self._event.wait(self._deadline):
            raise RpcError(f"the step's other calls did not send their vars within {self._deadline:g} s")


class _Into(Mapping):
    """`_into_of`'s mapping: a name's destination is `into[(endpoint, name)]`, asked for
    when the bulk channel receives that var."""

    def __init__(self, endpoint: str, names: list[str], into: Mapping[tuple[str, str], np.ndarray],
                 sent: _Sent | None) -> None:
        self._endpoint, self._names, self._into, self._sent = endpoint, frozenset(names), into, sent

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        if self._sent is not None:
            self._sent.wait()
        return self._into[(self._endpoint, name)]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._names))

    def __len__(self) -> int:
        return len(self._names)


@dataclass(frozen=True)
class _Batch:
    """A `SendBatch`, `SendFetchBatch` or `FetchBatch` not yet encoded: gRPC's message is
    built from it (`grpc_request`), or the bulk channel sends the values' own buffers."""

    method: str
    trainer_id: int
    queued: tuple[_Queued, ...] = ()
    barrier: bool = False
    fetch: tuple[str, ...] = ()
    fetch_barrier: bool = False
    into: Mapping[str, np.ndarray] = field(default_factory=dict)  # the bulk channel: fetched name -> its destination
    arrived: Callable[[str, Any], None] | None = None  # told of each fetched var as it comes in (early receives)
    sent: Callable[[], None] | None = None  # called once its vars are sent (or the call failed): `_Sent`

    def grpc_request(self) -> Any:
        if self.method == "FetchBatch":
            return rpc_pb2.FetchRequest(trainer_id=self.trainer_id, varnames=self.fetch, barrier=self.fetch_barrier)
        return encode_batch([q.parts for q in self.queued], trainer_id=self.trainer_id, barrier=self.barrier,
                            fetch=self.fetch, fetch_barrier=self.fetch_barrier)

    def bulk_items(self) -> list[tuple[bulk.VarHead, list[Any]]]:
        items = []
        for q in self.queued:
            if isinstance(q.value, (LoDTensor, np.ndarray)):
                items.append(bulk.outgoing(q.name, q.value, q.merge_add))
            else:
                items.append((bulk.VarHead(q.name, _size(q.parts), merge_add=q.merge_add), q.parts))
        return items


class RpcClient:
    """A trainer's connections to the pservers.

    `timeout` is the pservers' silence timeout (seconds; default `PSTRANSPILE_RPC_TIMEOUT`
    or 120): one RPC may take `call_deadline(timeout)` (the pserver blocks a get until
    every trainer's barrier is in). `connect_timeout` bounds the first connection to
    each pserver (default: `timeout`); after that a call to a pserver that is gone fails
    at once (UNAVAILABLE) rather than waiting for it to come back.

    `auth` is the job token and TLS to present (default: the environment's,
    `ClientAuth.from_env`); `handshake`, what this trainer was started as, travels with
    every call so a pserver of another job shape refuses it (`ops.rpc.auth`).

    `early` is the early-send choice (default `PSTRANSPILE_EARLY_SEND`, `early_choice`),
    `early_recv` the early-receive one (default `PSTRANSPILE_EARLY_RECV`, `recv_choice`)."""

    def __init__(
        self,
        trainer_id: int = 0,
        *,
        timeout: float | None = None,
        connect_timeout: float | None = None,
        auth: ClientAuth | None = None,
        handshake: Handshake | None = None,
        early: str | None = None,
        early_recv: str | None = None,
    ) -> None:
        keep_freed_memory()  # a step's MB buffers reuse their pages (ops.rpc.malloc)
        self.trainer_id = int(trainer_id)
        self.auth = auth if auth is not None else ClientAuth.from_env()
        self._metadata = self.auth.metadata(handshake)
        self.timeout = float(timeout) if timeout is not None else default_timeout()
        self.connect_timeout = float(connect_timeout) if connect_timeout is not None else self.timeout
        self.deadline = call_deadline(self.timeout)
        self._endpoints: dict[str, _Endpoint] = {}
        self._queued: dict[str, list[_Queued]] = {}  # endpoint -> the vars queued for it
        self._pending: list[tuple[Any, str, str]] = []  # (future, what, endpoint) of flushed sends
        self._deferred_barrier: tuple[str, ...] | None = None  # send barrier the next fetch_barrier carries
        self._lock = threading.Lock()
        self._closed = False
        self.stats = RpcStats()
        self._pool = _futures.ThreadPoolExecutor(max_workers=CALL_WORKERS, thread_name_prefix=f"rpc-trainer{self.trainer_id}")
        self.early = early_choice() if early is None else early_choice({EARLY_ENV: early})
        self._streams: dict[str, _EarlyStream] = {}  # endpoint -> its early sends
        self.early_recv = recv_choice() if early_recv is None else recv_choice({RECV_ENV: early_recv})
        self._recv_pool: _futures.ThreadPoolExecutor | None = None  # the early receives' thread
        self._recv: Any = None  # the early receive in flight (its future), until a later call waits for it

    # ------------------------------------------------------------ connections
    def _endpoint(self, endpoint: str) -> _Endpoint:
        with self._lock:
            if self._closed:
                raise RpcError(f"trainer {self.trainer_id}'s RPC client is closed")
            ep = self._endpoints.get(endpoint)
            if ep is None:
                ep = self._endpoints[endpoint] = _Endpoint(endpoint, self.stats, self.auth, self._metadata)
        if not ep.ready:
            try:
                grpc.channel_ready_future(ep.channel).result(timeout=self.connect_timeout)
            except grpc.FutureTimeoutError:
                raise RpcError(
                    f"trainer {self.trainer_id} cannot reach pserver {endpoint} within {self.connect_timeout:g} s"
                ) from None
            ep.bulk = self._open_bulk(ep)
            ep.ready = True
            self._watch(ep)
        return ep

    def _open_bulk(self, ep: _Endpoint) -> bulk.BulkClient | None:
        """The pserver's bulk channel (`ops.rpc.bulk`) when it offers one and this process's
        `PSTRANSPILE_BULK` is not `off`. A pserver without the method, or any failure
        here, means gRPC for everything (the first real call reports a real problem)."""
        if bulk.bulk_choice() == "off":
            return None
        announce = ep.channel.unary_unary(f"/{SERVICE_NAME}/{bulk.METHOD}", request_serializer=lambda data: data,
                                          response_deserializer=lambda data: data)
        try:
            data = announce(bulk.announce_request(), timeout=self.connect_timeout, metadata=ep.metadata)
        except grpc.RpcError:
            return None
        offer = bulk.Offer.decode(data)
        if offer is None:
            return None
        channel = bulk.BulkClient(ep.endpoint.rpartition(":")[0], offer, token=self.auth.token, tls=self.auth.tls,
                                  trainer_id=self.trainer_id, connect_timeout=min(self.connect_timeout, bulk.PROBE_SECONDS),
                                  lost=lambda: ep.lost, shm=bulk.shm_choice())
        try:
            channel.probe()
        except (OSError, ssl.SSLError) as exc:  # e.g. a firewall that lets only gRPC's port through
            print(f"trainer {self.trainer_id}: pserver {ep.endpoint}'s bulk channel (port {offer.port}) cannot be "
                  f"reached ({exc}); its tensors go over gRPC", file=sys.stderr, flush=True)
            return None
        if channel.ring_failure is not None:
            print(f"trainer {self.trainer_id}: pserver {ep.endpoint}'s shared-memory ring is not used here "
                  f"({channel.ring_failure}); its payloads go by TCP", file=sys.stderr, flush=True)
        return channel

    def _invoke(self, ep: _Endpoint, method: str, request: Any, timeout: float, *, early: bool = False) -> Any:
        """One call's reply: a batch over the bulk channel when `ep` has one, else gRPC. A
        batch that is not an early send goes after `ep`'s early sends have (`_wait_early`)."""
        if isinstance(request, _Batch):
            signal = request.sent
            try:
                if not early:
                    self._wait_early(ep.endpoint)
                if ep.bulk is not None and ep.lost is None:
                    items = request.bulk_items()
                    for queued in request.queued:  # the call lets go of `items` once sent (no retry reads them)
                        queued.drop()
                    reply, sent, received = ep.bulk.call(
                        request.method, items, barrier=request.barrier, fetch=request.fetch,
                        fetch_barrier=request.fetch_barrier, timeout=timeout, into=request.into, on_sent=signal,
                        arrived=request.arrived)
                    self.stats.add(method, sent, received)
                    return rpc_pb2.VoidMessage() if method == "SendBatch" else reply
                arrived = request.arrived
                request = request.grpc_request()  # gRPC ignores `into`: nothing waits on its send
            finally:
                if signal is not None:
                    signal()  # sent already (a no-op), gRPC's, or failed before sending: nobody waits on it
            reply = ep.calls[method](request, timeout=timeout)
            if arrived is not None:
                for var in reply.vars:
                    arrived(var.name, var.value)
            return reply
        return ep.calls[method](request, timeout=timeout)

    def _watch(self, ep: _Endpoint) -> None:
        """Keep one `Watch` call open on `ep` (re-called each time the pserver answers), so
        the pserver learns at once that this process is gone. Not counted in `stats`; a
        failed watch is not re-called (the next real call learns why)."""
        with self._lock:
            if self._closed or self._endpoints.get(ep.endpoint) is not ep:
                return
        request = rpc_pb2.WatchMessage(trainer_id=self.trainer_id, seconds=WATCH_SECONDS)
        future = ep.watch_call.future(request, timeout=WATCH_SECONDS + self.timeout, metadata=ep.metadata)
        future.add_done_callback(lambda done: self._watch(ep) if done.code() == grpc.StatusCode.OK else _watch_ended(ep, done))

    def _future(self, endpoint: str, method: str, request: Any, *, deadline: float | None = None) -> Any:
        """A `concurrent.futures.Future` of the call's reply."""
        return self._pool.submit(self._invoke, self._endpoint(endpoint), method, request, deadline or self.deadline)

    def _call_all(self, calls: Sequence[tuple[str, str, Any, str]]) -> list[Any]:
        """Replies to `(endpoint, method, request, what)` calls, in order, made in parallel:
        the last on this thread (a hand-off to the pool and back costs more than a small
        call). The first failure is raised once all have finished."""
        if not calls:
            return []
        started = [(self._future(ep, method, request), what, ep) for ep, method, request, what in calls[:-1]]
        endpoint, method, request, what = calls[-1]
        here: _futures.Future = _futures.Future()
        try:
            here.set_result(self._invoke(self._endpoint(endpoint), method, request, self.deadline))
        except (grpc.RpcError, RpcError) as exc:
            here.set_exception(exc)
        return self._gather([*started, (here, what, endpoint)])

    def _error(self, exc: grpc.RpcError, what: str, endpoint: str) -> RpcError:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        who = f"trainer {self.trainer_id}: {what} on pserver {endpoint}"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RpcError(f"{who} timed out after {self.deadline:g} s")
        if code == grpc.StatusCode.UNAVAILABLE:
            return RpcError(f"{who} failed: the pserver is unavailable ({details})")
        name = code.name if code is not None else "error"
        return RpcError(f"{who} failed ({name}): {details}")

    def _gather(self, futures: Sequence[tuple[Any, str, str]]) -> list[Any]:
        """Results of `futures` in order; the first failure is raised after all finish."""
        results: list[Any] = []
        first: RpcError | None = None
        for future, what, endpoint in futures:
            try:
                results.append(future.result())
            except grpc.RpcError as exc:
                results.append(None)
                first = first or self._error(exc, what, endpoint)
            except RpcError as exc:
                results.append(None)
                first = first or exc
        if first is not None:
            raise first
        return results

    # ------------------------------------------------------------ vars
    def send(self, endpoint: str, name: str, value: Any, *, merge_add: bool = False) -> None:
        """Send `value` as `name` and wait for the pserver to take it."""
        self.send_async(endpoint, name, value, merge_add=merge_add)
        self.wait_pending()

    def send_async(self, endpoint: str, name: str, value: Any, *, merge_add: bool = False, early: bool = False) -> None:
        """Queue `value` as `name` for `endpoint`; the next barrier, `flush`, get or
        `wait_pending` sends it. Scope values are replaced, never changed in place (a
        kernel writes into an array only when nothing but the scope holds it), so the
        pieces may hold the value's own buffer until then. With `early` (a sync step: a
        barrier follows), a var that goes early (`_goes_early`) starts now on the
        pserver's stream instead (module docstring)."""
        self._wait_recv()
        self._send_deferred_barrier()  # a var queued after a barrier belongs to the next round
        message = var_parts(name, value, trainer_id=self.trainer_id, merge_add=merge_add)
        queued = _Queued(name, message, value, merge_add)
        if early and self._goes_early(endpoint, queued):
            self._start_early(endpoint, queued)
            return
        with self._lock:
            self._queued.setdefault(endpoint, []).append(queued)

    def _goes_early(self, endpoint: str, queued: _Queued) -> bool:
        """Whether `queued` starts at once: early sends are not `off`, it is a dense tensor
        (not `merge_add`), of `EARLY_MIN` bytes or more unless they are `on`, and its
        pserver's bulk channel is open."""
        if self.early == "off" or queued.merge_add:
            return False
        value = queued.value
        array = value.array if isinstance(value, LoDTensor) else value if isinstance(value, np.ndarray) else None
        if array is None or (self.early == "auto" and array.nbytes < EARLY_MIN):
            return False
        ep = self._endpoint(endpoint)
        return ep.bulk is not None and ep.lost is None

    def _start_early(self, endpoint: str, queued: _Queued) -> None:
        """Hand `queued` to `endpoint`'s stream, waiting (at most the call deadline) for a
        free place in it."""
        what = f"send of {queued.name}"
        with self._lock:
            if self._closed:
                raise RpcError(f"trainer {self.trainer_id}'s RPC client is closed")
            stream = self._streams.get(endpoint)
            if stream is None:
                stream = self._streams[endpoint] = _EarlyStream(f"rpc-trainer{self.trainer_id}-early")
        if not stream.slots.acquire(timeout=self.deadline):
            raise RpcError(f"trainer {self.trainer_id}: {what} on pserver {endpoint} timed out after "
                           f"{self.deadline:g} s waiting for the early sends before it")
        batch = _Batch("SendBatch", self.trainer_id, (queued,))
        try:
            future = stream.pool.submit(self._run_early, self._endpoint(endpoint), batch, stream.slots)
        except BaseException:  # the client closed meanwhile
            stream.slots.release()
            raise RpcError(f"trainer {self.trainer_id}'s RPC client is closed") from None
        with self._lock:
            stream.started.append((future, what, endpoint))

    def _run_early(self, ep: _Endpoint, batch: _Batch, slots: threading.Semaphore) -> Any:
        """An early send, on its pserver's stream (frees its place when done)."""
        try:
            return self._invoke(ep, "SendBatch", batch, self.deadline, early=True)
        finally:
            slots.release()

    def _wait_early(self, endpoint: str | None = None) -> None:
        """Wait for `endpoint`'s early sends so far (every pserver's when None); raise the
        first failure as the send's own (`_gather`)."""
        with self._lock:
            streams = list(self._streams.items())
            started = []
            for ep, stream in streams:
                if endpoint is None or ep == endpoint:
                    started += stream.started
                    stream.started = []
        if started:
            self._gather(started)

    def _take_queued(self) -> dict[str, list[_Queued]]:
        with self._lock:
            queued, self._queued = self._queued, {}
        return queued

    def _send_batch(self, endpoint: str, queued: list[_Queued], barrier: bool) -> tuple[str, str, _Batch, str]:
        """The call (for `_call_all` / `_future`) sending `queued` to `endpoint`."""
        request = _Batch("SendBatch", self.trainer_id, tuple(queued), barrier=barrier)
        what = "send barrier" if barrier else f"send of {', '.join(q.name for q in queued)}"
        return endpoint, "SendBatch", request, what

    def flush(self) -> None:
        """Start one `SendBatch` per pserver with what is queued; `wait_pending` waits."""
        self._send_deferred_barrier()
        started = [(self._future(*call[:3]), call[3], call[0])
                   for call in (self._send_batch(ep, queued, False) for ep, queued in self._take_queued().items())]
        with self._lock:
            self._pending.extend(started)

    def wait_pending(self) -> None:
        """Send what is queued and wait for every send so far; raise the first failure."""
        self._wait_recv()
        self.flush()
        with self._lock:
            pending, self._pending = self._pending, []
        if pending:
            self._gather(pending)
        self._wait_early()

    def get(self, endpoint: str, name: str) -> Any:
        """The pserver's value of `name`."""
        return self.get_many([(endpoint, name)])[0]

    def get_many(self, requests: Iterable[tuple[str, str]]) -> list[Any]:
        """Values of `(endpoint, name)` pairs, one `FetchBatch` per pserver, in order."""
        return self._fetch(requests, ())

    def _fetch(self, requests: Iterable[tuple[str, str]], barriers: Sequence[str],
               into: Mapping[tuple[str, str], np.ndarray] | None = None) -> list[Any]:
        """Values of `(endpoint, name)` pairs, and the fetch barrier of each of `barriers`,
        in one `FetchBatch` per pserver (after the sends queued so far)."""
        self.wait_pending()
        requests = list(requests)
        wanted = _names_by_endpoint(requests, barriers)
        barrier = set(barriers)
        calls = [
            (ep, "FetchBatch", _Batch("FetchBatch", self.trainer_id, fetch=tuple(names), fetch_barrier=ep in barrier,
                                      into=_into_of(ep, names, into or {})),
             "fetch barrier" if ep in barrier else f"get of {', '.join(names)}")
            for ep, names in wanted.items()
        ]
        got: dict[tuple[str, str], Any] = {}
        for (endpoint, names), reply in zip(wanted.items(), self._call_all(calls), strict=True):
            got.update(self._values_of(endpoint, names, reply))
        return [got[request] for request in requests]

    def _values_of(self, endpoint: str, names: list[str], reply: Any) -> list[tuple[tuple[str, str], Any]]:
        """((endpoint, name), value) of each var a fetch `reply` carries; it must hold `names`."""
        if [var.name for var in reply.vars] != names or any(var.value is None for var in reply.vars):
            raise RpcError(f"trainer {self.trainer_id}: a get of {', '.join(names)} on pserver {endpoint} "
                           "came back without its values")
        return [((endpoint, var.name), var.value) for var in reply.vars]

    def prefetch(self, endpoint: str, table: str, ids: Any) -> LoDTensor:
        """Rows `ids` (int64) of table `table` on `endpoint`, as a dense tensor."""
        return self.prefetch_many([PrefetchRequest(endpoint, table, np.asarray(ids), table)])[0]

    def prefetch_block(self, endpoint: str, name: str, ids: Any) -> LoDTensor:
        """What `endpoint`'s prefetch block keyed by `name` returns for `ids`."""
        return self.prefetch_many([PrefetchRequest(endpoint, name, np.asarray(ids))])[0]

    def prefetch_many(self, requests: Iterable[PrefetchRequest]) -> list[LoDTensor]:
        """Answers to `requests`, fetched in parallel, in order."""
        self._send_deferred_barrier()
        calls = []
        for req in requests:
            ids = LoDTensor(np.ascontiguousarray(np.asarray(req.ids, dtype=np.int64).reshape(-1, 1)))
            message = encode_var(req.name, ids, trainer_id=self.trainer_id, table_name=req.table)
            what = f"prefetch from {req.table}" if req.table else f"prefetch of {req.name}"
            calls.append((req.endpoint, "PrefetchVariable", message, what))
        replies: list[WireVar] = self._call_all(calls)
        values = []
        for (endpoint, _, _, what), reply in zip(calls, replies, strict=True):
            if not isinstance(reply.value, LoDTensor):
                raise RpcError(f"trainer {self.trainer_id}: {what} on pserver {endpoint} came back without rows")
            values.append(reply.value)
        return values

    def checkpoint_notify_each(self, targets: Iterable[tuple[str, str]], lookup_table: str = "") -> None:
        """Tell each `(endpoint, path)` pserver to checkpoint to its own path (Paddle sends
        every pserver of a distributed table `DIR/<table>_<i>`)."""
        self.wait_pending()
        futures = [
            (self._future(ep, "CheckpointNotify", rpc_pb2.CheckpointMessage(
                trainer_id=self.trainer_id, dir=path, lookup_table=lookup_table)), "checkpoint notify", ep)
            for ep, path in targets
        ]
        self._gather(futures)

    # ------------------------------------------------------------ control
    def send_barrier(self, endpoints: Sequence[str], *, defer: bool = False) -> None:
        """One `SendBatch` per pserver: its queued vars and, for `endpoints`, the barrier.
        With `defer`, nothing is sent yet: the next `fetch_barrier` carries the vars and
        the barrier (one `SendFetchBatch` per pserver), or any other call sends them first."""
        self._send_deferred_barrier()
        if defer:
            self._deferred_barrier = tuple(endpoints)
            return
        self._send_barrier_now(endpoints)

    def _send_deferred_barrier(self) -> None:
        """Send a deferred send barrier (and the vars queued before it) now (after the early
        receive in flight)."""
        self._wait_recv()
        endpoints, self._deferred_barrier = self._deferred_barrier, None
        if endpoints is not None:
            self._send_barrier_now(endpoints)

    def _send_barrier_now(self, endpoints: Sequence[str]) -> None:
        queued = self._take_queued()
        calls = [self._send_batch(ep, queued.pop(ep, []), True) for ep in endpoints]
        calls += [self._send_batch(ep, rest, False) for ep, rest in queued.items()]
        with self._lock:
            pending, self._pending = self._pending, []
        self._gather(pending)
        self._call_all(calls)
        self._wait_early()  # a pserver the calls did not go to

    def fetch_barrier(self, endpoints: Sequence[str], requests: Iterable[tuple[str, str]] = (),
                      into: Mapping[tuple[str, str], np.ndarray] | None = None) -> list[Any]:
        """The values of `(endpoint, name)` `requests` and the fetch barrier of each of
        `endpoints`: one `FetchBatch` per pserver, or one `SendFetchBatch` when a send
        barrier was deferred. A request in `into` is received into that array on the bulk
        channel (when the reply's shape and dtype are its own; gRPC ignores it)."""
        self._wait_recv()
        send_barrier, self._deferred_barrier = self._deferred_barrier, None
        if send_barrier is None:
            return self._fetch(requests, endpoints, into or {})
        return self._send_and_fetch(send_barrier, requests, endpoints, into or {})

    def _send_and_fetch(self, send_barrier: Sequence[str], requests: Iterable[tuple[str, str]],
                        fetch_barrier: Sequence[str], into: Mapping[tuple[str, str], np.ndarray]) -> list[Any]:
        """One `SendFetchBatch` per pserver concerned: its queued vars, its send barrier (for
        `send_barrier`), the names `requests` want of it and its fetch barrier (for
        `fetch_barrier`), in that order; the values, in `requests`' order."""
        requests = list(requests)
        endpoints, wanted, calls = self._send_fetch_calls(send_barrier, requests, fetch_barrier, into)
        got = self._finish_send_fetch(endpoints, wanted, calls)
        return [got[request] for request in requests]

    def _send_fetch_calls(self, send_barrier: Sequence[str], requests: list[tuple[str, str]],
                          fetch_barrier: Sequence[str], into: Mapping[tuple[str, str], np.ndarray],
                          arrived: Arrived | None = None,
                          ) -> tuple[list[str], dict[str, list[str]], list[tuple[str, str, _Batch, str]]]:
        """The pservers, the names wanted of each and the calls of `_send_and_fetch`, with
        the queued vars taken (on the caller's thread: a later `send` is the next round's)."""
        queued = self._take_queued()
        with self._lock:
            pending, self._pending = self._pending, []
        self._gather(pending)
        wanted = _names_by_endpoint(requests)
        endpoints = list(dict.fromkeys([*send_barrier, *queued, *fetch_barrier, *wanted]))
        # Receives wait for every call's sends only when all calls run at once (one on this
        # thread, the rest on the pool): else a queued call could not send.
        sent = _Sent(len(endpoints), self.deadline) if into and len(endpoints) <= CALL_WORKERS + 1 else None
        calls = [self._send_fetch_call(ep, queued.get(ep, []), ep in send_barrier, wanted.get(ep, []),
                                       ep in fetch_barrier, _into_of(ep, wanted.get(ep, []), into, sent),
                                       None if arrived is None else partial(arrived, ep),
                                       sent.one() if sent is not None else None)
                 for ep in endpoints]
        return endpoints, wanted, calls

    def _finish_send_fetch(self, endpoints: list[str], wanted: dict[str, list[str]],
                           calls: list[tuple[str, str, _Batch, str]]) -> dict[tuple[str, str], Any]:
        replies = self._call_all(calls)
        self._wait_early()  # a pserver the calls did not go to
        got: dict[tuple[str, str], Any] = {}
        for endpoint, reply in zip(endpoints, replies, strict=True):
            got.update(self._values_of(endpoint, wanted.get(endpoint, []), reply))
        return got

    # ------------------------------------------------------------ early receives
    def receives_early(self) -> bool:
        """Whether `fetch_barrier_early` may be used now: early receives are not `off` and a
        send barrier was deferred (the sync trainer program's one `SendFetchBatch`)."""
        return self.early_recv != "off" and self._deferred_barrier is not None

    def has_bulk(self, endpoint: str) -> bool:
        """Whether calls to `endpoint` take its bulk channel (it offers one, not lost)."""
        ep = self._endpoint(endpoint)
        return ep.bulk is not None and ep.lost is None

    def fetch_barrier_early(self, endpoints: Sequence[str], requests: Iterable[tuple[str, str]],
                            into: Mapping[tuple[str, str], np.ndarray], arrived: Arrived,
                            failed: Callable[[BaseException], None]) -> None:
        """`fetch_barrier` (after a deferred send barrier) whose replies come in on the
        client's `recv` thread: each fetched var goes to `arrived` as soon as it is in;
        `failed(error)` is told if the call fails (then any var not yet arrived never
        will). Returns once the calls are made, not answered; every later call of the
        client waits for them first (module docstring)."""
        self._wait_recv()
        send_barrier, self._deferred_barrier = self._deferred_barrier, None
        if send_barrier is None:
            raise RpcError(f"trainer {self.trainer_id}: an early receive needs a deferred send barrier")
        call = self._send_fetch_calls(send_barrier, list(requests), endpoints, into, arrived)
        with self._lock:
            if self._closed:
                raise RpcError(f"trainer {self.trainer_id}'s RPC client is closed")
            if self._recv_pool is None:
                self._recv_pool = _futures.ThreadPoolExecutor(max_workers=1,
                                                              thread_name_prefix=f"rpc-trainer{self.trainer_id}-recv")
            self._recv = self._recv_pool.submit(self._receive, call, failed)

    def _receive(self, call: tuple[list[str], dict[str, list[str]], list[tuple[str, str, _Batch, str]]],
                 failed: Callable[[BaseException], None]) -> None:
        """The early receive's body (on the `recv` thread). Nothing of the replies is kept:
        their arrays are the params', whose reference counts say who may reuse them."""
        try:
            self._finish_send_fetch(*call)
        except BaseException as exc:
            failed(exc)
            raise

    def _wait_recv(self, *, quiet: bool = False) -> None:
        """Wait for the early receive in flight (at most the call deadline and a little: the
        calls have their own) and raise its failure, once (not with `quiet`)."""
        future = self._recv
        if future is None:
            return
        self._recv = None
        limit = self.deadline + 5.0
        try:
            future.result(timeout=limit)
        except _futures.TimeoutError:
            if not quiet:
                raise RpcError(f"trainer {self.trainer_id}: the fetch barrier's replies did not come in "
                               f"within {limit:g} s") from None
        except BaseException:
            if not quiet:
                raise

    def _send_fetch_call(self, endpoint: str, queued: list[_Queued], barrier: bool, names: list[str],
                         fetch_barrier: bool, into: Mapping[str, np.ndarray] | None = None,
                         arrived: Callable[[str, Any], None] | None = None,
                         sent: Callable[[], None] | None = None) -> tuple[str, str, _Batch, str]:
        """The call (for `_call_all`) of one `SendFetchBatch`."""
        request = _Batch("SendFetchBatch", self.trainer_id, tuple(queued), barrier=barrier, fetch=tuple(names),
                         fetch_barrier=fetch_barrier, into=into or {}, arrived=arrived, sent=sent)
        what = "send barrier and fetch barrier" if barrier and fetch_barrier else "send and fetch"
        return endpoint, "SendFetchBatch", request, what

    def checkpoint_call(self, method: str, endpoints: Sequence[str], message: Any) -> list[Any]:
        """The replies of one `Checkpoint*` call (`message`) to every one of `endpoints`, in
        parallel, in order (`ops.rpc.own_dirs`)."""
        self.wait_pending()
        what = {"CheckpointPart": "checkpoint part", "CheckpointList": "checkpoint list",
                "CheckpointCommit": "checkpoint commit", "CheckpointRestore": "checkpoint restore"}.get(method, method)
        return self._gather([(self._future(ep, method, message), what, ep) for ep in endpoints])

    def checkpoint_notify(self, endpoints: Sequence[str], directory: str, lookup_table: str = "") -> None:
        message = rpc_pb2.CheckpointMessage(trainer_id=self.trainer_id, dir=directory, lookup_table=lookup_table)
        self._broadcast(endpoints, "CheckpointNotify", message, "checkpoint notify")

    def complete(
        self, endpoints: Sequence[str], *, failed: bool = False, reason: str = "", deadline: float | None = None
    ) -> None:
        """Tell the pservers this trainer is done, or failed (they stop at once). With
        `deadline`, give up after that many seconds and skip pservers never reached
        (a failure notice must not hang on a pserver that is gone)."""
        message = rpc_pb2.CompleteMessage(trainer_id=self.trainer_id, failed=failed, reason=reason)
        if failed:
            self._wait_recv(quiet=True)  # its failure is what is being reported, or beside it
            with self._lock:
                self._pending, self._queued = [], {}  # a failed trainer's sends no longer matter
                for stream in self._streams.values():
                    stream.started = []
            self._deferred_barrier = None
        else:
            self._send_deferred_barrier()
        if deadline is None:
            self._broadcast(endpoints, "SendComplete", message, "complete notice")
            return
        futures = []
        for endpoint in endpoints:
            ep = self._endpoints.get(endpoint)
            if ep is not None and ep.ready:
                future = self._pool.submit(ep.calls["SendComplete"], message, timeout=deadline)
                futures.append((future, "complete notice", endpoint))
        self._gather(futures)

    def _broadcast(self, endpoints: Sequence[str], method: str, message: Any, what: str) -> None:
        self.wait_pending()
        self._gather([(self._future(ep, method, message), what, ep) for ep in endpoints])

    def close(self) -> None:
        """Close the channels, after the early receive in flight (bounded; its failure is
        raised by the scope's readers of the vars it concerns)."""
        self._wait_recv(quiet=True)
        with self._lock:
            self._closed = True
            endpoints, self._endpoints = self._endpoints, {}
            self._pending, self._queued = [], {}
            streams, self._streams = self._streams, {}
        self._deferred_barrier = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        recv_pool, self._recv_pool = self._recv_pool, None
        if recv_pool is not None:
            recv_pool.shutdown(wait=True)  # idle: the receive was waited for
        for stream in streams.values():  # its thread ends after the send in flight (bounded by its deadline)
            stream.pool.shutdown(wait=False, cancel_futures=True)
        for ep in endpoints.values():
            if ep.bulk is not None:
                ep.bulk.close()
            ep.channel.close()


def _watch_ended(ep: _Endpoint, done: Any) -> None:
    """A Watch that ended in failure: when gRPC's connection to the pserver broke (not the
    pserver ending it, whose reasons start with "pserver "), the bulk channel, whose TCP
    cannot tell a frozen process from a busy one, stops waiting on it and new calls take gRPC
    (which then fails, or succeeds if the pserver is back)."""
    details = done.details() or ""
    if done.code() == grpc.StatusCode.UNAVAILABLE and not details.startswith("pserver "):
        ep.lost = details or "its connection closed"


_CLIENTS: dict[int, RpcClient] = {}
_CLIENTS_LOCK = threading.Lock()


def _names_by_endpoint(requests: Iterable[tuple[str, str]], endpoints: Iterable[str] = ()) -> dict[str, list[str]]:
    """endpoint -> the names `requests` want of it, each once, in order (a pserver refuses a
    fetch naming a var twice, `ops.rpc.limits`); `endpoints` get an entry even when empty."""
    wanted: dict[str, dict[str, None]] = {ep: {} for ep in endpoints}
    for endpoint, name in requests:
        wanted.setdefault(endpoint, {})[name] = None
    return {ep: list(names) for ep, names in wanted.items()}


def get_client(trainer_id: int = 0, **options: Any) -> RpcClient:
    """This process's client for `trainer_id` (created with `options` on first use)."""
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(int(trainer_id))
        if client is None or client._closed:
            client = _CLIENTS[int(trainer_id)] = RpcClient(trainer_id, **options)
        return client


def close_clients() -> None:
    """Close every client `get_client` made (tests and shutdown)."""
    with _CLIENTS_LOCK:
        clients = list(_CLIENTS.values())
        _CLIENTS.clear()
    for client in clients:
        client.close()
