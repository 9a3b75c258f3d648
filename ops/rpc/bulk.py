"""The bulk channel: a TCP stream beside gRPC for the tensors of a step (issue 30).

gRPC Python copies a message into its own slice to send it and twice to receive it; with
MB-sized params that copying is most of a step's CPU. On this channel a trainer's
`SendBatch`, `SendFetchBatch` and `FetchBatch` travel as frames whose payloads go from the
arrays' own buffers to the socket (`sendall` of a memoryview, nothing joined) and from the
socket into the destination array (`recv_into`): the kernel's copies only.

One call on one connection (a connection carries one call at a time; a client keeps
its idle connections per pserver):

1. trainer → pserver: `PREFIX` (magic `PSB1`, the method, the header's length, at most
   `MAX_HEADER`) and the header, JSON: the channel's secret, the job token, the trainer
   id, the barrier flags, the names to fetch and one entry per var (its name, and for a
   dense tensor its Paddle data_type, dims, LoD and byte size; any other value, a
   SelectedRows, travels as its `VariableMessage` bytes of `ops.rpc.wire`, with its size);
2. the pserver checks all of it (the secret and the token with `hmac.compare_digest`, the
   trainer id, each var against the program, the sizes against `ops.rpc.limits` and
   `ops.rpc.validate`) BEFORE any payload is read, and answers `GO` (or the refusal, and
   closes the connection);
3. trainer → pserver: the payloads, in header order, no padding;
4. pserver → trainer: the reply (`PSR1`, a status, a header naming the fetched vars as
   above, then their payloads sent from the pserver's arrays), or the error (the gRPC
   status code's number and the pserver's reason).

The pserver dispatches a decoded call into the same paths as gRPC's (`PServer._bulk_call`):
phases, barriers, liveness, limits and validation are the same; only the transport
differs. The port and a random secret per pserver process are announced over gRPC
(`BulkChannel`, a method outside `proto/rpc.proto` behind the same token check and
handshake), so a frame without them is refused before its header is parsed further. With
TLS configured the channel is TLS with the same certificates (`ops.rpc.auth.Tls`).

`PSTRANSPILE_BULK=auto|on|off` (`bulk_choice`): `auto` (the default) opens the channel on
a pserver whose program has a var of `BULK_MIN` bytes or more (the measurement that chose
it is in docs/runtime.md); `on` always, `off` never. A trainer uses the channel wherever
its pserver offers one, unless its own setting is `off`.

Shared memory (`PSTRANSPILE_BULK_SHM=auto|on|off`, `shm_choice`; docs/runtime.md "Shared
memory"). On one host the kernel's two TCP copies are most of a payload's cost; a copy into
shared memory and the reader's own use of it (a sum, a copy into the param) cost less than
half (`benchmarks/shm_channel.py`). So a trainer's new connection to a pserver on a
loopback address (`auto`; `on`: any address, for a peer on the host's own) first asks for a
`Ring` (method 4, checked like every frame); the pserver makes one (`Ring.create`) and
names it in its answer; the trainer opens it (`Ring.attach`) or, failing, goes on over TCP.
A request then says (`"s"`) that it holds the ring, and in it and in its reply every var
of `RING_VAR_MIN` bytes or more crosses in the ring's slots (`RingWriter`, `RingReader`):
the writer fills a slot and sends a `NOTE` (slot, length) on the TCP stream, the reader
checks it (the slot due next, the exact length the header implies), uses the slot and
sends a `FREE` back; smaller vars stay in the TCP stream, in header order. Never with TLS.
"""

from __future__ import annotations

import atexit
import bisect
import hmac
import ipaddress
import itertools
import json
import math
import mmap
import os
import re
import secrets
import select
import socket
import ssl
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds  # numpy >= 2
except ImportError:  # numpy 1.26
    from numpy import byte_bounds

from ops.rpc.auth import Tls
from ops.rpc.env_choice import EnvChoiceError, env_choice
from ops.rpc.wire import (WireBatch, WireError, WireVar, _contiguous, _little_endian, _numpy_dtype, _paddle_dtype, _size,
                          decode_var, var_parts)
from ops.tensor import LoDTensor
from proto import rpc_pb2

BULK_ENV = "PSTRANSPILE_BULK"
PORT_ENV = "PSTRANSPILE_BULK_PORT"  # the channel's port: N, or +N past the gRPC port; unset: any free port
CHOICES = ("auto", "on", "off")
BULK_MIN = 256 << 10  # bytes: `auto` opens the channel for a program with a dense var this big
METHOD = "BulkChannel"  # the gRPC method announcing the channel (not in proto/rpc.proto)

REQUEST_MAGIC, REPLY_MAGIC = b"PSB1", b"PSR1"
PREFIX = struct.Struct("<4sBI")  # magic, method (request) or status (reply), header bytes
MAX_HEADER = 1 << 20  # bytes of one frame's header
METHODS = {1: "SendBatch", 2: "SendFetchBatch", 3: "FetchBatch", 4: "Ring"}  # Ring: a shared-memory ring, asked once
METHOD_CODE = {name: code for code, name in METHODS.items()}
STATUS_OK, STATUS_GO = 0, 255
_CODES = {code.value[0]: code for code in grpc.StatusCode}
OPEN_LIMIT = (2 << 30) - 1  # bytes of one request to a pserver without a program (protobuf's bound on gRPC)
SMALL_PIECE = 64 * 1024  # bytes: pieces under this are joined before a send (one syscall, not many)
CHECK_SECONDS = 1.0  # a trainer waiting on the channel checks this often that the pserver is still there
FIRST_FRAME_SECONDS = 10.0  # a new connection's first header must arrive within this
REFUSE_DRAIN_SECONDS = 1.0  # a pserver reads on after a refusal, until the trainer closes, at most this
PROBE_SECONDS = 10.0  # a trainer gives up on reaching a channel after this (gRPC carries everything then)


SHM_ENV = "PSTRANSPILE_BULK_SHM"
SHM_CHOICES = ("auto", "on", "off")
SHM_DIR = "/dev/shm"
RING_SLOTS = 2  # slots of a connection's ring: measured, docs/runtime.md "Shared memory"
SLOT_BYTES = 512 << 10
RING_VAR_MIN = 256 << 10  # bytes: a var this big crosses in the ring; a smaller one in the TCP stream, as before
NOTE = struct.Struct("<4sIQ")  # writer -> reader: slot i holds n bytes of the payload now
FREE = struct.Struct("<4sI")  # reader -> writer: slot i may be written again
NOTE_MAGIC, FREE_MAGIC = b"PSN1", b"PSF1"
_RING_NAME = re.compile(r"psb-[0-9a-f]{32}\Z")


