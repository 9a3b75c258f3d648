"""The `PServer` service's method paths, codecs and channel options, in one place.

Paths come from the compiled descriptor (`proto/rpc_pb2.py`), so the server, the
client and `proto/rpc.proto` cannot drift apart. Variable messages and batches of them
go through `ops.rpc.wire` (built as bytes, zero-copy on receive); the small messages
through protobuf.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ops.rpc.wire import WireVar, decode_batch, decode_var
from proto import rpc_pb2

SERVICE = rpc_pb2.DESCRIPTOR.services_by_name["PServer"]
SERVICE_NAME = SERVICE.full_name  # "pstranspiler.rpc.PServer"

DEFAULT_TIMEOUT = 120.0
WATCH_SECONDS = 60.0  # how long a pserver holds one Watch call (the trainer then calls again)
LOST_GRACE = 3.0  # seconds a trainer whose connection closed has to come back before the pserver fails
TIMEOUT_ENV = "PSTRANSPILE_RPC_TIMEOUT"
NONFINITE_ENV = "PSTRANSPILE_REFUSE_NONFINITE"

# gRPC's default receive limit is 4 MB; tensors are far bigger. -1 lifts the limit to
# what protobuf allows (2 GB per message).
MESSAGE_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
)
# Keepalive: each side pings the other every KEEPALIVE_MS, calls or not, and drops the
# connection when a ping is not answered within KEEPALIVE_TIMEOUT_MS: a peer that is
# frozen (SIGSTOP) or whose machine vanished fails its calls (UNAVAILABLE) in seconds, not
# after the RPC deadline. A killed process closes its connections at once without them.
KEEPALIVE_MS = 3000
KEEPALIVE_TIMEOUT_MS = 10000
KEEPALIVE_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A ping gRPC sends for its own reasons (flow control) is waited on this long, default
    # 60 s; it would hide a frozen peer behind it (measured: 62 s without, 12 s with).
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
)
CHANNEL_OPTIONS = MESSAGE_OPTIONS + KEEPALIVE_OPTIONS + (
    # Trainers may start before pservers: retry the connection often, not on gRPC's
    # default backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
)
SERVER_OPTIONS = MESSAGE_OPTIONS + KEEPALIVE_OPTIONS + (
    # gRPC sets SO_REUSEPORT by default: a second pserver on a busy port would then
    # share it silently instead of failing.
    ("grpc.so_reuseport", 0),
    # Take the trainers' keepalive pings (gRPC's default refuses one every 3 s without data).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
)


def server_options(*, max_receive: int = -1) -> list[tuple[str, Any]]:
    """A pserver's options; `max_receive` (bytes, -1: none) bounds one received message,
    so gRPC refuses a bigger one (RESOURCE_EXHAUSTED) before the handler runs."""
    return [(key, max_receive if key == "grpc.max_receive_message_length" else value) for key, value in SERVER_OPTIONS]


def _identity(data: bytes) -> bytes:
    return data


# Messages `ops.rpc.wire` builds as bytes and decodes by hand: message name -> decoder.
_WIRE_DECODERS: dict[str, Callable[[Any], Any]] = {"VariableMessage": decode_var, "VarBatch": decode_batch}


@dataclass(frozen=True)
class Method:
    name: str
    path: str
    encode_request: Callable[[Any], bytes]
    decode_request: Callable[[bytes], Any]
    encode_response: Callable[[Any], bytes]
    decode_response: Callable[[bytes], Any]


def _proto_codec(message_type: type) -> tuple[Callable[[Any], bytes], Callable[[bytes], Any]]:
    return (lambda message: message.SerializeToString()), message_type.FromString


def _method(name: str) -> Method:
    desc = SERVICE.methods_by_name[name]
    codecs: list[tuple[Callable[[Any], bytes], Callable[[bytes], Any]]] = []
    for message in (desc.input_type, desc.output_type):
        if message.name in _WIRE_DECODERS:
            codecs.append((_identity, _WIRE_DECODERS[message.name]))
        else:
            codecs.append(_proto_codec(getattr(rpc_pb2, message.name)))
    (enc_req, dec_req), (enc_resp, dec_resp) = codecs
    return Method(name, f"/{SERVICE_NAME}/{name}", enc_req, dec_req, enc_resp, dec_resp)


METHODS: dict[str, Method] = {name: _method(name) for name in SERVICE.methods_by_name}


def default_timeout(env: Mapping[str, str] | None = None) -> float:
    """`PSTRANSPILE_RPC_TIMEOUT` (seconds) in `env` (default: the process's) when set,
    else 120 s; a ValueError naming the variable when it is not a positive number."""
    text = (os.environ if env is None else env).get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be positive, got {text}")
    return value


def refuse_nonfinite_default(env: Mapping[str, str] | None = None) -> bool:
    """`PSTRANSPILE_REFUSE_NONFINITE=1` in `env` (default: the process's): pservers refuse
    NaN / Inf grads. Off by default, as in Paddle."""
    text = (os.environ if env is None else env).get(NONFINITE_ENV, "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{NONFINITE_ENV}={text!r} is not 1 or 0")


def call_deadline(timeout: float) -> float:
    """How long a trainer waits for one RPC when pservers give up on a silent trainer
    after `timeout`: longer, so a pserver's diagnosis (naming the trainer that vanished)
    reaches the trainers that are still alive before their own deadline fires."""
    return timeout * 1.5 + 5.0


__all__ = ["CHANNEL_OPTIONS", "METHODS", "SERVER_OPTIONS", "WireVar", "call_deadline", "default_timeout",
           "refuse_nonfinite_default", "server_options"]
