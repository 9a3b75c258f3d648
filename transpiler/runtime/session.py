"""`Session`: one process's part of a training job, for any role.

    role = Role.from_env()                       # local, trainer or pserver
    with Session(main, startup, role=role) as session:
        if role.is_pserver:
            session.serve()                      # until every trainer completed
        else:
            session.start()                      # trainer: fetch the initial params
            for batch in batches:
                loss, = session.run(role.shard(batch), loss="mean_0.tmp_0")

The same script then trains locally (no environment), under `pstranspile launch`, or on
many machines under any scheduler that sets Paddle's variables. A distributed role
transpiles the programs itself (deterministic: every process agrees on the placement).
`run(..., loss=name)` prints a progress line (`transpiler.runtime.progress`) that `launch`
shows live. Leaving the `with` block tells the pservers this trainer is done — or,
on an exception, that it failed, so they stop at once instead of timing out.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

import numpy as np

from ops.executor import Executor
from ops.rpc.auth import Handshake, plan_fingerprint
from ops.rpc.client import RpcClient  # importing ops.rpc registers the RPC kernels
from ops.rpc.serve import serve_program
from ops.scope import Scope
from ops.tensor import LoDTensor
from transpiler.api import TranspileResult, transpile
from transpiler.config import DistributeTranspilerConfig
from transpiler.errors import PsTranspilerError
from transpiler.ir import Program
from transpiler.runtime.progress import Progress, format_progress
from transpiler.runtime.role import Role

FAILURE_NOTICE_DEADLINE = 5.0  # seconds to tell the pservers a trainer failed


class Session:
    """Runs the programs of one role; see the module docstring."""

    def __init__(
        self,
        main: Program,
        startup: Program,
        *,
        role: Role | None = None,
        sync_mode: bool | None = None,
        config: DistributeTranspilerConfig | None = None,
        seed: int | None = 0,
        out: TextIO | None = None,
        progress_every: int = 1,
        **transpile_options: Any,
    ) -> None:
        self.role = role if role is not None else Role.from_env()
        self.main, self.startup = main, startup
        self.sync_mode = self.role.sync_mode if sync_mode is None else bool(sync_mode)
        self.out = out
        self.progress_every = max(1, int(progress_every))
        self.result: TranspileResult | None = None
        if self.role.is_distributed:
            self.result = transpile(
                main,
                startup,
                pservers=list(self.role.endpoints),
                trainers=self.role.trainers,
                trainer_id=self.role.trainer_id,
                sync_mode=self.sync_mode,
                config=config,
                **transpile_options,
            )
        self.client = None
        env: dict[str, Any] = {}
        if self.role.is_trainer:
            handshake = Handshake(self.role.trainer_id, self.role.trainers, self.sync_mode, self.plan_fingerprint)
            self.client = RpcClient(self.role.trainer_id, timeout=self.role.rpc_timeout, handshake=handshake)
            env["rpc"] = self.client
        self.scope = Scope()
        self.executor = Executor(seed=seed, env=env)
        self.steps = 0
        self._started_at: float | None = None
        self._finished = False

    # ------------------------------------------------------------ programs
    @property
    def program(self) -> Program:
        """What one step runs: the trainer program, or the original when local."""
        if self.role.is_pserver:
            raise PsTranspilerError("a pserver runs serve(), not training steps")
        return self.result.trainer if self.result is not None else self.main

    @property
    def startup_program(self) -> Program:
        if self.result is None:
            return self.startup
        if self.role.is_pserver:
            return self.result.pservers[self.role.current_endpoint][1]
        return self.result.trainer_startup

    @property
    def plan_fingerprint(self) -> str | None:
        """The plan's fingerprint, which the handshake compares between trainers and pservers."""
        return plan_fingerprint(self.result.plan.to_json()) if self.result is not None else None

    # ------------------------------------------------------------ roles
    def serve(self) -> Any:
        """Pserver: initialise and serve until every trainer completed; the scope."""
        if not self.role.is_pserver:
            raise PsTranspilerError(f"serve() is for pservers; this process is {self.role.name}")
        main, startup = self.result.pservers[self.role.current_endpoint]
        self._finished = True
        return serve_program(main, startup, timeout=self.role.rpc_timeout, seed=self.executor.seed, scope=self.scope,
                             plan_fingerprint=self.plan_fingerprint)

    def start(self) -> None:
        """Run the startup program (a trainer's fetches the pservers' initial params)."""
        self.executor.run(self.startup_program, scope=self.scope)
        self._started_at = time.monotonic()

    def run(
        self,
        feed: Mapping[str, Any] | None = None,
        fetch_list: Iterable[str] = (),
        *,
        loss: str | None = None,
    ) -> list[Any]:
        """One training step; with `loss`, the loss is fetched last and reported."""
        if self._started_at is None:
            self.start()
        fetches = list(fetch_list) + ([loss] if loss is not None else [])
        values = self.executor.run(self.program, feed=feed, fetch_list=fetches, scope=self.scope)
        self.steps += 1
        if loss is not None and (self.steps % self.progress_every == 0 or self.steps == 1):
            self.report(float(np.asarray(values[-1]).reshape(-1)[0]))
        return values

    def report(self, loss: float | None) -> None:
        elapsed = time.monotonic() - (self._started_at or time.monotonic())
        who = str(self.role.trainer_id) if self.role.is_trainer else "local"
        rate = self.steps / elapsed if elapsed > 0 else None
        print(format_progress(Progress(who, self.steps, loss, rate)), file=self.out or sys.stdout, flush=True)

    def evaluate(self, program: Program, feed: Mapping[str, Any], fetch_list: Iterable[str]) -> list[Any]:
        """Run another program (a forward-only eval program) over this session's params,
        its temporaries in a child scope."""
        return self.executor.run(program, feed=feed, fetch_list=list(fetch_list), scope=self.scope.new_scope())

    def params(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Copies of the current values of `names` (default: the main program's parameters)."""
        if names is None:
            names = parameter_names(self.main)
        out = {}
        for name in names:
            value = self.scope.find_var(name)
            if isinstance(value, LoDTensor):
                out[name] = np.array(value.array)
        return out

    # ------------------------------------------------------------ the end
    def finish(self, *, failed: bool = False, reason: str = "") -> None:
        """Tell the pservers this trainer is done (or failed); idempotent."""
        if self._finished:
            return
        self._finished = True
        if self.client is None:
            return
        try:
            if failed:
                self.client.complete(self.role.endpoints, failed=True, reason=reason, deadline=FAILURE_NOTICE_DEADLINE)
            else:
                self.client.complete(self.role.endpoints)
        finally:
            self.client.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.finish()
            return
        reason = str(exc).splitlines()[0] if str(exc) else exc_type.__name__
        try:
            self.finish(failed=True, reason=f"{exc_type.__name__}: {reason}")
        except Exception:  # noqa: BLE001 - the pservers may be gone; the original error matters
            pass


def parameter_names(program: Program) -> list[str]:
    """The program's parameters: vars marked `is_parameter`, else (Fluid 1.x programs do
    not mark them) the `Param` args of its optimizer ops, sorted."""
    block = program.global_block()
    marked = [name for name, var in block.vars.items() if var.is_parameter]
    if marked:
        return sorted(marked)
    return sorted({name for op in block.ops for name in op.input("Param")})