class BulkChoiceError(EnvChoiceError):
    """`PSTRANSPILE_BULK` (or `PSTRANSPILE_BULK_SHM`) names no choice."""


class FrameError(Exception):
    """Bytes on the channel that are not a well-formed frame, or a connection that broke
    (`idle`: before the first byte of what was awaited: a peer that closed or stayed quiet)."""

    def __init__(self, message: str, *, idle: bool = False) -> None:
        super().__init__(message)
        self.idle = idle


def bulk_choice(environ: Mapping[str, str] | None = None) -> str:
    """`auto` (the default), `on` or `off`; `BulkChoiceError` for anything else."""
    return env_choice(environ, BULK_ENV, CHOICES, BulkChoiceError)


def shm_choice(environ: Mapping[str, str] | None = None) -> str:
    """`PSTRANSPILE_BULK_SHM`: `auto` (the default: a shared-memory ring with a peer on a
    loopback address), `on` (with any peer that can open it: same host), `off`."""
    return env_choice(environ, SHM_ENV, SHM_CHOICES, BulkChoiceError)


def loopback(host: str) -> bool:
    """Whether `host` names this host's loopback (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def bulk_port(grpc_port: int = 0, environ: Mapping[str, str] | None = None) -> int:
    """The port the channel listens on: `PSTRANSPILE_BULK_PORT` as `N` (that port) or `+N`
    (the pserver's gRPC port plus N: one setting for several pservers on one host), 0 (the
    OS picks a free port) when unset; `BulkChoiceError` for anything else. A firewall that
    lets only known ports through needs it; a trainer that cannot reach the channel falls
    back to gRPC with a warning."""
    import os

    environ = os.environ if environ is None else environ
    text = environ.get(PORT_ENV, "").strip()
    if not text:
        return 0
    offset = text.startswith("+")
    digits = text[1:] if offset else text
    if not digits.isdigit() or not 0 < int(digits) < 65536:
        raise BulkChoiceError(f"{PORT_ENV}={environ[PORT_ENV]!r}: expected a port (1-65535) or +N past the gRPC port")
    port = grpc_port + int(digits) if offset else int(digits)
    if offset and grpc_port and not 0 < port < 65536:
        raise BulkChoiceError(f"{PORT_ENV}={text}: gRPC port {grpc_port} + {digits} is past 65535")
    return port


def offers_bulk(largest_var: int, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a pserver whose program's largest var is `largest_var` bytes opens the channel."""
    choice = bulk_choice(environ)
    return choice == "on" or (choice == "auto" and largest_var >= BULK_MIN)


# ------------------------------------------------------------------ headers


@dataclass(frozen=True)
class VarHead:
    """One var of a frame: a dense tensor (`dtype`, `shape`, `lod`) or, when `dtype` is
    None, a `VariableMessage` of `nbytes`."""

    name: str
    nbytes: int
    dtype: np.dtype | None = None
    shape: tuple[int, ...] = ()
    lod: tuple[tuple[int, ...], ...] = ()
    merge_add: bool = False

    def encode(self) -> dict[str, Any]:
        if self.dtype is None:
            return {"n": self.name, "b": self.nbytes, "m": self.merge_add}
        return {"n": self.name, "b": self.nbytes, "m": self.merge_add, "d": _paddle_dtype(self.name, self.dtype),
                "s": list(self.shape), "l": [list(level) for level in self.lod]}


@dataclass(frozen=True)
class RequestHead:
    method: str
    secret: str
    token: str | None
    trainer_id: int
    barrier: bool
    fetch: tuple[str, ...]
    fetch_barrier: bool
    vars: tuple[VarHead, ...]
    ring: bool = False  # the payloads, both ways, travel through the connection's shared-memory ring

    @property
    def payload_bytes(self) -> int:
        return sum(v.nbytes for v in self.vars)


def _int(value: Any, what: str, low: int = 0, high: int = 1 << 62) -> int:
    if type(value) is not int or not low <= value <= high:
        raise FrameError(f"{what} is not an integer in [{low}, {high}]")
    return value


def _str(value: Any, what: str, limit: int = 4096) -> str:
    if type(value) is not str or len(value) > limit:
        raise FrameError(f"{what} is not a string of at most {limit} characters")
    return value


def _list(value: Any, what: str, limit: int) -> list[Any]:
    if type(value) is not list or len(value) > limit:
        raise FrameError(f"{what} is not a list of at most {limit} items")
    return value


def _var_head(raw: Any) -> VarHead:
    if type(raw) is not dict:
        raise FrameError("a var entry is not an object")
    name = _str(raw.get("n"), "a var's name")
    nbytes = _int(raw.get("b"), f"var {name[:60]!r}'s byte size")
    merge_add = raw.get("m", False)
    if type(merge_add) is not bool:
        raise FrameError(f"var {name[:60]!r}'s merge_add is not a boolean")
    if "d" not in raw:
        return VarHead(name, nbytes, merge_add=merge_add)
    try:
        dtype = _numpy_dtype(name, _int(raw["d"], f"var {name[:60]!r}'s data_type", 0, 1 << 16))
    except WireError as exc:
        raise FrameError(str(exc)) from None
    shape = tuple(_int(d, f"var {name[:60]!r}'s dims") for d in _list(raw.get("s"), f"var {name[:60]!r}'s dims", 64))
    lod = tuple(tuple(_int(x, f"var {name[:60]!r}'s LoD") for x in _list(level, f"var {name[:60]!r}'s LoD", 1 << 20))
                for level in _list(raw.get("l", []), f"var {name[:60]!r}'s LoD levels", 8))
    if math.prod(shape) * dtype.itemsize != nbytes:
        raise FrameError(f"var {name[:60]!r}: {nbytes} bytes for {dtype.name}{list(shape)}")
    return VarHead(name, nbytes, dtype, shape, lod, merge_add)


