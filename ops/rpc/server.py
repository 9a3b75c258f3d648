"""The pserver: a gRPC server over one scope, and the sync / async protocols.

Sync mode is a three-phase state machine, one round per training step:

    GET(0) ──Fanin fetch barriers──▶ SEND(1) ──Fanin send barriers──▶ OPTIMIZE(1) ──▶ GET(1) ──▶ SEND(2) …

* GET: gets are answered with the params of the last round (round 0: what the startup
  program initialised — the trainers' startup programs fetch them); each trainer ends
  its gets with a fetch barrier.
* SEND: each trainer sends its grads (`X` of `listen_and_serv`, one var per trainer
  per param block), then a send barrier.
* OPTIMIZE: every var of `X` must have arrived this round (else an error names the
  missing ones); the lr-decay block runs, then each optimize block, in the pserver's
  own scope (so params, accumulators and the lr persist across rounds).

A trainer's step is one RPC per pserver, `SendFetchBatch`: every grad of the step and
the send barrier, then every param block it wants and the fetch barrier, answered once
the round's optimize ran (the handler stores the sends, then waits for the GET phase);
or, where the trainer program reads something between its barriers, two: `SendBatch`
(the grads and the send barrier) and `FetchBatch` (the params and the fetch barrier). The
state machine moves in the handlers: the handler that brings the last barrier of a
phase opens the next one. The optimize blocks run on the thread of the `SendFetchBatch`
that brings the last send barrier (it waits for them anyway: one thread hand-off less
per round), else on `serve()`'s thread, woken by the last send barrier (a `SendBatch`,
answered at once, as in Paddle). Fetch replies are encoded outside the lock (one
request's reply size is not the others' wait); a sync round's optimize blocks may update
params in place (`RunContext.update_in_place`), so they wait for every reply being built
and none is built outside the GET phase. The one-var RPCs
(`SendVariable`, `GetVariable`, `SendBarrier`, `FetchBarrier`) are the same operations
with one var or none. A request that arrives in the wrong phase (a fast trainer's next
sends while a slow one still fetches; a get before the round's optimize ran) waits for
its phase.

`rpc_counts` counts the RPCs handled per method; `serve()` logs them at its end, with
the RPCs per step per trainer.

Async mode has no phases: a grad's optimize block runs in the handler when the grad
arrives, one thread per block at a time (a lock per block); gets answer the current
value; barriers are acknowledged. A `merge_add` send (the async lr-decay counter) is
added into the pserver's copy and the lr-decay block runs; the lr-decay block also
runs once when the server starts, so the rate exists before the first grad (if no
counter ever arrives, that first rate stays).

Prefetch (a trainer asking for rows of a table, at the start of its step, before its
sends): by table name, rows of that var are gathered (an auto-grown SelectedRows table
creates unseen ids' rows on first touch); by the ids var a prefetch block is keyed by
(`prefetch_var_name_to_block_id`), the block runs in a child scope with the ids bound to
that var and its output var sent back, so concurrent prefetches never share a
temporary. In sync mode a prefetch waits while the optimize blocks run (a correct
trainer never asks then), so it always sees the params of the last round; otherwise
prefetches run in parallel with each other, with sends and with gets.

A checkpoint notice names a checkpoint inside the pserver's checkpoint dir
(`ServeConfig.checkpointer`, `ops.rpc.checkpoint`), never a path of the trainer's
choosing: `ckpt-<step>` writes this pserver's part of that checkpoint (atomic, see
`ops.rpc.checkpoint`); a notice for a lookup table, on a pserver with a checkpoint block
(`checkpint_block_id`), binds `<checkpoint dir>/<name>` to `kLookupTablePath` and runs
that block (whose `save` writes the shard atomically). A name that is not a plain
relative name is `INVALID_ARGUMENT`, one that leaves the dir through a symlink
`PERMISSION_DENIED`, and a pserver started without a checkpoint dir refuses every notice
(`FAILED_PRECONDITION`): nothing is written.

In sync mode the grads a round needs are `X` plus what the trainers send for the
blocks of `grad_to_block_id` that `X` does not list (the distributed table's
per-trainer shard grads): `ServeConfig.received` holds them all.

Every RPC a trainer makes is counted when answered; in sync mode the pserver's final log line gives the
RPCs per step, counted between the ends of the first and the last optimize: whole steps
only, so each kind of message (a step's prefetches, sends, barriers, gets) counts once per
step, and the startup fetch and the complete notices not at all.

Trainers leave with `SendComplete`; once all `Fanin` have, the server stops and
`serve()` returns. If a trainer completes while others go on, its grads count as
zeros from then on (Paddle resets received vars the same way), and barriers wait for
the trainers still active.

Timeouts: a trainer the pserver is waiting for (for a barrier in sync mode; any
trainer in async mode) that has no RPC in flight and has sent nothing for `timeout`
seconds is declared gone: every waiting RPC is aborted with the reason, and `serve()`
raises `PserverError` naming the pserver, the trainer, its last request and the step.
A trainer that reports a failure (`SendComplete(failed=True)`) stops the pserver the
same way. A failed pserver answers every RPC with its reason for `FAILURE_LINGER`
seconds before it stops listening, so trainers between two calls learn it too. A handler whose client disconnected (a killed trainer) stops counting as
in flight within `POLL` seconds.

Failure detection: each trainer holds one `Watch` call open on each pserver (re-called
every `WATCH_SECONDS`; not counted as an RPC). A killed trainer's connection closes at
once and its Watch ends with it: unless the trainer is back (a Watch or an RPC) within
`lost_grace` seconds (default 3), the pserver fails naming the trainer, where the
protocol was when the connection closed, and its last request, in seconds rather than
after `timeout`. A trainer that is silent for `timeout` while its Watch is open is alive
but blocked: the message says so (it may be waiting on another pserver) instead of
calling it gone. gRPC keepalive (`ops.rpc.service`) fails the calls to a frozen peer
(SIGSTOP, a vanished machine) within ~15 s: a trainer blocked on a frozen pserver fails
naming it and tells the other pservers, whose error then names the frozen one.

Received vars are checked before anything is stored (`ops.rpc.validate`); a trainer has
at most `IN_FLIGHT_CAP` calls of a kind in flight here (more are refused at once). No
request may hold the lock or memory for time or bytes the sender chose (`ops.rpc.limits`,
docs/request-limits.md): a fetch names each var once, replies are sized before encoding
and refused past a limit from the program, small requests are refused from their size.
"""

from __future__ import annotations

import enum
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent import futures
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from ops.rpc import bulk
from ops.rpc import arrival_sum
from ops.rpc.arrival_sum import ADD, BASE, HOLD, Arrivals, SumPlan, TornSum
from ops.rpc.auth import Gate, ServerAuth
from ops.rpc.bind import check_bindable
from ops.rpc.checkpoint import CheckpointError, Checkpointer, CheckpointPathError, confine, step_of
from ops.rpc.errors import BindError, PserverError
from ops.rpc.limits import REASON_CHARS, SMALL_REQUEST, Limited, Limits, Malformed, Oversized, declared_bytes, guard_decoder
from ops.rpc.malloc import bound_arenas, keep_freed_memory
from ops.rpc.own_dirs import OwnDirRpc
from ops.rpc.service import DEFAULT_TIMEOUT, LOST_GRACE, METHODS, SERVICE_NAME, server_options
from ops.rpc.validate import Expected, Refused, max_message
from ops.rpc.wire import WireBatch, WireVar, decode_batch, encode_batch, encode_var, var_parts
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows
from proto import rpc_pb2
from transpiler.naming import LOOKUP_TABLE_PATH

POLL = 0.2  # seconds between liveness checks of a waiting thread
WATCH_SECONDS_MAX = 300.0  # the longest a Watch call is held
FAILURE_LINGER = 1.0  # seconds a failed pserver keeps answering, with its reason, before it stops


class Phase(enum.Enum):
    GET = "get"
    SEND = "send"
    OPTIMIZE = "optimize"
    ASYNC = "async"


@dataclass(frozen=True)
class ServeConfig:
    """What `listen_and_serv`'s attrs (and the runtime's options) say about one pserver."""

    endpoint: str
    fanin: int
    sync_mode: bool = True
    received: tuple[str, ...] = ()  # X: the grads trainers send here
    optimize_blocks: tuple[int, ...] = ()
    grad_to_block: Mapping[str, int] = field(default_factory=dict)
    lr_decay_block: int = -1
    pserver_id: int = 0
    timeout: float = DEFAULT_TIMEOUT
    bind: str | None = None  # listen here instead of `endpoint` (e.g. 0.0.0.0:port)
    known_vars: frozenset[str] | None = None  # names trainers may send; None: any
    templates: Mapping[str, tuple[tuple[int, ...], Any]] = field(default_factory=dict)  # X name -> (shape, dtype)
    persistables: tuple[str, ...] = ()  # what a checkpoint saves
    sparse_vars: frozenset[str] = frozenset()  # received vars declared SELECTED_ROWS (their zeros are empty)
    prefetch_blocks: Mapping[str, tuple[int, str]] = field(default_factory=dict)  # ids var -> (block, output var)
    checkpoint_block: int = -1  # runs on a lookup-table checkpoint notice
    checkpoint_path_var: str = LOOKUP_TABLE_PATH  # bound to the notice's path first
    auth: ServerAuth = ServerAuth()  # the job token, TLS, the loopback default (`ops.rpc.auth`)
    plan_fingerprint: str | None = None  # the handshake compares it with the trainers' when both know it
    checkpointer: Checkpointer | None = None  # the checkpoint dir; None: notices are refused
    restorer: Any = None  # an ops.rpc.own_dirs.PartRestorer: restore at the step trainer 0 agrees
    refuse_nonfinite: bool = False  # refuse a received var holding a NaN or an Inf
    lost_grace: float = LOST_GRACE  # seconds a trainer whose connection closed has to come back
    # sync: the optimize blocks' first `sum`s of the trainers' copies of a grad, done as they
    # arrive when the bulk channel is open (`ops.rpc.arrival_sum`)
    arrival_sums: tuple[SumPlan, ...] = ()

    def __post_init__(self) -> None:
        if self.fanin < 1:
            raise PserverError(f"pserver {self.endpoint}: Fanin must be >= 1, got {self.fanin}")
        if not self.timeout > 0:
            raise PserverError(f"pserver {self.endpoint}: the timeout must be positive, got {self.timeout}")


