"""Which of gRPC core's I/O engines the runtime runs on, chosen before gRPC starts.

gRPC 1.85's default, the EventEngine, moves every read and write to threads of its own
and hands each event to the thread that polls the completion queue: for the small
unary calls of a training step (a few kB to a few hundred kB, a few per step) that
hand-off is most of a call's cost. The older poller does the I/O on the thread that
polls. Measured on this project's 2-core VM, loopback, a 16 kB unary call, the sync
server, 4 alternated pairs of 4,000 calls: 2,163–2,289 against 2,839–3,647 calls/s, the
client's CPU 172–186 against 101–123 µs a call, the server's 285–308 against 165–258 µs
(`benchmarks/grpc_engine.py` repeats it).

gRPC reads its choice from `GRPC_EXPERIMENTS` once, when it starts in a process (at
`import grpc`): `prefer_poller()` sets it there, before `ops.rpc` imports gRPC, and
`engine_env()` gives it to processes the launcher starts. Never over a value the user
set; not where gRPC already started (the setting would only reach child processes); and
only on the gRPC releases it was measured with, since a later release may drop these
experiment names (gRPC then logs an error line for each). `PSTRANSPILE_GRPC_ENGINE`
decides: `poller`, `event_engine` (gRPC's default, untouched), or `auto` (the default:
`poller` on the measured releases).
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

ENGINE_ENV = "PSTRANSPILE_GRPC_ENGINE"
EXPERIMENTS_ENV = "GRPC_EXPERIMENTS"
POLLER_EXPERIMENTS = ",".join(
    f"-{name}"
    for name in ("event_engine_client", "event_engine_listener", "event_engine_for_all_other_endpoints",
                 "event_engine_callback_cq")
)
MEASURED_RELEASES = ((1, 85),)  # (major, minor) of grpcio where POLLER_EXPERIMENTS were measured
CHOICES = ("auto", "poller", "event_engine")


class EngineChoiceError(ValueError):
    """`PSTRANSPILE_GRPC_ENGINE` names no engine."""


def grpcio_release() -> tuple[int, int] | None:
    """(major, minor) of the installed grpcio, read from its metadata file without
    importing it (importing gRPC starts it); None when it cannot be told."""
    spec = importlib.util.find_spec("grpc")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        try:
            text = (Path(folder) / "_grpcio_metadata.py").read_text()
        except OSError:
            continue
        match = re.search(r"(\d+)\.(\d+)\.", text)
        if match:
            return int(match.group(1)), int(match.group(2))
    return None


def engine_env(environ: Mapping[str, str] | None = None, release: tuple[int, int] | None = None) -> dict[str, str]:
    """The variables a process needs to run gRPC on the poller (empty when it should not:
    the user chose, or the release was not measured). `release` defaults to the installed one."""
    environ = os.environ if environ is None else environ
    choice = environ.get(ENGINE_ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise EngineChoiceError(f"{ENGINE_ENV}={environ[ENGINE_ENV]!r}: expected one of {', '.join(CHOICES)}")
    if choice == "event_engine" or EXPERIMENTS_ENV in environ:
        return {}
    if choice == "auto" and (release or grpcio_release()) not in MEASURED_RELEASES:
        return {}
    return {EXPERIMENTS_ENV: POLLER_EXPERIMENTS}


def prefer_poller(environ: MutableMapping[str, str] | None = None) -> bool:
    """Ask for the poller in this process (and its children), if gRPC has not started
    yet; whether this call set it. An invalid `PSTRANSPILE_GRPC_ENGINE` means gRPC's
    default here: `pstranspile launch` and `serve` refuse it (`engine_env` raises)."""
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
           "grpcio_release", "prefer_poller"]