def decode_request_head(method_code: int, raw: bytes, max_vars: int = 1 << 16) -> RequestHead:
    """The header of a request frame; `FrameError` for anything malformed."""
    method = METHODS.get(method_code)
    if method is None:
        raise FrameError(f"unknown method {method_code}")
    try:
        head = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise FrameError("the header is not JSON") from None
    if type(head) is not dict:
        raise FrameError("the header is not an object")
    token = head.get("k")
    flags = [head.get(key, False) for key in ("a", "f", "s")]
    if any(type(flag) is not bool for flag in flags):
        raise FrameError("a barrier flag is not a boolean")
    fetch = tuple(_str(n, "a name to fetch") for n in _list(head.get("g", []), "the names to fetch", max_vars))
    return RequestHead(
        method=method,
        secret=_str(head.get("x"), "the channel secret", 128),
        token=None if token is None else _str(token, "the job token"),
        trainer_id=_int(head.get("t"), "the trainer id", 0, 1 << 20),
        barrier=flags[0],
        fetch=fetch,
        fetch_barrier=flags[1],
        vars=tuple(_var_head(v) for v in _list(head.get("v", []), "the vars", max_vars)),
        ring=flags[2],
    )


def _header_bytes(head: dict[str, Any]) -> bytes:
    raw = json.dumps(head, separators=(",", ":")).encode()
    if len(raw) > MAX_HEADER:
        raise FrameError(f"a header of {len(raw)} bytes (at most {MAX_HEADER})")
    return raw


# ------------------------------------------------------------------ values


Piece = Any  # bytes or a uint8 array / memoryview


def outgoing(name: str, value: Any, merge_add: bool = False, trainer_id: int = 0) -> tuple[VarHead, list[Piece]]:
    """The head and payload pieces of one var: a dense tensor's own buffer, else its
    `VariableMessage` pieces."""
    array: np.ndarray | None = None
    lod: Any = ()
    if isinstance(value, LoDTensor):
        array, lod = value.array, value.lod
    elif isinstance(value, np.ndarray):
        array = value
    if array is None:
        parts = var_parts(name, value, trainer_id=trainer_id, merge_add=merge_add)
        return VarHead(name, _size(parts), merge_add=merge_add), parts
    array = _little_endian(_contiguous(array))
    head = VarHead(name, array.nbytes, array.dtype, tuple(int(d) for d in array.shape),
                   tuple(tuple(int(x) for x in level) for level in lod), merge_add)
    return head, [array.reshape(-1).view(np.uint8)] if array.nbytes else []


def _view(piece: Piece) -> memoryview:
    return memoryview(piece).cast("B") if not isinstance(piece, bytes) else memoryview(piece)


Check = Callable[[], None]  # called when a slice of the socket's timeout passes: raises to give up


def _send(sock: socket.socket, data: Any, check: Check | None) -> None:
    if check is None:
        sock.sendall(data)
        return
    view, off = memoryview(data).cast("B"), 0
    while off < len(view):
        try:
            off += sock.send(view[off:])
        except TimeoutError:
            check()


def send_pieces(sock: socket.socket, pieces: Sequence[Piece], check: Check | None = None) -> int:
    """Send `pieces` in order: small ones joined (one syscall), big ones from their own
    buffers. The bytes sent. With `check`, the socket's timeout is a slice after which
    `check()` decides whether to go on."""
    total, small = 0, []
    for piece in pieces:
        size = len(piece) if isinstance(piece, bytes) else piece.nbytes
        total += size
        if size < SMALL_PIECE:
            small.append(bytes(piece) if not isinstance(piece, bytes) else piece)
            continue
        if small:
            _send(sock, b"".join(small), check)
            small = []
        _send(sock, _view(piece), check)
    if small:
        _send(sock, b"".join(small), check)
    return total


def recv_into(sock: socket.socket, buffer: Any, what: str, check: Check | None = None) -> None:
    """Fill `buffer` from `sock`; `FrameError` when the connection ends first (with
    `check`, as `send_pieces`)."""
    view = memoryview(buffer).cast("B")
    got, size = 0, len(view)
    while got < size:
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            if check is not None:
                check()
                continue
            raise FrameError(f"timed out after {got} of the {size} bytes of {what}", idle=not got) from None
        except OSError as exc:
            raise FrameError(f"the connection broke after {got} of the {size} bytes of {what} ({exc})") from None
        if not n:
            raise FrameError(f"the connection closed after {got} of the {size} bytes of {what}", idle=not got)
        got += n


def recv_prefix(sock: socket.socket, magic: bytes, what: str, check: Check | None = None) -> tuple[int, int]:
    """(method or status, header length) of the next frame."""
    raw = bytearray(PREFIX.size)
    recv_into(sock, raw, what, check)
    got, code, length = PREFIX.unpack(raw)
    if got != magic:
        raise FrameError(f"not a bulk-channel frame (magic {bytes(got)!r})")
    if length > MAX_HEADER:
        raise FrameError(f"a header of {length} bytes (at most {MAX_HEADER})")
    return code, length


def receive_value(sock: socket.socket, head: VarHead, into: np.ndarray | None = None,
                  check: Check | None = None, ring: RingReader | None = None) -> Any:
    """One var's value off the socket (or its `ring`): a dense tensor received into `into`
    (or a new array), a message received and decoded in place (a ring's bytes are copied
    out first: a peer cannot change what is being decoded)."""
    ring = ring if ring is not None and ring_carries(head.nbytes) else None
    if head.dtype is None:
        buffer = bytearray(head.nbytes)
        if ring is not None:
            ring.read_into(buffer, f"var {head.name!r}")
        else:
            recv_into(sock, buffer, f"var {head.name!r}", check)
        try:
            return decode_var(memoryview(buffer))
        except WireError as exc:
            raise FrameError(str(exc)) from None
    array = into if into is not None else np.empty(head.shape, head.dtype)
    if head.nbytes and ring is not None:
        ring.read_into(array, f"var {head.name!r}")
    elif head.nbytes:
        recv_into(sock, array, f"var {head.name!r}", check)
    view = array.view()
    view.flags.writeable = False  # as gRPC's arrays: kernels never write their inputs (and `into` is reused)
    if not head.lod:
        return LoDTensor(view)
    try:
        return LoDTensor(view, [list(level) for level in head.lod])
    except ValueError as exc:
        raise FrameError(f"var {head.name!r}: {exc}") from None