class _Abort(Exception):
    """End one RPC with a status code and a reason."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


# Bounded concurrency: a trainer has one send, one fetch and a few prefetches in flight
# per pserver at a time; one more of a kind is refused at once (RESOURCE_EXHAUSTED)
# instead of parking a server thread, so a flood of sends cannot starve the gets and
# barriers the round waits for. The thread pool holds every trainer's quota.
_SENDS = frozenset({"SendBatch", "SendFetchBatch", "SendVariable", "SendBarrier"})  # the calls that send into a round
IN_FLIGHT_CAP = {"send": 2, "fetch": 2, "prefetch": 8, "checkpoint": 1, "checkpoint set": 2}
_KIND = {
    "SendBatch": "send", "SendVariable": "send", "SendBarrier": "send", "SendFetchBatch": "send",
    "FetchBatch": "fetch", "GetVariable": "fetch", "FetchBarrier": "fetch",
    "PrefetchVariable": "prefetch", "CheckpointNotify": "checkpoint",
    # per-pserver dirs (ops.rpc.own_dirs): a part, a list, a commit, a restore (a second restore wait is refused there)
    "CheckpointPart": "checkpoint set", "CheckpointList": "checkpoint set", "CheckpointCommit": "checkpoint set",
    "CheckpointRestore": "checkpoint set",
}
SPARE_WORKERS = 16  # completes, checkpoint notices, refusals
WATCHES_PER_TRAINER = 4  # Watch calls a trainer id may hold open (one per client; a `fetch` pull as trainer 0 is a second); more are refused


@dataclass
class _Trainer:
    last_seen: float
    inflight: int = 0
    last_what: str | None = None
    by_kind: dict[str, int] = field(default_factory=dict)  # in flight per `_KIND`
    watches: int = 0  # Watch calls open: the trainer's process is alive and connected
    lost_at: float | None = None  # when its last Watch ended because the connection closed
    lost_step: str = ""  # where the protocol was then


class PServer(OwnDirRpc):
    """One pserver. `serve()` blocks until every trainer completed (returns), `stop()`
    is called (returns), or the protocol fails (raises `PserverError`)."""

    def __init__(
        self,
        config: ServeConfig,
        scope: Scope,
        run_block: Callable[[int], None],
        *,
        log: Callable[[str], None] | None = None,
        run_in: Callable[[int, Scope], None] | None = None,
    ) -> None:
        keep_freed_memory()  # a step's MB buffers reuse their pages (ops.rpc.malloc)
        bound_arenas()  # and its many threads share a few arenas: freed pages do not pile up per thread
        self.config = config
        self.scope = scope
        self._run_block = run_block
        self._run_in = run_in  # run a block in a given scope (prefetch blocks)
        self._expected = Expected(config)
        self._limits = Limits(config)  # bounded work per request (`ops.rpc.limits`)
        self._log = log or (lambda text: None)
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # the state; Watch calls wait on it for a stop, a failure, a completion
        # RPCs waiting for a phase wait on this one (same lock): a phase change, twice a
        # round, wakes them and not every trainer's Watch.
        self._phase_cond = threading.Condition(lock)
        self._phase = Phase.GET if config.sync_mode else Phase.ASYNC
        self._round = 0  # sync: optimize rounds done; async: grads applied
        self._barriers: set[int] = set()
        self._received: set[str] = set()
        self._completed: set[int] = set()
        self._failure: str | None = None
        self._stopping = False
        now = time.monotonic()
        self._trainers = {t: _Trainer(last_seen=now) for t in range(config.fanin)}
        self._block_locks = {idx: threading.Lock() for idx in set(config.grad_to_block.values())}
        self._lr_lock = threading.Lock()
        self._checkpoint_lock = threading.Lock()
        self._table_saves: list[Path] = []  # lookup-table checkpoint paths this process wrote, oldest first
        self._wake = threading.Event()  # for serve(): a round to run, every trainer completed, stop() or a failure
        self._optimizer_claimed = False  # the OPTIMIZE phase's blocks have a thread running them
        # Sync: the fetch replies of this GET phase by the names asked (every trainer asks
        # the same params, and they stay put until the next round): encoded once, outside
        # the lock; at most `Limits.reply_limit` bytes of them, dropped when the phase ends.
        self._replies: dict[tuple[str, ...], _SharedReply] = {}
        self._replies_bytes = 0
        self._readers = 0  # sync: fetch replies being encoded outside the lock
        self._readers_idle = threading.Condition(lock)  # the round's optimize waits on it for `_readers == 0`
        self._calls: dict[str, int] = {}  # RPCs handled per method
        self._server: grpc.Server | None = None
        # Cross-pserver sums (ops.rpc.reduce.PeerReduce): peers' partials go to it, not to the rounds.
        self.peer_reduce: Any = None
        self.port: int | None = None
        self.started_at = now
        self._bulk: bulk.BulkListener | None = None  # the bulk channel (`ops.rpc.bulk`), when offered
        self._bulk_buffers: dict[tuple[int, str], np.ndarray] = {}  # sync: (trainer, var) -> its receive buffer
        self._bulk_lock = threading.Lock()
        # Chunk buffers of sums on arrival not in use (`_chunk_buffer`): one per add at once, not one per connection.
        self._chunk_buffers: list[np.ndarray] = []
        self.chunk_buffers_made = 0  # (tests: how many adds ran at once)
        self._lending_to: int | None = None  # the thread running a sync round's optimize blocks
        # Sums on arrival (`ops.rpc.arrival_sum`), on once the channel opens: received var ->
        # its grad's sum, and the (block, op index) of the `sum` ops the executor skips then.
        self._sums: dict[str, Arrivals] = {}
        self._sum_list: list[Arrivals] = []
        self.skip_ops: set[tuple[int, int]] = set()

    # ------------------------------------------------------------ lifecycle
    @property
    def address(self) -> str:
        """host:port actually listened on (port resolved when binding port 0)."""
        host = (self.config.bind or self.config.endpoint).rpartition(":")[0]
        return f"{host}:{self.port}"

    @property
    def rounds(self) -> int:
        return self._round

    @property
    def rpc_counts(self) -> dict[str, int]:
        """RPCs handled so far, per method."""
        with self._cond:
            return dict(self._calls)

    def rpc_summary(self) -> str:
        """One line: RPCs per step per trainer (sync) and the count per method."""
        counts = self.rpc_counts
        total = sum(counts.values())
        methods = ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        where = f"pserver {self.config.endpoint}"
        if not self.config.sync_mode or not self._round:
            done = f"{self._round} grad(s) applied" if not self.config.sync_mode else "0 steps"
            return f"{where}: {total} rpc over {done} ({methods})"
        per = total / (self._round * self.config.fanin)
        return f"{where}: {per:.2f} rpc/step/trainer over {self._round} steps ({methods})"

    @property
    def stopped(self) -> bool:
        """True when serving ended before every trainer completed (`stop()` or a failure)."""
        return self._stopping

    def start(self) -> None:
        """Bind and start answering RPCs (in async mode after a first lr-decay run)."""
        where = self.config.bind or self.config.endpoint
        who_may_call = self.config.auth.check_listen(where, self.config.endpoint)  # before anything runs or binds
        check_bindable(where, who=f"pserver {self.config.endpoint}")  # a clear reason, before gRPC's own line
        credentials = self.config.auth.credentials()
        if not self.config.sync_mode and self.config.lr_decay_block >= 0:
            self._run(self.config.lr_decay_block, "the lr-decay block")

        def refuse(reason: str) -> None:  # a trainer started for another job: every process must stop
            with self._cond:
                self._failure = self._failure or reason
                self._notify_all_locked()

        gate = Gate(self.config.auth.token, endpoint=self.config.endpoint, fanin=self.config.fanin,
                    sync_mode=self.config.sync_mode, plan=self.config.plan_fingerprint, refuse=refuse)
        workers = self.config.fanin * (sum(IN_FLIGHT_CAP.values()) + WATCHES_PER_TRAINER) + SPARE_WORKERS
        options = server_options(max_receive=max_message(self.config))
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=options, interceptors=(gate,))
        sizes = self._limits.request_limits()
        fields = self._limits.batch_fields(self.config.sync_mode)
        batch = partial(decode_batch, max_fields=fields) if fields is not None else decode_batch
        decoders = {"SendBatch": batch, "SendFetchBatch": batch}  # a hand walk bounded by the program
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                self._guarded(getattr(self, f"_rpc_{name}")),
                request_deserializer=guard_decoder(name, sizes.get(name), decoders.get(name, method.decode_request)),
                response_serializer=method.encode_response,
            )
            for name, method in METHODS.items()
        }
        handlers[bulk.METHOD] = grpc.unary_unary_rpc_method_handler(
            self._guarded(self._rpc_BulkChannel),
            request_deserializer=guard_decoder(bulk.METHOD, SMALL_REQUEST, rpc_pb2.VoidMessage.FromString),
            response_serializer=lambda data: data)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        try:
            port = server.add_secure_port(where, credentials) if credentials else server.add_insecure_port(where)
        except RuntimeError as exc:
            raise BindError(f"pserver {self.config.endpoint}: cannot listen on {where} ({exc}); is the port in use?") from None
        if not port:
            raise BindError(f"pserver {self.config.endpoint}: cannot listen on {where}; is the port in use?")
        self.port = port
        limit = max_message(self.config)
        self._bulk_limit = limit if limit > 0 else bulk.OPEN_LIMIT  # no program: what gRPC's protobuf takes
        if bulk.offers_bulk(self._largest_var()):
            try:
                self._bulk = bulk.BulkListener(
                    where.rpartition(":")[0], token=self.config.auth.token, tls=self.config.auth.tls,
                    timeout=self.config.timeout, handle=self._bulk_call,
                    max_connections=self.config.fanin * (IN_FLIGHT_CAP["send"] + IN_FLIGHT_CAP["fetch"]) + 8,
                    max_vars=fields or (1 << 16), port=bulk.bulk_port(port), shm=bulk.shm_choice(), log=self._log)
            except OSError as exc:
                server.stop(None)
                raise BindError(f"pserver {self.config.endpoint}: {exc.strerror or exc}") from None
        if self._bulk is not None and self.config.sync_mode and not self.config.refuse_nonfinite:
            # non-finite grads are refused whole, before anything is stored: not summed on arrival.
            # Only big grads (`MIN_BYTES`, the bulk channel's threshold): a sum on arrival cannot take a
            # copy back, so a second copy in a round is refused; a small grad keeps the `sum` op,
            # where the last copy of a round still counts, and costs no memory worth saving.
            for plan in self.config.arrival_sums:
                if plan.nbytes < arrival_sum.MIN_BYTES:
                    continue
                arrivals = Arrivals(plan)
                self._sum_list.append(arrivals)
                self._sums.update((name, arrivals) for name in plan.inputs)
                self.skip_ops.add((plan.block, plan.op_index))
            self._adopt_sums()
        server.start()
        self._log(f"pserver {self.config.endpoint}: {who_may_call}")
        self._server = server
        self.started_at = time.monotonic()
        with self._cond:
            for state in self._trainers.values():
                state.last_seen = self.started_at

    def serve(self, on_ready: Callable[[PServer], None] | None = None) -> None:
        """Start, run the protocol to its end, and shut the server down."""
        if self._server is None:
            self.start()
        try:
            mode = "sync" if self.config.sync_mode else "async"
            channel = f", tensors on the bulk channel at port {self._bulk.port}" if self._bulk is not None else ""
            self._log(f"pserver {self.config.endpoint}: serving on {self.address} ({mode}, {self.config.fanin} trainer(s){channel})")
            if on_ready is not None:
                on_ready(self)
            try:
                self._monitor()
            except PserverError:
                time.sleep(FAILURE_LINGER)  # trainers calling now learn why, not just "unavailable"
                raise
            if not self._stopping:
                done = f"{self._round} step(s)" if self.config.sync_mode else f"{self._round} grad(s) applied"
                self._log(f"pserver {self.config.endpoint}: all {self.config.fanin} trainer(s) completed after {done}")
                self._log(self.rpc_summary())
                if self._bulk is not None and self._bulk.rings:
                    self._log(f"pserver {self.config.endpoint}: {self._bulk.rings} bulk connection(s) with a "
                              f"shared-memory ring, {self._bulk.ring_slots()} slot(s) handed over")
        finally:
            self.shutdown()

    def stop(self) -> None:
        """Stop serving (from another thread or a signal handler); `serve()` returns."""
        with self._cond:
            self._stopping = True
            self._notify_all_locked()
        self._wake.set()

    def shutdown(self, grace: float = 2.0) -> None:
        with self._cond:
            self._stopping = self._stopping or len(self._completed) < self.config.fanin
            self._notify_all_locked()
        self._wake.set()
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace).wait()
        listener, self._bulk = self._bulk, None
        if listener is not None:
            listener.close()

    def _guarded(self, handler: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """`handler`, but a request its decoder would not parse (`Oversized`) is answered
        RESOURCE_EXHAUSTED before anything reads it, and one it could not (`Malformed`)
        INVALID_ARGUMENT."""

        def guarded(request: Any, context: Any) -> Any:
            if isinstance(request, Oversized):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"pserver {self.config.endpoint}: a {request.method} request of {request.size} bytes; "
                              f"the limit is {request.limit}")
            if isinstance(request, Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"pserver {self.config.endpoint}: a malformed {request.method} request: {request.reason}")
            return handler(request, context)

        return guarded

    # ------------------------------------------------------------ the sync rounds
    def _arrive_locked(self, trainer_id: int, *, optimize_here: bool = False) -> bool:
        """Count `trainer_id`'s barrier of the current phase (lock held). True when it
        opened the OPTIMIZE phase and `optimize_here`: the caller then runs the round
        (`_optimize_round`), as it would wait for it anyway."""
        self._barriers.add(trainer_id)
        return self._advance_locked(optimize_here=optimize_here)

    def _advance_locked(self, *, optimize_here: bool = False) -> bool:
        """Open the next phase once every active trainer's barrier is in (lock held); the
        OPTIMIZE phase runs on `serve()`'s thread, or, with `optimize_here`, on the caller's
        (True then): one thread hand-off less per round."""
        active = self._active()
        if not active or not self._barriers >= active or self._failure is not None or self._stopping:
            return False
        self._barriers.clear()
        if self._phase is Phase.GET:
            self._phase = Phase.SEND
            self._received.clear()
            self._replies.clear()  # the round's shared replies go (a reader still sending one holds it)
            self._replies_bytes = 0
            self._phase_cond.notify_all()
        elif self._phase is Phase.SEND:
            self._phase = Phase.OPTIMIZE
            if optimize_here:
                self._optimizer_claimed = True
                return True
            self._wake.set()
        return False

    def _optimize_round(self) -> None:
        """Run the round's blocks, then answer its gets (the caller claimed the round).
        Fetch replies are encoded outside the lock: the blocks, which may update params in
        place, wait for the last of them first."""
        try:
            with self._cond:
                while self._readers and self._failure is None and not self._stopping:
                    self._readers_idle.wait(POLL)
            self._optimize()
        finally:
            with self._cond:
                self._optimizer_claimed = False
        with self._cond:
            self._round += 1
            self._phase = Phase.GET
            self._phase_cond.notify_all()

    def _active(self) -> set[int]:
        return set(self._trainers) - self._completed

    def _optimize(self) -> None:
        """The round's blocks: check every grad arrived, the lr block, the optimize blocks."""
        step = self._round + 1
        missing = [name for name in self.config.received if name not in self._received]
        if missing and not self._completed:
            shown = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
            self._fail(f"step {step}: every trainer sent its send barrier but {len(missing)} grad(s) never arrived: {shown}")
        for name in missing:  # a completed trainer's grads count as zeros (Paddle's reset)
            if name not in self._sums:  # summed on arrival: added as zeros in its turn (`_complete_sums`)
                self.scope.set_var(name, self._zeros(name))
        if self._sum_list:
            self._complete_sums(step)
        self._lending_to = threading.get_ident()  # `lend_chunk_buffer`: to this thread's blocks only
        try:
            lr = self.config.lr_decay_block
            if lr >= 0:
                self._run(lr, "the lr-decay block", step)
            for idx in self.config.optimize_blocks:
                if idx != lr:
                    self._run(idx, f"optimize block {idx}", step)
        finally:
            self._lending_to = None
        if self._sum_list:
            self._release_aliased_sums()

    def _complete_sums(self, step: int) -> None:
        """Put each summed-on-arrival grad in the scope, as its skipped `sum` would have
        (completed trainers' grads added as zeros in their turns); a torn one fails the round."""
        for arrivals in self._sum_list:
            with arrivals.cond:
                try:
                    array, lod = arrivals.complete()
                except TornSum as exc:
                    torn = str(exc)
                else:
                    torn = None
                    self.scope.set_var(arrivals.plan.out, LoDTensor(array, lod))
                    arrivals.reset()
            if torn is not None:  # outside the sum's lock: `_fail` takes the pserver's
                self._fail(f"step {step}: the sum of {arrivals.plan.out} cannot be used: {torn}")

    def _adopt_sums(self) -> None:
        """Sum into the array each summed grad holds already (the startup program's, a
        persistable var's), when it is this process's alone: no second grad-sized array
        beside it through the first round."""
        held = self._persistable_memory({arrivals.plan.out for arrivals in self._sum_list})
        for arrivals in self._sum_list:
            value, plan = self.scope.find_var(arrivals.plan.out), arrivals.plan
            if type(value) is not LoDTensor:
                continue
            array = value.array
            if (array.shape == plan.shape and array.dtype == plan.dtype and array.base is None
                    and array.flags.c_contiguous and array.flags.writeable and not held.overlaps(array)):
                arrivals.acc = array

    def _release_aliased_sums(self) -> None:
        """An accumulator a persistable var other than its grad now views (a kernel kept a
        view of the summed grad) is not summed into again: the next round makes a new one."""
        held = self._persistable_memory({arrivals.plan.out for arrivals in self._sum_list})
        for arrivals in self._sum_list:
            if arrivals.acc is not None and held.overlaps(arrivals.acc):
                arrivals.acc = None

    def _zeros(self, name: str) -> Any:
        value = self.scope.find_var(name)
        if isinstance(value, SelectedRows):
            return SelectedRows.empty(value.height, value.row_shape, value.dtype)
        if isinstance(value, LoDTensor):
            return LoDTensor(np.zeros_like(value.array))
        shape, dtype = self.config.templates.get(name, ((), None))
        if name in self.config.sparse_vars and dtype is not None and len(shape) >= 1 and min(shape) >= 0:
            return SelectedRows.empty(shape[0], shape[1:], dtype)
        if dtype is None or any(d < 0 for d in shape):
            self._fail(f"grad {name} never arrived and its shape is unknown, so it cannot count as zeros")
        return LoDTensor(np.zeros(shape, dtype))

    def _run(self, idx: int, what: str, step: int | None = None) -> None:
        try:
            self._run_block(idx)
        except Exception as exc:  # a kernel failed: the pserver cannot go on
            at = f"step {step}: " if step is not None else ""
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            message = f"pserver {self.config.endpoint}: {at}{what} failed: {reason}"
            self._set_failure(message)
            raise PserverError(message) from exc

    # ------------------------------------------------------------ waiting, liveness
    def _monitor(self) -> None:
        """Until every trainer completed or `stop()` (return) or a failure (raise): run
        each sync round's optimize blocks when its last send barrier is in, and check
        every `POLL` seconds that the trainers the protocol waits for are alive."""
        while True:
            self._wake.wait(POLL)
            self._wake.clear()  # state is read after this: a wake-up set since is not lost
            with self._cond:
                if self._failure is not None:
                    raise PserverError(self._failure)
                if self._stopping or len(self._completed) == self.config.fanin:
                    return
                due = self._phase is Phase.OPTIMIZE and not self._optimizer_claimed
                self._optimizer_claimed = self._optimizer_claimed or due
                if not due:
                    self._check_liveness()
            if due:
                self._optimize_round()

    def _check_liveness(self) -> None:
        """Fail if a trainer we wait for is gone (called with the lock held)."""
        if self._phase is Phase.OPTIMIZE:
            return  # waiting for no trainer
        now = time.monotonic()
        waited = self._active() - self._barriers if self.config.sync_mode else self._active()
        for tid in sorted(waited):
            state = self._trainers[tid]
            lost = state.lost_at is not None and not state.watches and now - state.lost_at > self.config.lost_grace
            # A call in flight keeps a trainer waited for, unless its Watch line is lost: a
            # frozen trainer's gRPC calls end with the keepalive, but one on the bulk channel
            # (a plain TCP stream, which the frozen peer's kernel keeps open) would not.
            if state.inflight and not lost:
                continue
            if not lost and now - state.last_seen <= self.config.timeout:
                continue
            if lost:
                last = f" (its last request: {state.last_what})" if state.last_what else ""
                what = (f"trainer {tid}'s connection closed {state.lost_step} and it did not come back "
                        f"within {self.config.lost_grace:g} s{last}")
            elif state.last_what is None:
                what = f"trainer {tid} never contacted the pserver in {self.config.timeout:g} s"
            else:
                what = f"trainer {tid} sent nothing for {self.config.timeout:g} s (its last request: {state.last_what})"
            if state.watches and not lost:
                what += ("; its connection is open, so it is alive but blocked "
                         "(it may be waiting on another pserver): this pserver cannot tell which party is at fault")
            if self.config.sync_mode:
                waiting_for = "fetch barrier" if self._phase is Phase.GET else "send barrier"
                where = f"step {self._round + (0 if self._phase is Phase.GET else 1)} waits for its {waiting_for}"
            else:
                where = f"after {self._round} grad(s) applied"
            self._fail(f"{what}; {where}")

    def _fail(self, reason: str) -> None:
        message = reason if reason.startswith("pserver ") else f"pserver {self.config.endpoint}: {reason}"
        self._set_failure(message)
        raise PserverError(message)

    def _notify_all_locked(self) -> None:
        """Wake every waiting thread, the Watch calls too (a stop, a failure, a completion)."""
        self._cond.notify_all()
        self._phase_cond.notify_all()

    def _set_failure(self, message: str) -> None:
        """Record the first failure: every RPC answers with it from now on."""
        with self._cond:
            self._failure = self._failure or message
            self._notify_all_locked()
        self._wake.set()

    def _wait_phase(self, phase: Phase, context: Any) -> None:
        """Block an RPC until the server is in `phase` (called with the lock held)."""
        while self._phase is not phase:
            self._check_open()
            if context is not None and not context.is_active():
                raise _Abort(grpc.StatusCode.CANCELLED, "the client went away")
            self._phase_cond.wait(POLL)
        self._check_open()

    def _wait_not_optimizing(self, context: Any) -> None:
        """Block an RPC while the optimize blocks run (called with the lock held)."""
        while self._phase is Phase.OPTIMIZE:
            self._check_open()
            if context is not None and not context.is_active():
                raise _Abort(grpc.StatusCode.CANCELLED, "the client went away")
            self._phase_cond.wait(POLL)
        self._check_open()

    def _check_open(self) -> None:
        if self._failure is not None:
            raise _Abort(grpc.StatusCode.ABORTED, self._failure)
        if self._stopping:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, f"pserver {self.config.endpoint} is shutting down")

    @contextmanager
    def _visit(self, method: str, trainer_id: int, what: str):
        """Account one RPC of `trainer_id` (in flight while the body runs)."""
        with self._cond:
            self._calls[method] = self._calls.get(method, 0) + 1
            state = self._trainers.get(trainer_id)
            if state is None:
                raise _Abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"pserver {self.config.endpoint}: trainer id {trainer_id} is out of range for Fanin {self.config.fanin}",
                )
            kind = _KIND.get(method)
            if kind is not None:
                count = state.by_kind.get(kind, 0)
                if count >= IN_FLIGHT_CAP[kind]:
                    raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"pserver {self.config.endpoint}: trainer {trainer_id} already has {count} {kind}(s) "
                                 f"in flight here (at most {IN_FLIGHT_CAP[kind]}); refused")
                state.by_kind[kind] = count + 1
            state.inflight += 1
            state.last_seen = time.monotonic()
            # a call that sends belongs to the next round even while this one's GET phase lasts
            # (a faster trainer's next step, the other trainer still fetching)
            ahead = method in _SENDS or self._phase is not Phase.GET
            state.last_what = f"{what} at step {self._round + ahead}" if self.config.sync_mode else what
        try:
            yield
        finally:
            with self._cond:  # no notify: only the liveness check reads this, every POLL
                if kind is not None:
                    state.by_kind[kind] -= 1
                state.inflight -= 1
                state.last_seen = time.monotonic()

    def _handle(self, context: Any, method: str, trainer_id: int, what: str, body: Callable[[], Any]) -> Any:
        if (waiting := self._restoring(method)) is not None:  # ops.rpc.own_dirs: before the agreed restore
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, waiting)
        try:
            with self._visit(method, trainer_id, what):
                return body()
        except (_Abort, Limited) as exc:
            context.abort(exc.code, exc.details)
        except PserverError as exc:
            context.abort(grpc.StatusCode.ABORTED, str(exc))

    # ------------------------------------------------------------ RPC handlers: vars
    def _rpc_SendBatch(self, request: WireBatch, context: Any) -> rpc_pb2.VoidMessage:  # noqa: N802 - gRPC's name
        what = "send barrier" if request.barrier else _send_label(request.vars)
        return self._handle(context, "SendBatch", request.trainer_id, what, lambda: self._on_send(request, context, "SendBatch"))

    def _rpc_SendVariable(self, request: WireVar, context: Any) -> rpc_pb2.VoidMessage:  # noqa: N802
        if self.peer_reduce is not None and request.name.startswith("@PEER_PARTIAL@"):  # another pserver's
            try:
                self.peer_reduce.receive(request)
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"pserver {self.config.endpoint}: {exc}")
            return rpc_pb2.VoidMessage()
        batch = WireBatch(request.trainer_id, False, (request,))
        return self._handle(context, "SendVariable", request.trainer_id, f"send of {request.name}",
                            lambda: self._on_send(batch, context, "SendVariable"))

    def _rpc_SendBarrier(self, request: Any, context: Any) -> rpc_pb2.VoidMessage:  # noqa: N802
        batch = WireBatch(request.trainer_id, True, ())
        return self._handle(context, "SendBarrier", request.trainer_id, "send barrier", lambda: self._on_send(batch, context, "SendBarrier"))

    def _on_send(self, batch: WireBatch, context: Any, method: str) -> rpc_pb2.VoidMessage:
        self._store_batch(batch, context, method=method)
        return rpc_pb2.VoidMessage()

    def _store_batch(self, batch: WireBatch, context: Any, *, optimize_here: bool = False, method: str = "SendBatch",
                     summed: frozenset[str] = frozenset()) -> bool:
        """Store the batch's vars (checked first, all or none: `ops.rpc.validate`; in sync
        mode each var at most once, `ops.rpc.limits`); with its barrier, count the sender's
        send barrier. True when that barrier opened the round's optimize and
        `optimize_here` claimed it for the caller (`_arrive_locked`). `summed`: the vars the
        bulk channel added into their sums already (`_receive_summed`)."""
        try:
            self._expected.check(batch)
        except Refused as exc:
            if summed:  # a var of this call is in its grad's sum already: the round cannot run
                self._set_failure(f"pserver {self.config.endpoint}: trainer {batch.trainer_id}'s {method} was refused "
                                  f"after {', '.join(sorted(summed))} had been summed on arrival: {exc}")
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if self.config.sync_mode and len(batch.vars) > 1:
            self._limits.check_sends((var.name for var in batch.vars), batch.trainer_id, method)
        if not self.config.sync_mode:
            with self._cond:
                self._check_open()
            for var in batch.vars:
                self._apply_async(var)
            return False
        with self._cond:
            self._wait_phase(Phase.SEND, context)
            sums = self._sums
            if sums:
                self._check_unclaimed([var.name for var in batch.vars if var.name in sums and var.name not in summed],
                                      batch.trainer_id)
            for var in batch.vars:
                if var.name in sums:
                    if var.name not in summed:
                        self._sum_whole(var)
                else:
                    self._store(var)
                self._received.add(var.name)
            return batch.barrier and self._arrive_locked(batch.trainer_id, optimize_here=optimize_here)

    # ------------------------------------------------------------ sums on arrival (ops.rpc.arrival_sum)
    def _check_unclaimed(self, names: list[str], tid: int) -> None:
        """Refuse (nothing stored) a var whose sum took this round's copy already."""
        for name in names:
            arrivals = self._sums[name]
            with arrivals.cond:
                if arrivals.torn is not None:
                    raise _Abort(grpc.StatusCode.ABORTED, f"pserver {self.config.endpoint}: {arrivals.torn}")
                if arrivals.state[arrivals.position[name]] != "none":
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"pserver {self.config.endpoint}: trainer {tid}'s send of {name!r}: sent twice in "
                                 f"step {self._round + 1}; the pserver sums {arrivals.plan.out} as its parts arrive")

    def _sum_whole(self, var: WireVar) -> None:
        """A whole received value (gRPC) into its grad's sum, in its turn (lock held)."""
        arrivals = self._sums[var.name]
        k = arrivals.position[var.name]
        value = var.value
        source = np.ascontiguousarray(value.array).reshape(-1)
        with arrivals.cond:
            mode = arrivals.claim(k, may_wait=False)
            acc = arrivals.flat()
            if mode == BASE:
                np.copyto(acc, source)
            elif mode == ADD:
                np.add(acc, source, out=acc)
            else:
                np.copyto(arrivals.buffer(k), source)
            arrivals.finish(k, mode, value.lod)

    def _apply_async(self, var: WireVar) -> None:
        """Async mode: store a grad and run its optimize block (one run per block at a
        time); a `merge_add` var (the lr-decay counter) is added in and the lr block runs."""
        if var.merge_add:
            with self._lr_lock:
                self._store(var)
                if self.config.lr_decay_block >= 0:
                    self._run(self.config.lr_decay_block, "the lr-decay block")
            return
        block = self.config.grad_to_block.get(var.name)
        if block is None:
            self._store(var)
            return
        with self._block_locks[block]:
            self._store(var)
            self._run(block, f"optimize block {block} (for {var.name})")
            with self._cond:  # counted before the block is free: a checkpoint holding the block locks sees it
                self._round += 1

    def _store(self, var: WireVar) -> None:
        value = var.value
        if var.merge_add:
            old = self.scope.find_var(var.name)
            if isinstance(old, LoDTensor) and isinstance(value, LoDTensor):
                if old.array.shape != value.array.shape:
                    raise _Abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"merge_add of {var.name}: shape {list(value.array.shape)} does not match {list(old.array.shape)}",
                    )
                value = LoDTensor(old.array + value.array.astype(old.array.dtype, copy=False), old.lod)
        self.scope.set_var(var.name, value)

    def _rpc_SendFetchBatch(self, request: WireBatch, context: Any) -> bytes:  # noqa: N802
        """A `SendBatch` and a `FetchBatch` in one call: store the sends (and count the
        send barrier), then wait for the fetch's phase and answer it, as the two calls
        would one after the other. Its label is where it leaves the trainer: at its fetch
        barrier, when it carries one. The names to fetch are checked before anything is
        stored (`ops.rpc.limits`): a refused call changes nothing."""
        if request.fetch_barrier:
            what = "fetch barrier"
        else:
            what = "send barrier" if request.barrier else _send_label(request.vars)

        def body() -> bytes:
            names = self._limits.fetch_names(request.fetch, request.trainer_id, "SendFetchBatch")
            fetches = bool(names or request.fetch_barrier)
            # A call that will wait for the round's optimize runs it itself when its barrier is the last.
            if self._store_batch(request, context, optimize_here=fetches, method="SendFetchBatch"):
                self._optimize_round()
            if not fetches:  # nothing to fetch: no waiting for the optimize
                return encode_batch([])
            return self._fetch_reply(request.trainer_id, names, request.fetch_barrier, context, "SendFetchBatch")

        return self._handle(context, "SendFetchBatch", request.trainer_id, what, body)

    def _rpc_FetchBatch(self, request: Any, context: Any) -> bytes:  # noqa: N802
        what = "fetch barrier" if request.barrier else _get_label(request.varnames)

        def body() -> bytes:
            names = self._limits.fetch_names(request.varnames, request.trainer_id, "FetchBatch")
            return self._fetch_reply(request.trainer_id, names, request.barrier, context, "FetchBatch")

        return self._handle(context, "FetchBatch", request.trainer_id, what, body)

    # ------------------------------------------------------------ the bulk channel (ops.rpc.bulk)
    def _largest_var(self) -> int:
        """The most bytes one dense var the pserver receives takes (what `PSTRANSPILE_BULK=auto`
        reads: a grad, and so the param block fetched for it; a SelectedRows grad carries a
        batch's rows, not its declared height's)."""
        config = self.config
        received = set(config.received) | set(config.grad_to_block)
        return max((declared_bytes(*config.templates[name], False) or 0
                    for name in received if name in config.templates and name not in config.sparse_vars), default=0)

    def _rpc_BulkChannel(self, request: Any, context: Any) -> bytes:  # noqa: N802
        """The bulk channel's port and secret (b"": none here), to a caller that passed the
        token check and the handshake (`ops.rpc.auth.Gate`). Not an RPC of the protocol."""
        listener = self._bulk
        return listener.announce() if listener is not None else b""

    def _bulk_call(self, conn: bulk.Connection, head: bulk.RequestHead) -> None:
        """One `SendBatch`, `SendFetchBatch` or `FetchBatch` off the bulk channel, through
        the paths gRPC's take (`_handle`, `_store_batch`, `_on_fetch`): everything in the
        header is checked before the payload is read (`_bulk_check`), the reply is sent
        from the pserver's arrays (sync: as a reader, so no optimize changes them mid-send)."""
        method, tid = head.method, head.trainer_id
        if method == "FetchBatch":
            what = "fetch barrier" if head.fetch_barrier else _get_label(head.fetch)
        elif head.fetch_barrier:
            what = "fetch barrier"
        else:
            what = "send barrier" if head.barrier else _send_label(head.vars)  # type: ignore[arg-type]
        reply = partial(self._bulk_reply, conn)

        def body() -> None:
            names = self._limits.fetch_names(head.fetch, tid, method) if method != "SendBatch" else ()
            batch, summed = self._bulk_receive(conn, head)
            if method == "FetchBatch":
                self._on_fetch(tid, names, head.fetch_barrier, conn, reply, method)
                return
            fetches = method == "SendFetchBatch" and bool(names or head.fetch_barrier)
            if self._store_batch(batch, conn, optimize_here=fetches, method=method, summed=summed):
                self._optimize_round()
            if fetches:
                self._on_fetch(tid, names, head.fetch_barrier, conn, reply, method)
            else:
                reply([])

        self._handle(conn, method, tid, what, body)

    @staticmethod
    def _bulk_reply(conn: bulk.Connection, values: list[tuple[str, Any]]) -> None:
        conn.send_reply(values)

    def _bulk_check(self, head: bulk.RequestHead) -> None:
        """Refuse a bulk request from its header alone, before its payload is read: the
        method's fields, the size limit (`max_message`), each var at most once (sync), and
        each var against the program (`Expected`: a dense var's name, trainer, dtype and
        shape with a stand-in of no memory; a message's name; the whole value again once
        received, in `_store_batch`)."""
        tid, method = head.trainer_id, head.method
        who = f"pserver {self.config.endpoint}: trainer {tid}'s {method}"
        if (method == "FetchBatch" and (head.vars or head.barrier)) or (
                method == "SendBatch" and (head.fetch or head.fetch_barrier)):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{who} carries fields a {method} has not")
        limit = self._bulk_limit
        if limit > 0 and head.payload_bytes > limit:
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"{who}: a request of {head.payload_bytes} bytes; the limit is {limit}")
        expected = self._expected
        for var in head.vars:
            if var.dtype is not None:
                try:
                    expected.check_var(WireVar(var.name, LoDTensor(_stand_in(var)), trainer_id=tid, merge_add=var.merge_add), tid)
                except Refused as exc:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            elif not expected.open and var.name not in expected.received and not (
                    var.merge_add and var.name in expected.counters):
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"pserver {self.config.endpoint}: trainer {tid}'s send of {var.name[:200]!r}: "
                             "the pserver does not receive that var")
        if self.config.sync_mode and len(head.vars) > 1:
            self._limits.check_sends((var.name for var in head.vars), tid, method)

    def _bulk_receive(self, conn: bulk.Connection, head: bulk.RequestHead) -> tuple[WireBatch, frozenset[str]]:
        """Check the header, say GO, and receive the payload: a sync pserver adds a var it
        sums on arrival into that sum (`_receive_summed`: the second of the pair returned
        names them) and receives another dense var into the buffer it keeps for (trainer,
        var), reused every step (see `_bulk_buffer`); an async one into a new array."""
        self._bulk_check(head)
        tid, sync = head.trainer_id, self.config.sync_mode
        planned = [var for var in head.vars if var.dtype is not None and var.name in self._sums] if sync else []
        for var in planned:  # everything a payload could be refused for, before any is summed
            try:
                LoDTensor(_stand_in(var), [list(level) for level in var.lod])
            except ValueError as exc:
                raise bulk.FrameError(f"var {var.name!r}: {exc}") from None
        modes: dict[str, str] = {}
        if head.payload_bytes:
            if sync:
                with self._cond:  # a reused buffer is written only once the round that read it is over
                    if planned:  # a sum is written only in its round's SEND phase (`_store_batch` waits for it anyway)
                        self._wait_phase(Phase.SEND, conn)
                        self._check_unclaimed([var.name for var in planned], tid)
                        for var in planned:
                            arrivals = self._sums[var.name]
                            with arrivals.cond:
                                modes[var.name] = arrivals.claim(arrivals.position[var.name], may_wait=True)
                    else:
                        self._wait_not_optimizing(conn)
            try:
                conn.go()
            except BaseException as exc:
                for name in modes:
                    self._tear(tid, name, 0, exc)
                raise
        found: list[WireVar] = []
        taken: list[tuple[tuple[int, str], np.ndarray]] = []
        held: list[bulk.MemoryExtents] = []  # the persistables' memory, found once a request (`_aliased`)
        pending = dict(modes)
        try:
            for var in head.vars:
                if var.dtype is None:
                    found.append(bulk.receive_value(conn.sock, var, ring=conn.reader))
                    continue
                if var.name in pending:
                    self._receive_summed(conn, tid, var, pending.pop(var.name))
                    found.append(WireVar(var.name, LoDTensor(_stand_in(var)), trainer_id=tid, merge_add=var.merge_add))
                    continue
                into = self._bulk_buffer(tid, var, taken, held) if sync and var.nbytes else None
                value = bulk.receive_value(conn.sock, var, into, ring=conn.reader)  # a read-only view, as gRPC's
                found.append(WireVar(var.name, value, trainer_id=tid, merge_add=var.merge_add))
        except BaseException as exc:
            for name in pending:  # claimed, not reached: its sum waits for it in vain
                self._tear(tid, name, 0, exc)
            raise
        finally:
            with self._bulk_lock:
                self._bulk_buffers.update(taken)
        return WireBatch(tid, head.barrier, tuple(found)), frozenset(modes)

    def _receive_summed(self, conn: bulk.Connection, tid: int, var: bulk.VarHead, mode: str) -> None:
        """Receive trainer `tid`'s `var` into its grad's sum (`ops.rpc.arrival_sum`): the
        first of x0 and x1 straight into the accumulator, an input in its turn chunk by
        chunk (each chunk added once the inputs before it wrote it), an early one into the
        buffer kept for it. A break on the way fails the round (`_tear`)."""
        arrivals = self._sums[var.name]
        k, acc, size, chunk = arrivals.position[var.name], arrivals.flat(), arrivals.size, arrivals.chunk
        what = f"var {var.name!r}"
        done, itemsize = 0, arrivals.plan.dtype.itemsize
        with arrivals.cond:
            arrivals.streamed += 1
        try:
            if conn.ring_carries(var):  # through the shared-memory ring: slot by slot, no chunk buffer
                progress = [0]
                try:
                    self._sum_from_ring(conn.reader, arrivals, k, mode, what, progress)
                finally:
                    done = progress[0]
            elif mode == BASE:
                while done < size:
                    end = min(size, done + chunk)
                    bulk.recv_into(conn.sock, acc[done:end], what)
                    with arrivals.cond:
                        arrivals.advance(k, end)
                    done = end
            elif mode == HOLD:
                with arrivals.cond:
                    into = arrivals.buffer(k)
                bulk.recv_into(conn.sock, into, what)
                done = size
            else:
                nbytes = min(chunk, size) * arrivals.plan.dtype.itemsize  # a grad under a chunk: its size
                buffer = self._chunk_buffer(nbytes)
                scratch = buffer[:nbytes].view(arrivals.plan.dtype)
                try:
                    while done < size:
                        end = min(size, done + chunk)
                        part = scratch[:end - done]
                        bulk.recv_into(conn.sock, part, what)
                        with arrivals.cond:  # every input before this one wrote [.., end): none writes it now
                            arrivals.wait_turn(k, end, self._sum_failure, self.config.timeout)
                        np.add(acc[done:end], part, out=acc[done:end])
                        with arrivals.cond:
                            arrivals.advance(k, end)
                        done = end
                finally:
                    with self._bulk_lock:
                        self._chunk_buffers.append(buffer)
            with arrivals.cond:
                arrivals.finish(k, mode, [list(level) for level in var.lod] or None)
        except BaseException as exc:
            self._tear(tid, var.name, done * itemsize, exc)
            raise

    def _sum_from_ring(self, reader: bulk.RingReader, arrivals: Arrivals, k: int, mode: str, what: str,
                       progress: list[int]) -> None:
        """`_receive_summed` through the connection's shared-memory ring, a slot at a time:
        BASE copies a slot into the accumulator, HOLD into the kept buffer, ADD adds it
        from the slot once the inputs before it wrote those elements. `progress[0]`: the
        elements in the sum so far (for `_tear`; a held arrival counts once whole)."""
        dtype, acc = arrivals.plan.dtype, arrivals.flat()
        if mode == HOLD:
            with arrivals.cond:
                acc = arrivals.buffer(k)
        done = 0
        for data in reader.chunks(arrivals.size * dtype.itemsize, what):
            end = done + len(data) // dtype.itemsize
            part = data.view(dtype)
            if mode == ADD:
                with arrivals.cond:  # every input before this one wrote [.., end): none writes it now
                    arrivals.wait_turn(k, end, self._sum_failure, self.config.timeout)
                np.add(acc[done:end], part, out=acc[done:end])
            else:
                acc[done:end] = part
            if mode != HOLD:
                with arrivals.cond:
                    arrivals.advance(k, end)
                progress[0] = end
            done = end
        progress[0] = done

    def _sum_failure(self) -> str | None:
        """Why an add on arrival waiting for its turn should give up: the pserver failed or
        is shutting down (`Arrivals.wait_turn`), else None."""
        return self._failure or (f"pserver {self.config.endpoint} is shutting down" if self._stopping else None)

    def _tear(self, tid: int, name: str, got: int, exc: BaseException) -> None:
        """Trainer `tid`'s `name` broke off after `got` bytes while its grad's sum waited for
        it: the round cannot run on that sum; the pserver fails with one error naming both."""
        arrivals = self._sums[name]
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        with arrivals.cond:
            message = arrivals.torn or (f"step {self._round + 1}: trainer {tid}'s send of {name} broke off with {got} "
                                        f"of its {arrivals.nbytes} bytes in the sum of {arrivals.plan.out} (summed on "
                                        f"arrival); the round cannot run on a partial sum ({reason})")
            arrivals.tear(arrivals.position[name], message)
        self._set_failure(f"pserver {self.config.endpoint}: {message}")

    def lend_chunk_buffer(self, nbytes: int) -> np.ndarray | None:
        """An idle chunk buffer of at least `nbytes` for a kernel of a sync round's optimize
        blocks to compute a temporary in (`RunContext.lend_scratch`: sgd's `lr * Grad`
        piece), or None. Only to the thread running those blocks, while it runs them: the
        round's adds are over and the next round's have not begun, so no add takes the
        buffer meanwhile (issue 30: the piece's 512 kB off the pserver's peak)."""
        if self._lending_to != threading.get_ident():
            return None  # a block run elsewhere (a prefetch, a checkpoint's save) or between rounds
        with self._bulk_lock:
            return next((found for found in self._chunk_buffers if found.nbytes >= nbytes), None)

    def _chunk_buffer(self, nbytes: int) -> np.ndarray:
        """A chunk buffer of at least `nbytes` for one add on arrival, the caller's until it
        gives it back to `_chunk_buffers`: the pserver keeps as many as adds ran at once
        (one, with 2 trainers and one big grad), not one per connection (issue 30: a chunk a
        trainer on a pserver's peak)."""
        with self._bulk_lock:
            for i, found in enumerate(self._chunk_buffers):
                if found.nbytes >= nbytes:
                    return self._chunk_buffers.pop(i)
            self.chunk_buffers_made += 1
        return np.empty(nbytes, np.uint8)

    def _bulk_buffer(self, tid: int, var: bulk.VarHead, taken: list[tuple[tuple[int, str], np.ndarray]],
                     held: list[bulk.MemoryExtents]) -> np.ndarray:
        """The buffer to receive trainer `tid`'s `var` into (sync). The one kept for them is
        reused unless the value it holds may still be read: the current round stored it
        already (a second send of the var this round gets a new buffer, so a failed one
        leaves the first intact), a persistable var shares its memory, or another call
        holds it. What it held was read by the round's optimize, which ended before this
        call passed `_wait_not_optimizing`."""
        key = (tid, var.name)
        with self._bulk_lock:
            buffer = self._bulk_buffers.pop(key, None)
        with self._cond:
            stored = self._phase is Phase.SEND and var.name in self._received
        if (buffer is None or stored or buffer.shape != var.shape or buffer.dtype != var.dtype
                or self._aliased(buffer, held)):
            buffer = np.empty(var.shape, var.dtype)
        taken.append((key, buffer))
        return buffer

    def _aliased(self, buffer: np.ndarray, held: list[bulk.MemoryExtents]) -> bool:
        """Whether a persistable var's array may share `buffer`'s memory (a kernel that
        kept a view of a received grad): that buffer is not written again. The
        persistables' memory is gathered once per request (into `held`), not once per var:
        a pserver of a big model receives hundreds of vars and holds hundreds of
        persistables."""
        if not held:
            held.append(self._persistable_memory())
        return held[0].overlaps(buffer)

    def _persistable_memory(self, leave_out: Iterable[str] = ()) -> bulk.MemoryExtents:
        """The memory the pserver's persistable dense vars hold (but `leave_out`'s)."""
        skip = set(leave_out)
        values = (self.scope.find_var(name) for name in self.config.persistables if name not in skip)
        return bulk.MemoryExtents(value.array for value in values if isinstance(value, LoDTensor))

    def _rpc_GetVariable(self, request: WireVar, context: Any) -> bytes:  # noqa: N802
        def body() -> bytes:
            names = self._limits.fetch_names((request.name,), request.trainer_id, "GetVariable")
            return self._on_fetch(request.trainer_id, names, False, context,
                                  lambda values: encode_var(*values[0]), "GetVariable")

        return self._handle(context, "GetVariable", request.trainer_id, f"get of {request.name}", body)

    def _rpc_FetchBarrier(self, request: Any, context: Any) -> rpc_pb2.VoidMessage:  # noqa: N802
        def body() -> rpc_pb2.VoidMessage:
            self._on_fetch(request.trainer_id, (), True, context, lambda values: None, "FetchBarrier")
            return rpc_pb2.VoidMessage()

        return self._handle(context, "FetchBarrier", request.trainer_id, "fetch barrier", body)

    def _fetch_reply(self, trainer_id: int, names: tuple[str, ...], barrier: bool, context: Any, method: str) -> bytes:
        """The `VarBatch` reply to a fetch of `names` (checked by `Limits.fetch_names`;
        with `barrier`, the fetch barrier is counted). Sync: built once per round for the
        same names, shared by the trainers."""
        return self._on_fetch(trainer_id, names, barrier, context, _encode_values, method,
                              share=self.config.sync_mode)

    def _on_fetch(self, trainer_id: int, names: tuple[str, ...], barrier: bool, context: Any,
                  encode: Callable[[list[tuple[str, Any]]], Any], method: str, *, share: bool = False) -> Any:
        """`encode` of the current values of `names` (sync: once the round's optimize ran);
        with `barrier`, the sender's fetch barrier is counted after them. Under the lock
        only the values are looked up (at most one lookup per var the pserver holds: the
        names were checked) and the reply sized (`Limits.reply_size`, refused past its
        limit); the encoding runs outside it. A sync pserver's optimize blocks may update a
        param in place (`RunContext.update_in_place`): they wait for every reader
        (`_readers`) first, and no reader starts outside the GET phase. With `share`, the
        reply is the one every trainer asking the same names this round gets."""
        sync = self.config.sync_mode
        with self._cond:
            if sync:
                self._wait_phase(Phase.GET, context)
            else:
                self._check_open()
            values = []
            for name in names:
                value = self.scope.find_var(name)
                if value is None:
                    raise _Abort(grpc.StatusCode.NOT_FOUND, f"pserver {self.config.endpoint} has no var {name!r}")
                values.append((name, value))
            size = self._limits.reply_size(values, trainer_id, method) if names else 0
            entry = self._shared_reply_locked(names, size) if share else None
            if sync:
                self._readers += 1
        arrived = False
        try:
            reply = entry.get(encode, values) if entry is not None else encode(values)
            arrived = barrier and sync
        finally:
            if sync:
                with self._cond:
                    self._readers -= 1
                    if not self._readers:
                        self._readers_idle.notify_all()
                    if arrived:
                        self._arrive_locked(trainer_id)
        return reply

    def _shared_reply_locked(self, names: tuple[str, ...], size: int) -> _SharedReply | None:
        """This round's shared reply for `names` (lock held); None when the round's shared
        replies already hold `Limits.reply_limit` bytes (the caller encodes its own)."""
        entry = self._replies.get(names)
        if entry is None:
            limit = self._limits.reply_limit
            if limit is not None and self._replies_bytes + size > limit:
                return None
            entry = self._replies[names] = _SharedReply()
            self._replies_bytes += size
        return entry

    def _rpc_PrefetchVariable(self, request: WireVar, context: Any) -> bytes:  # noqa: N802
        what = f"prefetch from {request.table_name}" if request.table_name else f"prefetch of {request.name}"
        return self._handle(context, "PrefetchVariable", request.trainer_id, what, lambda: self._on_prefetch(request, context))

    def _on_prefetch(self, request: WireVar, context: Any) -> bytes:
        if not isinstance(request.value, LoDTensor):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "a prefetch request carries its ids as a dense int64 tensor")
        with self._cond:
            if self.config.sync_mode:
                self._wait_not_optimizing(context)
            else:
                self._check_open()
        what = f"prefetch from {request.table_name or request.name}"
        if request.table_name:
            ids = request.value.array.reshape(-1).astype(np.int64, copy=False)
            rows = self._rows_of(request.table_name, ids, request.trainer_id)
        else:
            self._limits.check_prefetch(request.value.array.reshape(-1), None, 0, request.trainer_id, what)
            rows = self._run_prefetch_block(request.name, request.value)
        self._limits.check_reply(rows.nbytes, request.trainer_id, what)  # before encoding
        return encode_var(request.name, LoDTensor(rows))

    def _rows_of(self, name: str, ids: np.ndarray, trainer_id: int = 0) -> np.ndarray:
        """Rows `ids` of table `name`: an auto-grown table creates unseen ids' rows. At most
        the table's height of ids, and a reply under the limit (`Limits.check_prefetch`),
        before the table's lock is taken."""
        table = self.scope.find_var(name)
        if table is None:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"pserver {self.config.endpoint} has no table {name!r}")
        what = f"prefetch from {name}"
        if isinstance(table, SelectedRows):
            row_bytes = math.prod(table.row_shape) * np.dtype(table.dtype).itemsize
            self._limits.check_prefetch(ids, table.height, row_bytes, trainer_id, what)
        elif isinstance(table, LoDTensor) and table.array.ndim >= 1 and ids.size > max(table.array.shape[0], 1):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"pserver {self.config.endpoint}: trainer {trainer_id}'s {what} asks {ids.size} ids of a table "
                         f"of {table.array.shape[0]} rows (prefetch ids are unique)")
        if isinstance(table, SelectedRows):
            with table.lock:
                try:
                    slots = table.lookup_index(ids, grow=True)
                except ValueError as exc:  # the table is full
                    raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"pserver {self.config.endpoint}: {name}: {exc}") from None
                return table.value[slots]
        if not isinstance(table, LoDTensor) or table.array.ndim < 1:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"pserver {self.config.endpoint}: {name!r} is not a table")
        array = table.array
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= array.shape[0]):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            where = f"the {array.shape[0]} rows of {name} on pserver {self.config.endpoint}"
            raise _Abort(grpc.StatusCode.OUT_OF_RANGE, f"prefetch id {bad} is outside {where}")
        return array[ids]

    def _run_prefetch_block(self, name: str, ids: LoDTensor) -> np.ndarray:
        """Run the prefetch block keyed by `name` with `ids` bound to it, in a scope of its own."""
        target = self.config.prefetch_blocks.get(name)
        if target is None or self._run_in is None:
            raise _Abort(grpc.StatusCode.NOT_FOUND,
                         f"pserver {self.config.endpoint} has no prefetch block for {name!r}")
        block, out = target
        scope = self.scope.new_scope()
        scope.set_var(name, ids)
        scope.set_var(out, None)  # the block's output lands here, not in the shared scope
        try:
            self._run_in(block, scope)
        except Exception as exc:  # noqa: BLE001 - a bad request fails that request, not the pserver
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            where = f"pserver {self.config.endpoint}: prefetch block {block} for {name}"
            raise _Abort(grpc.StatusCode.INTERNAL, f"{where} failed: {reason}") from None
        value = scope.local_var(out)
        if not isinstance(value, LoDTensor):
            raise _Abort(grpc.StatusCode.INTERNAL,
                         f"pserver {self.config.endpoint}: prefetch block {block} wrote no {out!r}")
        return value.array

    def _rpc_Watch(self, request: Any, context: Any) -> rpc_pb2.VoidMessage:  # noqa: N802
        """Hold the trainer's open line until the pserver stops, the trainer completes or
        `seconds` pass. Not an RPC of the protocol: neither counted nor in flight. If it
        ends because the client went away while the trainer is active, the trainer is
        lost: `_check_liveness` fails the job unless it is back within `lost_grace`."""
        tid = request.trainer_id
        with self._cond:
            state = self._trainers.get(tid)
            if state is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"pserver {self.config.endpoint}: trainer id {tid} is out of range for Fanin {self.config.fanin}")
            if state.watches >= WATCHES_PER_TRAINER:  # each holds a server thread: a bounded number
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"pserver {self.config.endpoint}: trainer {tid} already holds {state.watches} Watch calls "
                              f"here (at most {WATCHES_PER_TRAINER}); refused")
            state.watches += 1
            state.lost_at = None
        until = time.monotonic() + max(0.0, min(request.seconds, WATCH_SECONDS_MAX))
        gone = over = False
        try:
            with self._cond:
                while not (self._stopping or self._failure or tid in self._completed):
                    if not context.is_active():
                        gone = True
                        break
                    if time.monotonic() >= until:
                        over = True
                        break
                    self._cond.wait(POLL)
        finally:
            with self._cond:
                state.watches -= 1
                if gone and not state.watches and tid not in self._completed:
                    state.lost_at = time.monotonic()
                    state.lost_step = self._where_now()
                    self._wake.set()
        if not over:  # the trainer is not to call again
            context.abort(grpc.StatusCode.UNAVAILABLE, f"pserver {self.config.endpoint} watches trainer {tid} no more")
        return rpc_pb2.VoidMessage()

    def _where_now(self) -> str:
        """Where the protocol is, for a message (lock held)."""
        if not self.config.sync_mode:
            return f"after {self._round} grad(s) applied"
        return f"at step {self._round + (0 if self._phase is Phase.GET else 1)}"

    def _rpc_SendComplete(self, request: Any, context: Any) -> rpc_pb2.VoidMessage:  # noqa: N802
        return self._handle(context, "SendComplete", request.trainer_id, "complete notice", lambda: self._on_complete(request))

    def _on_complete(self, request: Any) -> rpc_pb2.VoidMessage:
        """A trainer leaves: barriers stop waiting for it (which may end a phase), and
        once every trainer has, `serve()` returns."""
        tid = request.trainer_id
        if request.failed:
            reason = request.reason[:REASON_CHARS] + (" ..." if len(request.reason) > REASON_CHARS else "")
            self._set_failure(f"pserver {self.config.endpoint}: trainer {tid} failed: {reason or 'no reason given'}")
        with self._cond:
            self._completed.add(tid)
            self._notify_all_locked()
            if self.config.sync_mode:
                self._advance_locked()
            if len(self._completed) == self.config.fanin:
                self._wake.set()
        return rpc_pb2.VoidMessage()

    def _rpc_CheckpointNotify(self, request: Any, context: Any) -> rpc_pb2.VoidMessage:  # noqa: N802
        return self._handle(context, "CheckpointNotify", request.trainer_id, "checkpoint notice", lambda: self._on_checkpoint(request, context))

    def _on_checkpoint(self, request: Any, context: Any) -> rpc_pb2.VoidMessage:
        checkpointer = self.config.checkpointer
        if checkpointer is None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"pserver {self.config.endpoint} was started without a checkpoint dir: it saves nothing")
        with self._cond:
            if self.config.sync_mode:
                self._wait_not_optimizing(context)
            else:
                self._check_open()
        try:
            if request.lookup_table and self.config.checkpoint_block >= 0:
                path = self._table_path(checkpointer.root, request)
                self._run_checkpoint_block(str(path))
                self._keep_table_saves(checkpointer, path)
            else:
                with self._checkpoint_lock, self._quiesced():
                    with self._cond:
                        done = self._round
                    mode = "sync" if self.config.sync_mode else "async"
                    checkpointer.save(self.scope, request.dir, info={"mode": mode, "updates": done})
        except CheckpointPathError as exc:
            code = grpc.StatusCode.PERMISSION_DENIED if exc.escapes else grpc.StatusCode.INVALID_ARGUMENT
            raise _Abort(code, f"pserver {self.config.endpoint}: {exc}") from None
        except (CheckpointError, OSError) as exc:
            raise _Abort(grpc.StatusCode.INTERNAL, f"pserver {self.config.endpoint}: checkpoint {request.dir}: {exc}") from None
        return rpc_pb2.VoidMessage()

    def _table_path(self, root: Path, request: Any) -> Path:
        """Where a lookup-table notice's checkpoint block saves: Paddle's `DIR/<table>_<i>`
        of a table of the program, confined to the checkpoint dir, never inside this
        pserver's own `ckpt-<step>` checkpoints, and not a directory (`_Abort` otherwise:
        the sender's name, not the pserver's fault)."""
        table, name = request.lookup_table, request.dir
        known = self.config.known_vars
        if (known is not None and table not in known) or not re.fullmatch(rf"{re.escape(table)}_\d{{1,9}}", name.rsplit("/", 1)[-1]):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"pserver {self.config.endpoint}: a lookup-table checkpoint of {table[:60]!r} is saved at "
                         f"DIR/<table>_<pserver>, a table of the program; not {name[:60]!r}")
        if step_of(name.split("/", 1)[0]) is not None:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"pserver {self.config.endpoint}: {name[:60]!r} is inside a checkpoint (ckpt-<step>) of this pserver")
        path = confine(root, name)
        if path.is_dir() or any(parent.exists() and not parent.is_dir() for parent in path.parents):
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"pserver {self.config.endpoint}: {name[:60]!r} is a directory, or under a file, here")
        return path

    def _keep_table_saves(self, checkpointer: Checkpointer, path: Path) -> None:
        """Keep the `keep` lookup-table checkpoints this process saved last: an older
        path's shard (and the folders it left empty, inside the checkpoint dir) is
        removed, so notices at new paths cannot fill the disk."""
        with self._checkpoint_lock:
            if path in self._table_saves:
                self._table_saves.remove(path)
            self._table_saves.append(path)
            old, self._table_saves = self._table_saves[: -checkpointer.keep], self._table_saves[-checkpointer.keep:]
        import shutil  # here: a pserver that never saves a table need not load it

        root = Path(os.path.realpath(checkpointer.root))
        for stale in old:
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() and not stale.is_symlink() else stale.unlink(missing_ok=True)
            for parent in stale.parents:
                if parent == root or root not in parent.parents:
                    break
                try:
                    parent.rmdir()
                except OSError:
                    break

    @contextmanager
    def _quiesced(self) -> Iterator[None]:
        """Async mode: hold the lr-decay lock and every optimize block's lock (in block
        order), so a checkpoint reads this pserver's state between whole updates: no
        param saved with half its optimizer step. Sync mode saves between rounds already."""
        with ExitStack() as stack:
            if not self.config.sync_mode:
                stack.enter_context(self._lr_lock)
                for idx in sorted(self._block_locks):
                    stack.enter_context(self._block_locks[idx])
            yield

    def _run_checkpoint_block(self, path: str) -> None:
        """Paddle's RequestCheckpointHandler: bind the path, run the checkpoint block. A
        failed save fails the notice, not the pserver."""
        idx = self.config.checkpoint_block
        with self._checkpoint_lock:
            self.scope.set_var(self.config.checkpoint_path_var, path)
            try:
                self._run_block(idx)
            except Exception as exc:  # noqa: BLE001
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                where = f"pserver {self.config.endpoint}: checkpoint block {idx} ({path})"
                raise _Abort(grpc.StatusCode.INTERNAL, f"{where} failed: {reason}") from None


