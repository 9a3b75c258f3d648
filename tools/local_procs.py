"""Helpers the tools, benchmarks and tests share to drive local processes (no product
code): free ports on 127.0.0.1 and a process's resident memory."""

from __future__ import annotations

import socket
from pathlib import Path

HOST = "127.0.0.1"


def free_ports(count: int, host: str = HOST) -> list[int]:
    """`count` distinct ports free on `host` right now (the OS picks them; all are held
    open together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_endpoints(count: int, host: str = HOST) -> list[str]:
    """`free_ports` as `host:port` endpoints."""
    return [f"{host}:{port}" for port in free_ports(count, host)]


def rss_mb(pid: int) -> float:
    """Process `pid`'s resident set now (VmRSS), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError(f"/proc/{pid}/status has no VmRSS line")


__all__ = ["HOST", "free_endpoints", "free_ports", "rss_mb"]