class MemoryExtents:
    """The memory bounds of some arrays, to ask in O(log n) whether an array's bounds
    overlap any of theirs: what `np.may_share_memory` answers for a pair (bounds only),
    for a pserver's every persistable at once. An empty array shares no memory."""

    def __init__(self, arrays: Iterable[np.ndarray]) -> None:
        bounds = sorted(byte_bounds(array) for array in arrays if array.size)
        self._lows = [low for low, _ in bounds]
        self._reach = list(itertools.accumulate((high for _, high in bounds), max))  # the highest end so far

    def overlaps(self, array: np.ndarray) -> bool:
        if not array.size:
            return False
        low, high = byte_bounds(array)
        below = bisect.bisect_left(self._lows, high)  # the extents that start before `array` ends
        return below > 0 and self._reach[below - 1] > low


def reply_parts(values: Sequence[tuple[str, Any]]) -> tuple[list[Piece], list[tuple[VarHead, list[Piece]]]]:
    """A successful reply carrying `values` (name, value): its prefix and header, and
    each var's head and payload pieces."""
    items = [outgoing(name, value) for name, value in values]
    raw = _header_bytes({"v": [head.encode() for head, _ in items]})
    return [PREFIX.pack(REPLY_MAGIC, STATUS_OK, len(raw)), raw], items


def reply_pieces(values: Sequence[tuple[str, Any]]) -> list[Piece]:
    """A successful reply carrying `values` (name, value), ready for `send_pieces`."""
    frame, items = reply_parts(values)
    return [*frame, *(piece for _, pieces in items for piece in pieces)]


def error_frame(code: grpc.StatusCode, details: str) -> bytes:
    raw = _header_bytes({"e": details[:8000]})
    return PREFIX.pack(REPLY_MAGIC, code.value[0], len(raw)) + raw


GO_FRAME = PREFIX.pack(REPLY_MAGIC, STATUS_GO, 0)


def readable(sock: socket.socket) -> bool:
    """Whether `sock` has bytes (or its peer's close) waiting, without blocking (`poll`:
    any descriptor number, where `select` stops at 1024)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


# ------------------------------------------------------------------ shared memory


class RingError(Exception):
    """A shared-memory ring that cannot be made or opened here (the payloads go by TCP)."""


_CREATED: dict[str, int] = {}  # segments made and not unlinked yet -> the pid that made them: unlinked at its exit
_CREATED_LOCK = threading.Lock()


@atexit.register
def _unlink_created() -> None:
    with _CREATED_LOCK:
        paths = [path for path, pid in _CREATED.items() if pid == os.getpid()]  # not a forked child's parent's
        _CREATED.clear()
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


class Ring:
    """A connection's shared-memory ring (issue 30): `slots` slots of `slot_bytes` in one
    segment of /dev/shm that a pserver makes (`create`: a random name, mode 0600, told
    only in the answer to an authenticated `Ring` request) and its trainer on the same
    host opens (`attach`). The name is unlinked as soon as the trainer has opened it (by
    the trainer, and by the pserver at the connection's next frame), when the connection
    closes, and at exit: only a process killed in that one round trip leaves it behind.
    The payloads then cross as one copy into a slot and the reader's own use of it (a
    sum, a copy into the param), where TCP costs a copy into the kernel and one out; the
    frames, the headers and the notes that hand a slot over stay on the TCP connection."""

    def __init__(self, buffer: mmap.mmap, name: str, slots: int, slot_bytes: int, owner: bool) -> None:
        self._map = buffer
        self.name = name
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._owner = owner
        self._linked = owner
        self.slot = [np.frombuffer(buffer, np.uint8, slot_bytes, i * slot_bytes) for i in range(slots)]

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @classmethod
    def create(cls, slots: int | None = None, slot_bytes: int | None = None) -> Ring:
        slots, slot_bytes = slots or RING_SLOTS, slot_bytes or SLOT_BYTES
        name = f"psb-{secrets.token_hex(16)}"
        path = os.path.join(SHM_DIR, name)
        if not hasattr(os, "posix_fallocate"):
            raise RingError("this system has no posix_fallocate to reserve a ring's pages")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise RingError(f"cannot create {path} ({exc.strerror or exc})") from None
        with _CREATED_LOCK:
            _CREATED[path] = os.getpid()
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            # the pages reserved now (ENOSPC here), not at a first write into a full /dev/shm (SIGBUS)
            os.posix_fallocate(fd, 0, slots * slot_bytes)
            buffer = mmap.mmap(fd, slots * slot_bytes)
        except OSError as exc:
            try:
                os.unlink(path)
            except OSError:
                pass
            _forget(path)
            raise RingError(f"cannot size or map {path} ({exc.strerror or exc})") from None
        finally:
            os.close(fd)
        return cls(buffer, name, slots, slot_bytes, owner=True)

    @classmethod
    def attach(cls, name: Any, slots: Any, slot_bytes: Any) -> Ring:
        """Open the pserver's segment: a name of ours, a regular file of this user, mode
        0600, of exactly `slots` × `slot_bytes`; then unlink its name."""
        if type(name) is not str or not _RING_NAME.match(name):
            raise RingError("the ring's name is not one a pserver makes")
        slots = _int(slots, "the ring's slots", 1, 64)
        slot_bytes = _int(slot_bytes, "the ring's slot size", 4096, 64 << 20)
        if slot_bytes % 4096:
            raise RingError(f"a slot of {slot_bytes} bytes is not whole pages")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise RingError(f"cannot open {path} ({exc.strerror or exc})") from None
        try:
            info = os.fstat(fd)
            if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077
                    or info.st_size != slots * slot_bytes):
                raise RingError(f"{path} is not a ring this user's pserver made (owner, mode or size)")
            buffer = mmap.mmap(fd, slots * slot_bytes)
        except OSError as exc:
            raise RingError(f"cannot map {path} ({exc.strerror or exc})") from None
        finally:
            os.close(fd)
        ring = cls(buffer, name, slots, slot_bytes, owner=False)
        ring._linked = True
        ring.unlink()
        return ring

    def unlink(self) -> None:
        """Remove the segment's name (the memory lives while a process maps it)."""
        if not self._linked:
            return
        self._linked = False
        try:
            os.unlink(self.path)
        except OSError:
            pass
        if self._owner:
            _forget(self.path)

    def close(self) -> None:
        self.unlink()
        self.slot = []
        try:
            self._map.close()
        except BufferError:  # a view of a slot is still alive somewhere: unmapped when it goes
            pass


def _forget(path: str) -> None:
    with _CREATED_LOCK:
        _CREATED.pop(path, None)


