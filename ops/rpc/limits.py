"""Bounded work per request: what one RPC may make a pserver do, derived from its program.

A trainer holding the job token can still send anything the protocol's messages can
carry (a bug, or a compromised trainer). Nothing it sends may hold the pserver's lock, or
its memory, for time or bytes proportional to a number it chose: the limits here are
computed once from the pserver program (`listen_and_serv`'s declared vars, their shapes
and dtypes) and checked before the request touches any state (see docs/request-limits.md
for every method and what bounds it).

* **Request size, before decoding.** The small protobuf requests (`FetchRequest`, a
  barrier, a complete notice, a checkpoint notice, a watch, a get's `VariableMessage`)
  have a byte limit of their own (`request_limits`): a `FetchRequest` may name every var
  the pserver holds once, the others are a name or a flag, but a `CheckpointCommit`'s or
  `CheckpointRestore`'s job manifest (`manifest_limit`: 4 MB + 32 bytes per byte of the
  plan, which it holds with an entry per var the plan's params are cut into). A bigger one is refused
  `RESOURCE_EXHAUSTED` from its length, unparsed (`guard_decoder`). The vars a trainer
  sends are bounded by `ops.rpc.validate.max_message` (gRPC refuses them from the length
  prefix).
* **Fetches** (`FetchBatch`, `SendFetchBatch`'s `fetch`, `GetVariable`): a fetch names
  each var at most once and at most as many vars as the pserver holds, every one of them
  a var of the program (`fetch_names`, outside the lock); `INVALID_ARGUMENT` or
  `NOT_FOUND` otherwise. Its reply is sized from the values before encoding and refused
  (`RESOURCE_EXHAUSTED`) past `reply_limit`: every var the pserver holds, once, at its
  declared size, plus `SLACK_PER_VAR` each, and never below `REPLY_FLOOR` (vars whose
  shape the program leaves open).
* **Sync sends** name each var at most once per batch (`check_sends`): the vars are
  stored under the lock, so their count must be the program's, not the sender's.
* **Prefetches** ask at most a table's height of ids (our trainers send unique ids; so
  does Paddle) and their reply is under `reply_limit` too.

`Limited` carries the gRPC status to answer with; the message names the pserver, the
trainer, the method and the limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from ops.rpc.validate import MESSAGE_FLOOR
from ops.tensor import LoDTensor, SelectedRows

REPLY_FLOOR = 16 << 20  # bytes: no reply under this is refused for its size
SLACK_PER_VAR = 4096  # bytes of header, name and alignment per var of a reply
REASON_CHARS = 1000  # a failed trainer's reason is kept (and repeated to every caller) up to this
NAME_OVERHEAD = 8  # bytes of a FetchRequest per name beyond its UTF-8 (key, length varint)
SMALL_REQUEST = 1024  # bytes: a barrier, a watch
NAMED_REQUEST = 64 * 1024  # bytes: a get's VariableMessage (a name), a checkpoint notice (a dir name)
COMPLETE_REQUEST = 64 * 1024  # bytes: a complete notice (its reason)
MANIFEST_FLOOR = 4 << 20  # bytes: a job manifest sent (CheckpointCommit, CheckpointRestore) under this is never refused
MANIFEST_PER_PLAN_BYTE = 32  # ... nor one under this many bytes per byte of the plan (it holds the plan, and an entry per var it cuts)
ASYNC_REPEATS = 16  # times an async batch may carry one var (a trainer's sends queued over steps)


class Limited(Exception):
    """A request past a limit: answer it with `code` and `details`."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass(frozen=True)
class Oversized:
    """What a guarded decoder returns, instead of parsing, for a request over its limit."""

    method: str
    size: int
    limit: int


@dataclass(frozen=True)
class Malformed:
    """What a guarded decoder returns for bytes that are not the method's message (the
    handler answers INVALID_ARGUMENT with `reason`, where gRPC would say INTERNAL)."""

    method: str
    reason: str


def declared_bytes(shape: Sequence[int] | None, dtype: Any, sparse: bool) -> int | None:
    """The most bytes a value of a var of `shape` and `dtype` takes (a SelectedRows: its
    height's rows and their ids); None when the program leaves it open."""
    if shape is None or dtype is None or any(int(d) < 0 for d in shape):
        return None
    size = math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize
    return size + (int(shape[0]) * 8 if sparse and len(shape) else 0)


