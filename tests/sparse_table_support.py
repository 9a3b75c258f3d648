"""Helpers the sparse-table tests share (no tests here): the CTR example's pservers,
transpiled and serving in threads of this process."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from contextlib import contextmanager
from dataclasses import dataclass, field

from e2e_support import EXAMPLES

from ops.executor import Executor
from ops.rpc.client import RpcClient
from ops.rpc.serve import serve_program
from ops.rpc.server import PServer
from ops.scope import Scope
from transpiler.api import TranspileResult, transpile
from transpiler.runtime.launch import free_endpoints

sys.path.insert(0, str(EXAMPLES))
import train_ctr  # noqa: E402

ROWS = 1000  # a small table: pserver i holds ids with id % 2 == i, 500 preallocated rows


@dataclass
class Serving:
    result: TranspileResult
    endpoints: list[str]
    scopes: dict[str, Scope]
    servers: dict[str, PServer]
    errors: list[BaseException] = field(default_factory=list)
    clients: list[RpcClient] = field(default_factory=list)

    def client(self, trainer_id: int = 0) -> RpcClient:
        client = RpcClient(trainer_id, timeout=20.0)
        self.clients.append(client)
        return client

    def startup_value(self, endpoint: str, name: str):
        """`name` as the pserver's startup program makes it (same executor seed): the pool a
        table hands out rows from."""
        scope = Scope()
        Executor(seed=0).run(self.result.pservers[endpoint][1], scope=scope)
        return scope.find_var(name)


@contextmanager
def serving_ctr(variant: str = "distributed", *, rows: int = ROWS, trainers: int = 1,
                sync_mode: bool = False, checkpoint_dir: Path | None = None) -> Iterator[Serving]:
    """2 pservers of `train_ctr.py`'s CTR program (`variant` table), serving in threads
    (checkpointing into `checkpoint_dir`)."""
    main, startup = train_ctr.build_ctr(variant, rows)
    endpoints = free_endpoints(2)
    result = transpile(main, startup, pservers=endpoints, trainers=trainers, sync_mode=sync_mode)
    state = Serving(result, endpoints, {ep: Scope() for ep in endpoints}, {})
    ready = {ep: threading.Event() for ep in endpoints}

    def serve(endpoint: str) -> None:
        def on_ready(server: PServer) -> None:
            state.servers[endpoint] = server
            ready[endpoint].set()

        try:
            pserver, pserver_startup = result.pservers[endpoint]
            serve_program(pserver, pserver_startup, scope=state.scopes[endpoint], ready=on_ready, log=None, timeout=20.0,
                          plan_text=result.plan.to_json_text(), checkpoint_dir=checkpoint_dir)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            state.errors.append(exc)
            ready[endpoint].set()

    threads = [threading.Thread(target=serve, args=(ep,), daemon=True) for ep in endpoints]
    for thread in threads:
        thread.start()
    for event in ready.values():
        assert event.wait(30), "a pserver did not start"
    assert not state.errors, state.errors
    try:
        yield state
    finally:
        for server in state.servers.values():
            server.stop()
        for thread in threads:
            thread.join(30)
        for client in state.clients:
            client.close()