class RingWriter:
    """One direction of one call's payloads through `ring`: each var's bytes cut into
    slots (a var starts a slot), a `NOTE` on `sock` per filled slot, and a `FREE` awaited
    before a slot is filled again. `refused(status, length)` is what a reply prefix in
    place of a `FREE` means (the pserver's error; the trainer's side raises it)."""

    def __init__(self, sock: socket.socket, ring: Ring, check: Check | None = None,
                 refused: Callable[[int, int], None] | None = None) -> None:
        self.sock, self.ring, self.check, self.refused = sock, ring, check, refused
        self.posted = self.freed = 0  # slots handed over, given back

    def _take_free(self) -> None:
        raw = bytearray(FREE.size)
        recv_into(self.sock, memoryview(raw)[:4], "a slot's release", self.check)
        if bytes(raw[:4]) == REPLY_MAGIC and self.refused is not None:
            rest = bytearray(PREFIX.size - 4)
            recv_into(self.sock, rest, "the pserver's answer", self.check)
            status, length = struct.unpack("<BI", rest)
            self.refused(status, length)
            raise FrameError("a reply in place of a slot's release")
        recv_into(self.sock, memoryview(raw)[4:], "a slot's release", self.check)
        magic, slot = FREE.unpack(raw)
        if magic != FREE_MAGIC or slot != self.freed % self.ring.slots:
            raise FrameError(f"a slot release {bytes(magic)!r} of slot {slot} where slot "
                             f"{self.freed % self.ring.slots} was due")
        self.freed += 1

    def write(self, pieces: Sequence[Piece]) -> int:
        """Send one var's payload `pieces`; the bytes sent."""
        ring, size, fill, slot, total = self.ring, self.ring.slot_bytes, 0, None, 0
        for piece in pieces:
            view = _view(piece)
            off = 0
            while off < len(view):
                if slot is None:
                    if self.posted - self.freed >= ring.slots:
                        self._take_free()
                    slot = ring.slot[self.posted % ring.slots]
                n = min(size - fill, len(view) - off)
                slot[fill:fill + n] = np.frombuffer(view, np.uint8, n, off)
                fill, off, total = fill + n, off + n, total + n
                if fill == size:
                    self._post(fill)
                    fill, slot = 0, None
        if fill:
            self._post(fill)
        return total

    def _post(self, n: int) -> None:
        _send(self.sock, NOTE.pack(NOTE_MAGIC, self.posted % self.ring.slots, n), self.check)
        self.posted += 1

    def flush(self) -> None:
        """Wait until the reader gave every slot back: the TCP stream is the frames' again."""
        while self.freed < self.posted:
            self._take_free()


class RingReader:
    """The reading end of `RingWriter`: every `NOTE` checked (its magic, the slot due next,
    the length the header's sizes say) before the slot is read, a `FREE` sent once the
    slot is used."""

    def __init__(self, sock: socket.socket, ring: Ring, check: Check | None = None) -> None:
        self.sock, self.ring, self.check = sock, ring, check
        self.taken = 0

    def chunks(self, nbytes: int, what: str) -> Iterable[np.ndarray]:
        """A var's `nbytes`, slot by slot (uint8 views of the slots, each valid until the
        next is asked for)."""
        ring, done, raw = self.ring, 0, bytearray(NOTE.size)
        while done < nbytes:
            due, n = self.taken % ring.slots, min(ring.slot_bytes, nbytes - done)
            recv_into(self.sock, raw, f"the slot note of {what}", self.check)
            magic, slot, length = NOTE.unpack(raw)
            if magic != NOTE_MAGIC:
                raise FrameError(f"not a slot note (magic {bytes(magic)!r}) in {what}")
            if slot != due or length != n:
                raise FrameError(f"a slot note of slot {slot} with {length} bytes in {what}, where slot {due} with "
                                 f"{n} bytes was due")
            yield ring.slot[slot][:n]
            _send(self.sock, FREE.pack(FREE_MAGIC, slot), self.check)
            self.taken += 1
            done += n

    def read_into(self, buffer: Any, what: str) -> None:
        dest, off = memoryview(buffer).cast("B"), 0
        for data in self.chunks(len(dest), what):
            dest[off:off + len(data)] = data
            off += len(data)


def ring_carries(nbytes: int) -> bool:
    """Whether a var of `nbytes` crosses in a connection's ring (`RING_VAR_MIN`): both ends
    read it from the header, so the stream's order is the header's either way."""
    return nbytes >= RING_VAR_MIN


def send_vars(sock: socket.socket, ring: Ring | None, items: Iterable[tuple[VarHead, Sequence[Piece]]],
              check: Check | None = None, refused: Callable[[int, int], None] | None = None, *,
              slots: bool = False) -> int:
    """Send the payloads of `items` in order: the big vars through `ring` (`ring_carries`),
    the others on `sock` (small pieces joined, as `send_pieces`); once all is sent, wait
    until the reader gave every slot back. The bytes sent (with `slots`: the slots used)."""
    if ring is None:
        return send_pieces(sock, [piece for _, pieces in items for piece in pieces], check)
    writer, small, total = RingWriter(sock, ring, check, refused), [], 0
    for head, pieces in items:
        if not ring_carries(head.nbytes):
            small.extend(pieces)
            continue
        if small:
            total += send_pieces(sock, small, check)
            small = []
        total += writer.write(pieces)
    if small:
        total += send_pieces(sock, small, check)
    writer.flush()
    return writer.posted if slots else total


# ------------------------------------------------------------------ TLS


