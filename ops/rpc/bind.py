"""Why a pserver cannot listen where it was told, found before gRPC tries.

gRPC reports every bind failure alike ("Failed to bind ...; set GRPC_VERBOSITY=debug") and
logs its own line on stderr first. A plain socket bound the way gRPC binds (SO_REUSEADDR,
so a port in TIME_WAIT is not "in use") tells the cases apart: a name that does not
resolve, an address this machine does not have, a port someone else listens on.
"""

from __future__ import annotations

import errno
import socket

from ops.rpc.errors import BindError


def check_bindable(where: str, *, who: str) -> None:
    """Raise `BindError` naming the reason when `host:port` cannot be listened on."""
    host, _, port_text = where.rpartition(":")
    host = host.strip("[]")
    port = int(port_text)
    if port == 0:
        return  # any free port
    # An ASCII name as bytes: a str goes through the `idna` codec, whose import (with
    # `stringprep` and `unicodedata`) would stay resident in the pserver (0.3 MB).
    name = (host.encode("ascii") if host.isascii() else host) if host else None
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError(f"{who}: cannot listen on {where}: host {host!r} does not resolve ({exc.strerror})") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise BindError(f"{who}: cannot listen on {where}: port {port} is in use") from None
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise BindError(f"{who}: cannot listen on {where}: {host} is not an address of this machine") from None
                raise BindError(f"{who}: cannot listen on {where}: {exc.strerror}") from None