def _stand_in(var: bulk.VarHead) -> np.ndarray:
    """An array of `var`'s dtype and shape that takes no memory: what `Expected` checks of a
    var before (or instead of) its payload."""
    return np.broadcast_to(np.zeros((), var.dtype), var.shape)


class _SharedReply:
    """One reply several trainers' fetches share in a round: the first encodes it (outside
    the pserver's lock, under this one's), the others wait for it here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: Any = None

    def get(self, encode: Callable[[list[tuple[str, Any]]], Any], values: list[tuple[str, Any]]) -> Any:
        with self._lock:
            if self._data is None:
                self._data = encode(values)
            return self._data


def _encode_values(values: list[tuple[str, Any]]) -> bytes:
    """A `VarBatch` of `(name, value)` pairs: a fetch's reply."""
    return encode_batch([var_parts(name, value) for name, value in values])


def _send_label(vars: tuple[WireVar, ...]) -> str:
    """How a send shows in a timeout's "last request" (its first var names it)."""
    more = f" (+{len(vars) - 1} more)" if len(vars) > 1 else ""
    return f"send of {vars[0].name}{more}" if vars else "empty send"


def _get_label(names: Any) -> str:
    more = f" (+{len(names) - 1} more)" if len(names) > 1 else ""
    return f"get of {names[0]}{more}" if names else "empty get"


def print_log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


__all__ = ["POLL", "PServer", "Phase", "ServeConfig", "print_log"]