def server_context(tls: Tls) -> ssl.SSLContext:
    """The pserver side's TLS, from the same files as its gRPC credentials."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    if tls.cert is None or tls.key is None:
        tls.server_credentials()  # raises the AuthError naming what is missing
    context.load_cert_chain(str(tls.cert), str(tls.key))
    if tls.ca is not None:
        context.load_verify_locations(str(tls.ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(tls: Tls) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(tls.ca) if tls.ca is not None else None)
    if tls.cert is not None and tls.key is not None:
        context.load_cert_chain(str(tls.cert), str(tls.key))
    return context


# ------------------------------------------------------------------ the pserver side


class BulkAbort(Exception):
    """End one bulk call with a gRPC status code and a reason (the connection closes)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class Connection:
    """A pserver's end of one connection; `context` for the pserver's waits (`is_active`:
    the trainer has not closed it) and refusals (`abort` raises `BulkAbort`). With a
    shared-memory `ring`, a request that holds it reads its big vars through `reader`
    and sends its reply's through the ring too."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.timeout = timeout
        # a plain twin of a TLS socket's descriptor, to peek for the peer's close under the TLS layer
        self._peek = socket.socket(fileno=sock.fileno()) if isinstance(sock, ssl.SSLSocket) else sock
        self._peek_owned = self._peek is not sock
        self.go_sent = False
        self.ring: Ring | None = None  # the connection's shared-memory ring, once offered
        self.reader: RingReader | None = None  # the current request's payloads come through the ring
        self.ring_used = False
        self.slots = 0  # slots handed over, both ways

    def start(self, head: RequestHead) -> None:
        """A request frame arrived: the ring's name goes (the trainer opened it or never
        will); a trainer that could not open the ring sends over TCP, and the ring goes too."""
        if self.ring is not None:
            self.ring.unlink()
            if not head.ring:
                self.ring.close()
                self.ring = None
        if head.ring and self.ring is None:
            raise FrameError("a request through a shared-memory ring this connection has not")
        if self.reader is not None:
            self.slots += self.reader.taken
        self.reader = RingReader(self.sock, self.ring) if head.ring else None

    def ring_carries(self, var: VarHead) -> bool:
        """Whether `var`'s payload in the current request comes through the ring."""
        return self.reader is not None and ring_carries(var.nbytes)

    def send_reply(self, values: Sequence[tuple[str, Any]]) -> None:
        """A successful reply: its header on the socket, its big vars through the ring
        when the request came with one (`send_vars`)."""
        if self.reader is None:
            send_pieces(self.sock, reply_pieces(values))
            return
        frame, items = reply_parts(values)
        send_pieces(self.sock, frame)
        self.slots += send_vars(self.sock, self.ring, items, slots=True)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise BulkAbort(code, details)

    def is_active(self) -> bool:
        try:
            if not readable(self._peek):
                return True
            return bool(self._peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except (OSError, ValueError):
            return False

    def go(self) -> None:
        """Tell the trainer its header passed: the payload may come."""
        self.sock.sendall(GO_FRAME)
        self.go_sent = True

    def close(self) -> None:
        if self.reader is not None:
            self.slots += self.reader.taken
            self.reader = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self._peek_owned:
            self._peek.detach()  # the descriptor is the TLS socket's
        try:
            self.sock.close()
        except OSError:
            pass


class BulkListener:
    """The pserver's listener: one thread per connection (at most `max_connections`),
    each running `handle(connection, head)` for every request frame that carries the
    secret and the token."""

    def __init__(self, host: str, *, token: str | None, tls: Tls | None, timeout: float, max_connections: int,
                 handle: Callable[[Connection, RequestHead], None], max_vars: int = 1 << 16,
                 log: Callable[[str], None] = lambda text: None, port: int = 0, shm: str = "off") -> None:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host.strip("[]"), port))
        except OSError as exc:
            self._sock.close()
            raise OSError(exc.errno, f"cannot open the bulk channel on {host}:{port} ({exc.strerror}); "
                                     f"is the port in use? ({PORT_ENV})") from None
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self.secret = secrets.token_hex(32)
        self._secret = self.secret.encode()
        self._token = None if token is None else token.encode("utf-8")
        self._tls = server_context(tls) if tls is not None and tls.cert is not None else None
        self._shm = "off" if self._tls is not None else shm  # with TLS the payloads stay in TLS
        self._ring_failed = False  # logged once
        self.rings = 0  # connections with a shared-memory ring the trainer opened
        self.slots = 0  # slots those rings handed over, both ways (of the connections ended)
        self._timeout = timeout
        self._max = max_connections
        self._handle = handle
        self._max_vars = max_vars
        self._log = log
        self._lock = threading.Lock()
        self._open: set[Connection] = set()
        self._count = 0  # connections accepted and not yet ended
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="bulk-accept", daemon=True)
        self._thread.start()

    def announce(self) -> bytes:
        return json.dumps({"port": self.port, "secret": self.secret, "idle": self._timeout}).encode()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            open_, self._open = list(self._open), set()
        self._sock.close()
        for conn in open_:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(2)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except TimeoutError:
                if self._closed:
                    return
                continue
            except OSError:
                return
            with self._lock:  # counted from accept: a TLS handshake in progress holds a thread too
                full = self._closed or self._count >= self._max
                self._count += 0 if full else 1
            if full:
                sock.close()  # more connections than the trainers' calls may hold
                continue
            threading.Thread(target=self._serve, args=(sock,), name="bulk-conn", daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        conn: Connection | None = None
        try:
            peer = str(raw.getpeername()[0])
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            raw.settimeout(FIRST_FRAME_SECONDS)
            sock = self._tls.wrap_socket(raw, server_side=True) if self._tls is not None else raw
            conn = Connection(sock, self._timeout)
            with self._lock:
                if self._closed:
                    return
                self._open.add(conn)
            first = True
            while not self._closed:
                sock.settimeout(FIRST_FRAME_SECONDS if first else self._timeout)  # idle: the client reconnects
                try:
                    code, length = recv_prefix(sock, REQUEST_MAGIC, "a request's prefix")
                    raw_head = bytearray(length)
                    recv_into(sock, raw_head, "a request's header")
                    head = decode_request_head(code, bytes(raw_head), self._max_vars)
                except FrameError as exc:
                    if not exc.idle:  # a connection closed or left idle between calls just ends
                        self._refuse(conn, grpc.StatusCode.INVALID_ARGUMENT, f"a malformed bulk frame: {exc}")
                    return
                first = False
                given = head.secret.encode()
                token = (head.token or "").encode("utf-8", "replace")
                if not hmac.compare_digest(given, self._secret) or (
                        self._token is not None and not hmac.compare_digest(token, self._token)):
                    self._refuse(conn, grpc.StatusCode.UNAUTHENTICATED, "missing or wrong job token")
                    return
                sock.settimeout(self._timeout)
                conn.go_sent = False
                try:
                    if head.method == "Ring":
                        self._offer_ring(conn, head, peer)
                        continue
                    fresh = conn.ring is not None and not conn.ring_used
                    conn.start(head)
                    if fresh and head.ring:
                        conn.ring_used = True
                        with self._lock:
                            self.rings += 1
                    self._handle(conn, head)
                except BulkAbort as exc:
                    self._refuse(conn, exc.code, exc.details)
                    return
                except FrameError as exc:
                    self._refuse(conn, grpc.StatusCode.INVALID_ARGUMENT, f"a malformed bulk frame: {exc}")
                    return
                except (OSError, ssl.SSLError):
                    raise
                except Exception as exc:  # noqa: BLE001 - one call fails with the reason, not the pserver
                    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    self._refuse(conn, grpc.StatusCode.INTERNAL, f"{head.method} failed: {reason}")
                    return
        except (OSError, ssl.SSLError):
            return
        finally:
            with self._lock:
                self._count -= 1
                if conn is not None:
                    self._open.discard(conn)
                    self.slots += conn.slots
            if conn is not None:
                conn.close()
            else:
                raw.close()

    def ring_slots(self) -> int:
        """Slots the rings handed over so far, both ways."""
        with self._lock:
            return self.slots + sum(c.slots + (c.reader.taken if c.reader is not None else 0) for c in self._open)

    def _offer_ring(self, conn: Connection, head: RequestHead, peer: str) -> None:
        """Answer a `Ring` request: a new shared-memory ring's name and size when this
        pserver's `PSTRANSPILE_BULK_SHM` allows one for `peer` (`auto`: a loopback
        address) and /dev/shm takes it, else none (the payloads go by TCP)."""
        if head.vars or head.fetch or head.barrier or head.fetch_barrier or head.ring:
            raise FrameError("a Ring request carries fields it has not")
        if conn.ring is not None:
            raise FrameError("a second Ring request on one connection")
        ring = None
        if self._shm == "on" or (self._shm == "auto" and loopback(peer)):
            try:
                ring = Ring.create()
            except RingError as exc:
                if not self._ring_failed:
                    self._ring_failed = True
                    self._log(f"bulk channel: no shared-memory ring ({exc}); payloads go by TCP")
        conn.ring = ring
        raw = _header_bytes({"r": ring.name, "n": ring.slots, "b": ring.slot_bytes} if ring is not None else {"r": None})
        conn.sock.sendall(PREFIX.pack(REPLY_MAGIC, STATUS_OK, len(raw)) + raw)

    def _refuse(self, conn: Connection, code: grpc.StatusCode, details: str) -> None:
        """Send the refusal, then read what the trainer still sends (for at most
        `REFUSE_DRAIN_SECONDS`) until it closes: a socket closed with bytes unread resets
        the connection, and the trainer might lose the refusal (a slot note on its way
        when a ring's payload was refused)."""
        try:
            conn.sock.settimeout(1.0)
            conn.sock.sendall(error_frame(code, details))
            conn.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + REFUSE_DRAIN_SECONDS
            while (left := deadline - time.monotonic()) > 0:
                conn.sock.settimeout(left)
                if not conn.sock.recv(1 << 16):
                    break
        except (OSError, ValueError):
            pass


# ------------------------------------------------------------------ the trainer side


class BulkCallError(grpc.RpcError):
    """A bulk call that failed: the pserver's status and reason, or the connection's."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@dataclass(frozen=True)
class Offer:
    port: int
    secret: str
    idle: float = 60.0  # seconds the pserver keeps an idle connection
    @classmethod
    def decode(cls, data: bytes) -> Offer | None:
        """The pserver's announcement (None: it offers no channel)."""
        if not data:
            return None
        try:
            raw = json.loads(data.decode())
            idle = float(raw.get("idle", 60.0))
            return cls(_int(raw["port"], "the port", 1, 65535), _str(raw["secret"], "the secret", 128),
                       idle if idle > 0 else 60.0)
        except (ValueError, KeyError, TypeError, FrameError, UnicodeDecodeError):
            return None


class BulkClient:
    """A trainer's channel to one pserver: idle connections kept, one call per connection
    at a time."""

    def __init__(self, host: str, offer: Offer, *, token: str | None, tls: Tls | None, trainer_id: int,
                 connect_timeout: float, lost: Callable[[], str | None] = lambda: None, shm: str = "off") -> None:
        self.host = host.strip("[]")
        self.offer = offer
        self.token = token
        self.trainer_id = trainer_id
        self._tls = client_context(tls) if tls is not None else None
        self._connect_timeout = connect_timeout
        self._lost = lost  # why the pserver's gRPC connection failed (its keepalive: a frozen pserver), or None
        choice = "off" if tls is not None else shm
        self._want_ring = choice == "on" or (choice == "auto" and loopback(self.host))
        self.ring_failure: str | None = None  # why the last ring asked for could not be opened
        self._idle: list[tuple[socket.socket, Ring | None, float]] = []  # (connection, its ring, when it went idle)
        self._lock = threading.Lock()
        self._closed = False

    def _take(self) -> tuple[socket.socket, Ring | None]:
        with self._lock:
            while self._idle:
                sock, ring, since = self._idle.pop()
                # not one the pserver closed (idle too long), is about to close, or sent something unasked on
                if time.monotonic() - since < self.offer.idle / 2 and not readable(sock):
                    return sock, ring
                _drop(sock, ring)
        sock = self._connect()
        if not self._want_ring:
            return sock, None
        try:
            return sock, self._ask_ring(sock)
        except BulkCallError as exc:  # a pserver that refuses rings (another version): none asked again
            sock.close()
            self._want_ring = False
            self.ring_failure = f"the pserver refused a ring ({exc.details()})"
        except BaseException:
            sock.close()
            raise
        return self._connect(), None

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.offer.port), timeout=self._connect_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:
            sock = self._tls.wrap_socket(sock, server_hostname=self.host)
        return sock

    def _credentials(self) -> dict[str, Any]:
        """What every request's header carries for the pserver's checks: the channel's
        secret, the trainer id and the job token (when the job has one)."""
        head: dict[str, Any] = {"x": self.offer.secret, "t": self.trainer_id}
        if self.token is not None:
            head["k"] = self.token
        return head

    def _ask_ring(self, sock: socket.socket) -> Ring | None:
        """A shared-memory ring for a new connection to a pserver on this host, or None
        (the pserver offers none, or it cannot be opened here: `ring_failure` says why)."""
        raw = _header_bytes(self._credentials())
        sock.sendall(PREFIX.pack(REQUEST_MAGIC, METHOD_CODE["Ring"], len(raw)) + raw)
        try:
            status, length = recv_prefix(sock, REPLY_MAGIC, "the pserver's ring")
            if status != STATUS_OK:
                self._raise(sock, status, length)
            body = bytearray(length)
            recv_into(sock, body, "the pserver's ring")
            offer = json.loads(bytes(body).decode())
            if type(offer) is not dict:
                raise FrameError("a malformed ring offer")
        except (FrameError, ValueError, UnicodeDecodeError) as exc:
            raise OSError(f"the pserver's answer to a ring request: {exc}") from None
        if offer.get("r") is None:
            self._want_ring = False  # the pserver's choice and this host's address do not change
            return None
        try:
            return Ring.attach(offer.get("r"), offer.get("n"), offer.get("b"))
        except (RingError, FrameError) as exc:
            self._want_ring = False  # the next would fail alike: not asked again
            self.ring_failure = str(exc)
            return None

    def probe(self) -> None:
        """Open one connection now (kept for the first call): `OSError` or `ssl.SSLError`
        when the pserver's channel cannot be reached from here (a firewall, say)."""
        self._give_back(*self._take())

    def _give_back(self, sock: socket.socket, ring: Ring | None) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append((sock, ring, time.monotonic()))
                return
        _drop(sock, ring)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock, ring, _ in idle:
            _drop(sock, ring)

    def call(self, method: str, items: Sequence[tuple[VarHead, list[Piece]]], *, barrier: bool = False,
             fetch: Sequence[str] = (), fetch_barrier: bool = False, timeout: float,
             into: Mapping[str, np.ndarray] | None = None, on_sent: Callable[[], None] | None = None,
             arrived: Callable[[str, Any], None] | None = None) -> tuple[WireBatch, int, int]:
        """(the reply, bytes sent, bytes received) of one call; `BulkCallError` on failure.
        A fetched dense var named in `into` is received into that array when its shape and
        dtype are the reply's (the trainer's param, `ops.rpc.kernels.fetch_barrier`), else
        into a new one. A list `items` is emptied once sent, so that what it holds can be
        freed while the reply is awaited; then `on_sent` is called. `arrived(name, value)`
        is told of each fetched var as soon as it is in, before the next one is received (a
        trainer's early receive, `ops.rpc.client`)."""
        head = {**self._credentials(), "a": bool(barrier), "f": bool(fetch_barrier), "g": list(fetch),
                "v": [h.encode() for h, _ in items]}
        try:
            sock, ring = self._take()
        except OSError as exc:
            raise BulkCallError(grpc.StatusCode.UNAVAILABLE, f"cannot open the bulk channel ({exc})") from None
        if ring is not None:
            head["s"] = True
        raw = _header_bytes(head)
        ok = False
        deadline = time.monotonic() + timeout

        def check() -> None:  # a TCP peer that is frozen (SIGSTOP) still takes bytes: gRPC's keepalive tells
            lost = self._lost()
            if lost is not None:
                raise BulkCallError(grpc.StatusCode.UNAVAILABLE, f"the pserver stopped answering ({lost})")
            if time.monotonic() > deadline:
                raise BulkCallError(grpc.StatusCode.DEADLINE_EXCEEDED, f"the bulk channel timed out after {timeout:g} s")

        try:
            sock.settimeout(min(timeout, CHECK_SECONDS))
            sent = send_pieces(sock, [PREFIX.pack(REQUEST_MAGIC, METHOD_CODE[method], len(raw)), raw], check)
            received = 0
            if any(h.nbytes for h, _ in items):
                status, length = recv_prefix(sock, REPLY_MAGIC, "the pserver's answer", check)
                received += PREFIX.size + length
                if status != STATUS_GO:
                    self._raise(sock, status, length)
                sent += send_vars(sock, ring, items, check, refused=lambda code, size: self._raise(sock, code, size))
            if isinstance(items, list):
                items.clear()  # sent: the values may be freed before the reply (the caller's grads)
            if on_sent is not None:
                on_sent()
            status, length = recv_prefix(sock, REPLY_MAGIC, "the pserver's reply", check)
            if status != STATUS_OK:
                self._raise(sock, status, length)
            reply_head = bytearray(length)
            recv_into(sock, reply_head, "the reply's header", check)
            try:
                heads = json.loads(bytes(reply_head).decode())["v"]
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                raise FrameError("a malformed reply header") from None
            found = []
            reader = RingReader(sock, ring, check) if ring is not None else None
            for raw_var in _list(heads, "the reply's vars", 1 << 20):
                var = _var_head(raw_var)
                dest = into.get(var.name) if into else None
                if dest is not None and (var.dtype is None or dest.shape != var.shape or dest.dtype != var.dtype):
                    dest = None
                value = receive_value(sock, var, dest, check=check, ring=reader)
                found.append(value if isinstance(value, WireVar) else WireVar(var.name, value))
                received += var.nbytes
                if arrived is not None:
                    arrived(found[-1].name, found[-1].value)
            ok = True
            return WireBatch(0, False, tuple(found)), sent, received + PREFIX.size + length
        except TimeoutError:
            raise BulkCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "the bulk channel timed out") from None
        except FrameError as exc:
            code = grpc.StatusCode.DEADLINE_EXCEEDED if "timed out" in str(exc) else grpc.StatusCode.UNAVAILABLE
            raise BulkCallError(code, f"bulk channel: {exc}") from None
        except (OSError, ssl.SSLError) as exc:
            raise BulkCallError(grpc.StatusCode.UNAVAILABLE, f"the bulk channel broke ({exc})") from None
        finally:
            if ok:
                self._give_back(sock, ring)
            else:
                _drop(sock, ring)

    @staticmethod
    def _raise(sock: socket.socket, status: int, length: int) -> None:
        raw = bytearray(length)
        recv_into(sock, raw, "the pserver's error")
        try:
            details = str(json.loads(bytes(raw).decode())["e"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            details = "a malformed error reply"
        raise BulkCallError(_CODES.get(status, grpc.StatusCode.UNKNOWN), details)


def _drop(sock: socket.socket, ring: Ring | None) -> None:
    sock.close()
    if ring is not None:
        ring.close()


def announce_request() -> bytes:
    return rpc_pb2.VoidMessage().SerializeToString()


__all__ = ["BULK_ENV", "BULK_MIN", "CHOICES", "METHOD", "BulkAbort", "BulkCallError", "BulkChoiceError", "BulkClient",
           "BulkListener", "Connection", "FrameError", "MemoryExtents", "Offer", "RequestHead", "Ring", "RingError",
           "RingReader", "RingWriter", "SHM_ENV", "VarHead", "bulk_choice", "bulk_port", "decode_request_head", "loopback",
           "offers_bulk", "outgoing", "receive_value", "reply_parts", "reply_pieces", "ring_carries", "send_pieces", "send_vars",
           "shm_choice"]
