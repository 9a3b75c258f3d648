"""The public API: `transpile(...)` and Paddle's `DistributeTranspiler`.

    result = transpile(main, startup, pservers="10.0.0.1:6170,10.0.0.2:6170", trainers=4, trainer_id=0)
    result.trainer, result.trainer_startup           # this trainer's programs
    main0, startup0 = result.pservers["10.0.0.1:6170"]
    result.plan                                       # where every block lives

The user's programs are never changed, and every getter returns a fresh copy.

`as_float64(program)` (from `transpiler.ir.precision`, re-exported here) is a copy of a
program computing in float64: transpile the float64 copies of main and startup to train
in float64 (the proof of distributed == local element by element uses it).
Differences from Paddle 1.8's `DistributeTranspiler`, each fixing a bug of its (reproduced on 1.8.5):
`HashName` works and is stable across processes; sync mode with one trainer works (the
pserver expects the grad names the trainer sends); `transpile(sync_mode=...)` sets the
mode of trainer and pservers alike; `grad_to_block_id` and control-var names are
deterministic; `get_startup_program` does not touch the trainer's startup program;
`get_trainer_program` returns a copy, not the mutated original; RMSProp's `MeanGrad` is
cut like the param; L2 decay on a cut param gets block-shaped temporaries; gradient clips
(an optimizer's `grad_clip=` too, which Paddle's `@CLIP` rule misses) stay on the trainer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transpiler.config import DistributeTranspilerConfig, TranspileOptions, make_options
from transpiler.dispatch import PSDispatcher
from transpiler.errors import TranspileError
from transpiler.ir import Program
from transpiler.ir.gc_pause import gc_paused
from transpiler.ir.verifier import verify as verify_program
from transpiler.ir.precision import as_float64
from transpiler.output import write_programs
from transpiler.passes import run_pipeline
from transpiler.passes.bundle import Bundle
from transpiler.plan import Plan

__all__ = ["DistributeTranspiler", "TranspileResult", "as_float64", "transpile", "wait_server_ready"]


@dataclass
class TranspileResult:
    trainer: Program
    trainer_startup: Program
    pservers: dict[str, tuple[Program, Program]]
    plan: Plan
    options: TranspileOptions

    def save(self, out_dir: str | os.PathLike, *, form: str = "pb") -> list[Path]:
        """Write every program and plan.json into `out_dir` (see `transpiler.output`);
        `form="paddle"` names them `.pdmodel`, `form="fluid18"` `<program>/__model__`."""
        return write_programs(out_dir, self.trainer, self.trainer_startup, self.pservers, self.plan, form=form)


def transpile(
    program: Program,
    startup_program: Program,
    *,
    pservers: str | list[str],
    trainers: int,
    trainer_id: int = 0,
    sync_mode: bool | None = None,
    slice_var_up: bool | None = None,
    split_method: str | type[PSDispatcher] | None = None,
    min_block_size: int | None = None,
    random_seed: int | None = None,
    partitioner=None,
    clip_mode: str | None = None,
    config: DistributeTranspilerConfig | None = None,
    verify: bool = False,
    dump_dir: str | os.PathLike | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> TranspileResult:
    """Transpile for parameter servers; explicit arguments override `config`.

    `verify=True` runs the verifier after every pass (always after the last).
    `dump_dir` gets a folder per pass with the state after it: the original programs as
    they stand, what find_optimize found (`analysis.txt`), the plan and every program built so far.
    `progress(pass_name, seconds)` is called after each pass.
    `random_seed` seeds the shuffle of unsliced round robin as Paddle's `program.random_seed`
    does; by default the config's, else the program's `random_seed` (a builder program's),
    else 0 (a loaded ProgramDesc does not carry it, and Paddle's default is 0).
    `partitioner` cuts the params into row x column partitions and places them
    (`transpiler.partition`: `paddle`, the default, `angel`, `column`, `module:Class`, a
    `Partitioner` class or instance); it overrides the config's.
    `clip_mode` ("exact" or "trainer"; default the config's, else "exact" in sync mode and
    "trainer" in async) says where gradient clips run (`transpiler.config.CLIP_MODES`).
    """
    if not isinstance(program, Program) or not isinstance(startup_program, Program):
        raise TranspileError("transpile needs the main and the startup Program")
    if random_seed is None and getattr(config, "random_seed", None) is None:
        random_seed = getattr(program, "random_seed", None)
    options = make_options(
        config,
        pservers=pservers,
        trainers=trainers,
        trainer_id=trainer_id,
        sync_mode=sync_mode,
        slice_var_up=slice_var_up,
        split_method=split_method,
        min_block_size=min_block_size,
        random_seed=random_seed,
        partitioner=partitioner,
        clip_mode=clip_mode,
    )
    # A malformed input (a typo'd var, a STRING op_role) is the user's error, named here,
    # not a crash inside a pass that trusted it.
    verify_program(program, name="the main program")
    verify_program(startup_program, name="the startup program")
    with gc_paused(promote=True):
        # Lent, not copied: no pass changes them (a lowering that rewrites them copies them first).
        bundle = Bundle(origin=program, origin_startup=startup_program, lent=True)
        bundle = run_pipeline(bundle, options, verify=verify, dump_dir=dump_dir, progress=progress)
    return TranspileResult(
        trainer=bundle.trainer,
        trainer_startup=bundle.trainer_startup,
        pservers={ep: (p.main, p.startup) for ep, p in bundle.pservers.items()},
        plan=bundle.plan,
        options=options,
    )


class DistributeTranspiler:
    """Paddle's API: `DistributeTranspiler(config).transpile(trainer_id, program=..., pservers=..., trainers=...)`,
    then the getters. `slice_var_up` and `split_method` may be passed to `transpile`
    directly, as the Fluid docs show."""

    def __init__(self, config: DistributeTranspilerConfig | None = None) -> None:
        self.config = config or DistributeTranspilerConfig()
        self._result: TranspileResult | None = None

    def transpile(
        self,
        trainer_id: int,
        program: Program | None = None,
        pservers: str = "127.0.0.1:6174",
        trainers: int = 1,
        sync_mode: bool | None = None,
        startup_program: Program | None = None,
        current_endpoint: str = "127.0.0.1:6174",
        slice_var_up: bool | None = None,
        split_method: str | type[PSDispatcher] | None = None,
    ) -> None:
        if program is None or startup_program is None:
            program, startup_program = _default_programs(program, startup_program)
        self._result = transpile(
            program,
            startup_program,
            pservers=pservers,
            trainers=trainers,
            trainer_id=trainer_id,
            sync_mode=sync_mode,
            slice_var_up=slice_var_up,
            split_method=split_method,
            config=self.config,
        )

    @property
    def result(self) -> TranspileResult:
        if self._result is None:
            raise TranspileError("call transpile() before asking for its programs")
        return self._result

    @property
    def plan(self) -> Plan:
        return self.result.plan

    def get_trainer_program(self, wait_port: bool | None = None) -> Program:
        """The trainer's main program (a copy). With `wait_port` (default: the config's
        `wait_port`, False), first wait until every pserver port accepts connections."""
        if wait_port if wait_port is not None else self.config.wait_port:
            wait_server_ready(list(self.result.options.endpoints))
        return self.result.trainer.clone()

    def get_trainer_startup_program(self) -> Program:
        return self.result.trainer_startup.clone()

    def get_pserver_program(self, endpoint: str) -> Program:
        return self._pserver(endpoint)[0].clone()

    def get_startup_program(
        self, endpoint: str, pserver_program: Program | None = None, startup_program: Program | None = None
    ) -> Program:
        """The pserver's startup program (a copy). `pserver_program` / `startup_program`
        are accepted for Paddle compatibility and not needed."""
        return self._pserver(endpoint)[1].clone()

    def get_pserver_programs(self, endpoint: str) -> tuple[Program, Program]:
        main, startup = self._pserver(endpoint)
        return main.clone(), startup.clone()

    def _pserver(self, endpoint: str) -> tuple[Program, Program]:
        try:
            return self.result.pservers[endpoint]
        except KeyError:
            known = ", ".join(self.result.pservers)
            raise TranspileError(f"{endpoint!r} is not one of the pservers ({known})") from None


def _default_programs(program: Program | None, startup: Program | None) -> tuple[Program, Program]:
    # Imported here: transpiling needs no builder, and `pstranspile transpile` starts faster without it.
    from transpiler.frontend import default_main_program, default_startup_program

    return program or default_main_program(), startup or default_startup_program()


def wait_server_ready(endpoints: list[str], timeout: float = 300.0, interval: float = 1.0) -> None:
    """Block until every `host:port` accepts a TCP connection (TranspileError after `timeout` s)."""
    deadline = time.monotonic() + timeout
    pending = list(endpoints)
    while pending:
        pending = [ep for ep in pending if not _port_open(ep)]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TranspileError(f"pservers not ready after {timeout:.0f}s: {', '.join(pending)}")
        time.sleep(interval)


def _port_open(endpoint: str) -> bool:
    import socket  # here: transpiling does not need it, and `pstranspile transpile` starts faster without it

    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return True
    except OSError:
        return False
