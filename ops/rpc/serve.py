"""Run one pserver: its startup program, then its main program (whose
`listen_and_serv` serves until every trainer completed). What `pstranspile serve` and
`transpiler.runtime.session.Session.serve` call.

With the plan (`plan.json`'s content) a pserver can also checkpoint into a dir of its
own (`checkpoint_dir`, the last `keep`), start from a checkpoint (`restore`: its vars cut
from the checkpoint's whole vars by this plan, whatever pserver count took it) or warm
start from LoDTensor files of whole vars (`init`: a `fetch` or `save_persistables`
folder; vars without a file keep their initialiser's values). See `ops.rpc.checkpoint`.
A `restore` that is a `{pserver}` template reads this pserver's own dir only, at the step
trainer 0 agrees over RPC once the pserver serves (`ops.rpc.own_dirs`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ops.rpc  # noqa: F401  (registers the RPC kernels)
from ops.executor import ExecutionError, Executor
from ops.rpc.auth import ServerAuth
from ops.rpc.checkpoint import (
    DEFAULT_KEEP,
    Checkpointer,
    CheckpointReader,
    VarSlice,
    is_template,
    part_root,
    pserver_layout,
    warm_start,
)
from ops.rpc.errors import PserverError
from ops.rpc.listen_and_serv import parse_grad_to_block, trainer_sent_vars
from ops.rpc.own_dirs import PartRestorer
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
    auth: ServerAuth | None = None,
    plan_fingerprint: str | None = None,
    plan_text: str | None = None,
    checkpoint_dir: Path | None = None,
    keep: int = DEFAULT_KEEP,
    restore: Path | None = None,
    init: Path | None = None,
    refuse_nonfinite: bool | None = None,
) -> Scope:
    """Initialise (then restore or warm start) and serve; return the pserver's scope
    once every trainer completed. Raises `PserverError` when the protocol fails (a
    trainer vanished, a block failed). `auth` defaults to the environment's
    (`ServerAuth.from_env`); `plan_fingerprint`, when given, is compared with the
    trainers' (`ops.rpc.auth`)."""
    bind = check_endpoint(main, endpoint)
    env: dict[str, Any] = {"pserver_log": log, "pserver_auth": auth or ServerAuth.from_env()}
    if plan_fingerprint is not None:
        env["plan_fingerprint"] = plan_fingerprint
    state = None
    if checkpoint_dir is not None or restore is not None or init is not None:
        if plan_text is None:
            raise ServeError("a checkpoint dir, a restore or a warm start needs the plan (plan.json)")
        state = PserverState(main, plan_text)
        if checkpoint_dir is not None:  # a `{pserver}` template: this pserver's own dir
            env["checkpointer"] = Checkpointer(part_root(checkpoint_dir, state.index), state.part, state.parts, state.layout,
                                               plan_text, keep, shared=not is_template(checkpoint_dir))
        if restore is not None and is_template(restore):  # its own dir only: restore at the step trainer 0 agrees
            env["restorer"] = PartRestorer(restore, state.index, state.part, len(state.parts), state.layout, plan_text)
    if timeout is not None:
        env["rpc_timeout"] = float(timeout)
    if bind is not None:
        env["bind_endpoint"] = bind
    if refuse_nonfinite is not None:
        env["refuse_nonfinite"] = refuse_nonfinite
    if ready is not None:
        env["pserver_ready"] = ready
    scope = scope if scope is not None else Scope()
    exe = Executor(seed=seed, env=env, free_dead=True)  # a sync round drops its grads after the optimizer reads them
    exe.run(startup, scope=scope)
    if restore is not None and is_template(restore):
        if log is not None:
            log(f"pserver {state.endpoint}: restores from {part_root(restore, state.index)} at the step trainer 0 agrees")
    elif restore is not None:
        reader = CheckpointReader(Path(restore))
        reader.restore(scope, state.layout, state.part, len(state.parts))
        if log is not None:
            log(f"pserver {state.endpoint}: restored {len(state.layout)} var(s) from {reader.folder} (step {reader.step})")
    elif init is not None:
        loaded = warm_start(scope, state.layout, Path(init), len(state.parts), state.index)
        if log is not None:
            log(f"pserver {state.endpoint}: warm start: {len(loaded)} var(s) from {init}")
    try:
        exe.run(main, scope=scope)
    except ExecutionError as exc:
        cause = exc.__cause__
        if isinstance(cause, PserverError):
            raise cause from None
        raise
    return scope


class PserverState:
    """A pserver program's state vars and its part of a checkpoint, by the plan."""

    def __init__(self, main: Program, plan_text: str) -> None:
        try:
            plan = json.loads(plan_text)
            endpoints = [str(ep) for ep in plan["endpoints"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ServeError(f"the plan is not a plan.json ({exc})") from None
        self.endpoint = listen_op_endpoint(main)
        if self.endpoint not in endpoints:
            raise ServeError(f"the plan's endpoints {', '.join(endpoints)} do not include this program's {self.endpoint}")
        self.index = endpoints.index(self.endpoint)
        self.part = f"ps{self.index}"
        self.parts = tuple(f"ps{i}" for i in range(len(endpoints)))
        self.layout: dict[str, VarSlice] = pserver_layout(main, plan, self.endpoint, sent_by_trainers(main))


def sent_by_trainers(main: Program) -> set[str]:
    """What the trainers send a pserver (grads, counters): received, not state."""
    listen = next(op for op in main.global_block().ops if op.type == "listen_and_serv")
    grad_to_block = parse_grad_to_block(listen.attr("grad_to_block_id", []), listen_op_endpoint(main))
    listed = tuple(listen.input("X"))
    return {*listed, *grad_to_block, *trainer_sent_vars(main, grad_to_block, listed)}
