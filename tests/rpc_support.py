"""Helpers the RPC tests share (no tests here): a `PServer` on a free port in a thread,
and self-signed TLS certificates for localhost."""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ops.rpc.client import RpcClient
from ops.rpc.server import PServer, ServeConfig
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows


@dataclass
class Running:
    server: PServer
    scope: Scope
    thread: threading.Thread
    errors: list[BaseException] = field(default_factory=list)
    clients: list[RpcClient] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.server.address

    def client(self, trainer_id: int, **options: Any) -> RpcClient:
        options.setdefault("timeout", 10.0)
        client = RpcClient(trainer_id, **options)
        self.clients.append(client)
        return client

    def join(self, timeout: float = 30.0) -> None:
        """Wait for `serve()` to end (a test that hangs here is a failing test)."""
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the pserver did not stop"


@contextmanager
def running_pserver(
    *,
    fanin: int = 1,
    sync_mode: bool = True,
    scope: Scope | None = None,
    run_block: Callable[[int], None] = lambda idx: None,
    **config: Any,
) -> Iterator[Running]:
    """Start a PServer on 127.0.0.1 (a free port) serving in a thread; stop it after."""
    scope = scope if scope is not None else Scope()
    server = PServer(ServeConfig(endpoint="127.0.0.1:0", fanin=fanin, sync_mode=sync_mode, **config), scope, run_block)
    server.start()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            server.serve()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    thread = threading.Thread(target=serve, name="pserver", daemon=True)
    thread.start()
    state = Running(server, scope, thread, errors)
    try:
        yield state
    finally:
        server.stop()
        thread.join(30)
        for client in state.clients:
            client.close()


def self_signed(directory: Path, *names: str) -> Path:
    """`DIR/<name>.pem` and `DIR/<name>.key` per name: a self-signed EC certificate for
    `localhost` and 127.0.0.1 (its own CA), made by the openssl program (the test is
    skipped without it)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl program")
    for name in names:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(directory / f"{name}.key"), "-out", str(directory / f"{name}.pem"), "-days", "2",
             "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
            check=True, capture_output=True, timeout=60,
        )
    return directory


def sgd_block(scope: Scope, fanin: int, params: tuple[str, ...]) -> Callable[[int], None]:
    """A pserver's optimize block by hand: each of `params` -= the sum of the trainers'
    grads (in trainer order); a SelectedRows grad subtracts its rows."""

    def run_block(idx: int) -> None:
        for param in params:
            value = scope.find_var(param).array.copy()
            for t in range(fanin):
                grad = scope.find_var(f"{param}@GRAD" if fanin == 1 else f"{param}@GRAD.trainer_{t}")
                if isinstance(grad, SelectedRows):
                    np.subtract.at(value, grad.rows, grad.value[: grad.rows.size])
                else:
                    value -= grad.array
            scope.set_var(param, LoDTensor(value))

    return run_block