def value_bytes(value: Any) -> int | None:
    """The bytes `value`'s data takes in a reply (None: not a tensor, it cannot travel)."""
    if isinstance(value, LoDTensor):
        return value.array.nbytes
    if isinstance(value, SelectedRows):
        rows = int(np.asarray(value.rows).size)
        return rows * 8 + rows * math.prod(value.row_shape) * np.dtype(value.dtype).itemsize
    if isinstance(value, np.ndarray):
        return value.nbytes
    return None


class Limits:
    """One pserver's limits, from its `ServeConfig` (a config without `known_vars`, a
    hand-built one in tests, bounds a fetch by the vars its scope holds instead)."""

    def __init__(self, config: Any) -> None:
        self.endpoint = config.endpoint
        known = config.known_vars
        self.fetchable: frozenset[str] | None = frozenset(known) if known is not None else None
        templates: Mapping[str, tuple[tuple[int, ...], Any]] = config.templates
        sparse = config.sparse_vars
        self.receivable = len({*config.received, *config.grad_to_block, *(known or ())})  # names a send may carry
        self.heights: dict[str, int] = {}  # table (SelectedRows var) -> its declared height
        if self.fetchable is None:
            self.reply_limit: int | None = None
            self.fetch_request_limit: int | None = None
        else:
            total = 0
            for name in sorted(self.fetchable):
                shape, dtype = templates.get(name, (None, None))
                total += (declared_bytes(shape, dtype, name in sparse) or 0) + SLACK_PER_VAR
            self.reply_limit = max(REPLY_FLOOR, total)
            self.fetch_request_limit = SMALL_REQUEST + sum(len(n.encode()) + NAME_OVERHEAD for n in self.fetchable)
        for name in sparse:
            shape, _ = templates.get(name, (None, None))
            if shape and int(shape[0]) >= 0:
                self.heights[name] = int(shape[0])
        self.largest_height = max(self.heights.values(), default=None)
        holder = getattr(config, "checkpointer", None) or getattr(config, "restorer", None)
        plan_text = getattr(holder, "plan_text", None)
        # a job manifest: the plan, and an entry (a few hundred bytes) per var the plan's params are cut into
        self.manifest_limit = MANIFEST_FLOOR + MANIFEST_PER_PLAN_BYTE * len(plan_text.encode()) if plan_text else NAMED_REQUEST

    # -------------------------------------------------------- before decoding
    def request_limits(self) -> dict[str, int]:
        """Method -> the most bytes its request may take, for the requests protobuf parses
        whole (and a get's). Methods not listed: `max_message`."""
        limits = {
            "SendBarrier": SMALL_REQUEST,
            "FetchBarrier": SMALL_REQUEST,
            "Watch": SMALL_REQUEST,
            "SendComplete": COMPLETE_REQUEST,
            "CheckpointNotify": NAMED_REQUEST,
            "CheckpointPart": NAMED_REQUEST,
            "CheckpointList": SMALL_REQUEST,
            "CheckpointCommit": self.manifest_limit,
            "CheckpointRestore": self.manifest_limit,
            "GetVariable": NAMED_REQUEST,
        }
        if self.fetch_request_limit is not None:
            limits["FetchBatch"] = self.fetch_request_limit
        else:
            limits["FetchBatch"] = MESSAGE_FLOOR
        return limits

    def batch_fields(self, sync_mode: bool) -> int | None:
        """The most top-level fields a received `VarBatch` may have (None: no program to
        say): each var the pserver receives (async: up to `ASYNC_REPEATS` times, sends
        queued over several steps) with its pad, and each var it holds to fetch, once."""
        if self.fetchable is None:
            return None
        repeats = 1 if sync_mode else ASYNC_REPEATS
        return 16 + 2 * repeats * self.receivable + len(self.fetchable)

    # -------------------------------------------------------- fetches
    def fetch_names(self, names: Sequence[str], trainer_id: int, method: str) -> tuple[str, ...]:
        """`names` as a tuple once each is known to name a var the pserver may answer, at
        most once; `Limited` otherwise. Runs outside the lock (its cost is the request's
        size, which gRPC bounded)."""
        count = len(names)
        who = f"pserver {self.endpoint}: trainer {trainer_id}'s {method}"
        if self.fetchable is not None and count > len(self.fetchable):
            raise Limited(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{who} names {count} vars; the pserver holds {len(self.fetchable)} (each may be named once)")
        names = tuple(names)
        if count > 1 and len(set(names)) != count:
            seen: set[str] = set()
            twice = next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]
            raise Limited(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{who} names {twice!r} more than once (a fetch names each var at most once)")
        if self.fetchable is not None:
            for name in names:
                if name not in self.fetchable:
                    raise Limited(grpc.StatusCode.NOT_FOUND, f"pserver {self.endpoint} has no var {name!r}")
        return names

    def reply_size(self, values: Iterable[tuple[str, Any]], trainer_id: int, method: str) -> int:
        """The bytes a reply of `values` will take, checked against `reply_limit` before
        anything is encoded; `Limited` past it, or for a value that is not a tensor."""
        total = 0
        for name, value in values:
            size = value_bytes(value)
            if size is None:
                raise Limited(grpc.StatusCode.INVALID_ARGUMENT,
                              f"pserver {self.endpoint}: {name!r} is a {type(value).__name__}, not a tensor: it cannot be fetched")
            total += size + SLACK_PER_VAR
        self.check_reply(total, trainer_id, method)
        return total

    def check_reply(self, size: int, trainer_id: int, method: str) -> None:
        if self.reply_limit is not None and size > self.reply_limit:
            raise Limited(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"pserver {self.endpoint}: trainer {trainer_id}'s {method} would take a {size} byte reply; "
                          f"the limit is {self.reply_limit} (every var this pserver holds, once)")

    # -------------------------------------------------------- sends, prefetches
    def check_sends(self, names: Iterable[str], trainer_id: int, method: str) -> None:
        """A sync batch names each var at most once (its vars are stored under the lock)."""
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise Limited(grpc.StatusCode.INVALID_ARGUMENT,
                              f"pserver {self.endpoint}: trainer {trainer_id}'s {method} sends {name!r} more than once "
                              "(a sync step sends each var once)")
            seen.add(name)

    def check_prefetch(self, ids: np.ndarray, height: int | None, row_bytes: int, trainer_id: int, what: str) -> None:
        """A prefetch of `ids` from a table of `height` rows (None: not known here) whose
        rows take `row_bytes`: at most `height` ids, each in [0, height) (so an auto-grown
        table never holds more rows than the program's height), and a reply under
        `reply_limit`. A sharded table's ids are global: the bound is the larger of its
        height and the program's largest SelectedRows height (its grads')."""
        count = int(ids.size)
        if height is None and self.largest_height is None:  # no program says: the reply's size only
            self.check_reply(count * row_bytes + SLACK_PER_VAR, trainer_id, what)
            return
        bound = max(h for h in (height, self.largest_height, 1) if h is not None)
        if count > bound:
            raise Limited(grpc.StatusCode.INVALID_ARGUMENT,
                          f"pserver {self.endpoint}: trainer {trainer_id}'s {what} asks {count} ids of a table of "
                          f"{bound} rows (prefetch ids are unique)")
        if count:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= bound:
                raise Limited(grpc.StatusCode.OUT_OF_RANGE,
                              f"pserver {self.endpoint}: trainer {trainer_id}'s {what}: id {low if low < 0 else high} "
                              f"is outside [0, {bound})")
        self.check_reply(count * row_bytes + SLACK_PER_VAR, trainer_id, what)


def guard_decoder(method: str, limit: int | None, decode: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`decode`, but a request over `limit` bytes (None: no limit here) is not parsed,
    `Oversized` instead (the handler answers RESOURCE_EXHAUSTED), and bytes `decode`
    refuses are `Malformed` (INVALID_ARGUMENT)."""

    def guarded(data: bytes) -> Any:
        if limit is not None and len(data) > limit:
            return Oversized(method, len(data), limit)
        try:
            return decode(data)
        except Exception as exc:  # noqa: BLE001 - WireError, protobuf's DecodeError: the sender's bytes
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return Malformed(method, reason[:200])

    return guarded


__all__ = ["REASON_CHARS", "REPLY_FLOOR", "SLACK_PER_VAR", "Limited", "Limits", "Malformed", "Oversized", "declared_bytes",
           "guard_decoder", "value_bytes"]
