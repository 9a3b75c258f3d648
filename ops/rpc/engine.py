"""Which of gRPC core's I/O engines the runtime runs on, chosen before gRPC starts.

gRPC 1.85's default, the EventEngine, does every read and write on threads of its own
and hands each event over to the thread that polls the completion queue; the older
poller does the I/O on the polling thread itself. Which is faster depends on the size of
a step's messages (`benchmarks/grpc_engine.py`, this project's 2-core VM, loopback, the
sync server, medians of alternated runs, poller against EventEngine):

| message | calls/s | client CPU | server CPU |
|---|---:|---:|---:|
| 16 kB | 1.55× | 0.57× | 0.69× |
| 64 kB | 1.18× | 0.77× | 0.92× |
| 256 kB | 0.81× | 1.08× | 1.29× |
| 1.6 MB | 0.48–0.69× | 1.26–1.99× | 1.73–2.24× |

So a job whose messages are small (a sparse embedding's rows and a few small dense
params: the CTR kind) runs faster on the poller, and a dense model's (MB-sized param
blocks) much slower. The choice is the process's and gRPC reads it once, when it starts
(at `import grpc`), before any program is known; so it is the user's, per job:
`PSTRANSPILE_GRPC_ENGINE=poller` (or `event_engine`, the default: gRPC's own, untouched).

`prefer_poller()` applies it where `ops.rpc` is imported before gRPC (`ops/rpc/__init__`
calls it first), and `engine_env()` gives it to the processes `launch` starts, whatever
they import first. A `GRPC_EXPERIMENTS` the user set is never overwritten.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

from ops.rpc.env_choice import EnvChoiceError, env_choice

ENGINE_ENV = "PSTRANSPILE_GRPC_ENGINE"
EXPERIMENTS_ENV = "GRPC_EXPERIMENTS"
POLLER_EXPERIMENTS = ",".join(
    f"-{name}"
    for name in ("event_engine_client", "event_engine_listener", "event_engine_for_all_other_endpoints",
                 "event_engine_callback_cq")
)
CHOICES = ("event_engine", "poller")


class EngineChoiceError(EnvChoiceError):
    """`PSTRANSPILE_GRPC_ENGINE` names no engine."""


def engine_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a process needs for the engine `environ` (default `os.environ`)
    asks for: empty for gRPC's default, or when the user set `GRPC_EXPERIMENTS` already."""
    environ = os.environ if environ is None else environ
    choice = env_choice(environ, ENGINE_ENV, CHOICES, EngineChoiceError)
    if choice == "event_engine" or EXPERIMENTS_ENV in environ:
        return {}
    return {EXPERIMENTS_ENV: POLLER_EXPERIMENTS}


def prefer_poller(environ: MutableMapping[str, str] | None = None) -> bool:
    """Apply `PSTRANSPILE_GRPC_ENGINE` to this process (and its children) if gRPC has not
    started yet; whether this call set anything. An invalid value means gRPC's default
    here: `pstranspile launch` and `serve` refuse it (`engine_env` raises)."""
    environ = os.environ if environ is None else environ
    if "grpc" in sys.modules:
        return False
    try:
        wanted = engine_env(environ)
    except EngineChoiceError:
        return False
    environ.update(wanted)
    return bool(wanted)


__all__ = ["CHOICES", "ENGINE_ENV", "EXPERIMENTS_ENV", "EngineChoiceError", "POLLER_EXPERIMENTS", "engine_env",
           "prefer_poller"]
