"""Run one pserver: its startup program, then its main program (whose
`listen_and_serv` serves until every trainer completed). What `pstranspile serve` and
`transpiler.runtime.session.Session.serve` call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ops.rpc  # noqa: F401  (registers the RPC kernels)
from ops.executor import ExecutionError, Executor
from ops.rpc.errors import PserverError
from ops.rpc.server import PServer, print_log
from ops.scope import Scope
from transpiler.errors import PsTranspilerError
from transpiler.ir import Program


class ServeError(PsTranspilerError):
    """A program that is not a pserver program, or an endpoint that does not fit it."""


def listen_op_endpoint(main: Program) -> str:
    """The `endpoint` attr of the program's one `listen_and_serv` (block 0)."""
    ops = [op for op in main.global_block().ops if op.type == "listen_and_serv"]
    if len(ops) != 1:
        raise ServeError(f"a pserver program has one listen_and_serv op in block 0; this one has {len(ops)}")
    return str(ops[0].attr("endpoint", ""))


def check_endpoint(main: Program, endpoint: str | None) -> str | None:
    """The address to bind: `endpoint` when given (its port must be the program's: the
    trainers were told that one), else None (the program's own)."""
    planned = listen_op_endpoint(main)
    if endpoint is None:
        return None
    if endpoint.rpartition(":")[2] != planned.rpartition(":")[2]:
        raise ServeError(f"--endpoint {endpoint} does not match the program's endpoint {planned} (the trainers expect that port)")
    return endpoint


def serve_program(
    main: Program,
    startup: Program,
    *,
    endpoint: str | None = None,
    timeout: float | None = None,
    seed: int | None = 0,
    scope: Scope | None = None,
    ready: Callable[[PServer], None] | None = None,
    log: Callable[[str], None] | None = print_log,
    refuse_nonfinite: bool | None = None,
) -> Scope:
    """Initialise and serve; return the pserver's scope once every trainer completed.
    Raises `PserverError` when the protocol fails (a trainer vanished, a block failed)."""
    bind = check_endpoint(main, endpoint)
    env: dict[str, Any] = {"pserver_log": log}
    if timeout is not None:
        env["rpc_timeout"] = float(timeout)
    if bind is not None:
        env["bind_endpoint"] = bind
    if refuse_nonfinite is not None:
        env["refuse_nonfinite"] = refuse_nonfinite
    if ready is not None:
        env["pserver_ready"] = ready
    scope = scope if scope is not None else Scope()
    exe = Executor(seed=seed, env=env)
    exe.run(startup, scope=scope)
    try:
        exe.run(main, scope=scope)
    except ExecutionError as exc:
        cause = exc.__cause__
        if isinstance(cause, PserverError):
            raise cause from None
        raise
    return scope
