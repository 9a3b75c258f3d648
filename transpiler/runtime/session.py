"""`Session`: one process's part of a training job, for any role.

    role = Role.from_env()                       # local, trainer or pserver
    with Session(main, startup, role=role) as session:
        if role.is_pserver:
            session.serve()                      # until every trainer completed
        else:
            session.start()                      # trainer: fetch the initial params
            for batch in batches:
                loss, = session.run(role.shard(batch), loss="mean_0.tmp_0")

Checkpoints (`ops.rpc.checkpoint`): `Session(..., checkpoint_dir=D, checkpoint_every=N)`
makes trainer 0 (or local training) ask for checkpoint `ckpt-<step>` after every N steps
and after the last one, which each pserver writes into `D` (every process of the job is given the same options;
the pservers get the dir, the trainers the cadence). `restore=D` starts from the newest
complete checkpoint in `D` (or that checkpoint folder): the pservers load it, cut by
their own plan (any pserver count), and `session.steps` starts at its step, so a script
skips the batches already trained (`for step in range(session.steps, total)`).
Given None, these options fall back on what a launcher sets in the environment
(`PSTRANSPILE_CHECKPOINT_DIR`, `PSTRANSPILE_CHECKPOINT_EVERY`, and `PSTRANSPILE_RESTORE` when
`launch --max-restarts` restarts a job). `init=D` warm starts the pservers (or local
training) from LoDTensor files of whole vars, and each trainer the params it keeps to
itself (batch norm's moving stats), so trainer 0's `pull()` written out starts a job whole.
With `{pserver}` in `checkpoint_dir` each
pserver checkpoints into a dir of its own and no process reads another's (`ops.rpc.own_dirs`:
trainer 0 gathers the parts' PART.json and sends the job manifest over RPC); `restore`
such a template and trainer 0 agrees the step with the pservers over RPC before the
trainers' startup (each pserver restores from its own part, every trainer learns the step). `pull(names)` reads whole params out of the pservers (`pstranspile fetch`).

The same script then trains locally (no environment), under `pstranspile launch`, or on
many machines under any scheduler that sets Paddle's variables. A distributed role
transpiles the programs itself (deterministic: every process agrees on the placement).
`run(..., loss=name)` prints a progress line (`transpiler.runtime.progress`: step, loss,
steps/s, the RPC bytes sent and received) that `launch` shows live and writes into the job's
metrics file; `serve()` prints the pserver's CPU use every `USAGE_EVERY` seconds. Given
`metrics=PATH` (default `$PSTRANSPILE_METRICS`) the session also appends these reports to
PATH itself (`transpiler.runtime.metrics`), for a job no `launch` watches. Leaving the
`with` block tells the pservers this trainer is done — or, on an exception, that it
failed, so they stop at once instead of timing out.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ops.executor import Executor
from ops.kernels import load_kernels
from ops.kernels.context import BATCH_SHARD
from ops.rpc.auth import Handshake, plan_fingerprint
from ops.rpc.checkpoint import (
    DEFAULT_KEEP,
    MANIFEST,
    TRAINER_STATE,
    Checkpointer,
    CheckpointReader,
    checkpoint_name,
    is_template,
    job_root,
    confine,
    local_layout,
    warm_start,
    warm_start_files,
)
from ops.rpc import own_dirs
from ops.rpc.fetch import pull, write_vars  # importing ops.rpc registers the RPC kernels
from ops.rpc.malloc import arenas_for, bound_arenas, malloc_choice
from ops.scope import Scope
from ops.tensor import LoDTensor
from transpiler.api import TranspileResult, transpile
from transpiler.config import DistributeTranspilerConfig
from transpiler.errors import PsTranspilerError
from transpiler.ir import Program
from transpiler.ir.program import var_bytes
from transpiler.runtime.metrics import METRICS_ENV, MetricsWriter
from transpiler.runtime.progress import Progress, Usage, format_progress, format_usage
from transpiler.runtime.role import CHECKPOINT_DIR_ENV, CHECKPOINT_EVERY_ENV, PARTITIONER_ENV, RESTORE_ENV, RESTORE_IF_ANY_ENV, Role

FAILURE_NOTICE_DEADLINE = 5.0  # seconds to tell the pservers a trainer failed
USAGE_EVERY = 0.5  # seconds between a pserver's CPU reports


def largest_param(program: Program) -> int:
    """Bytes of the program's largest persistable var of known shape and dtype (0: none)."""
    largest = 0
    for block in program.blocks:
        for var in block.vars.values():
            if var.persistable:
                try:
                    largest = max(largest, var_bytes(var))
                except KeyError:  # a dtype without a fixed size (none of a param's)
                    continue
    return largest


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
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int = DEFAULT_KEEP,
        restore: str | Path | None = None,
        init: str | Path | None = None,
        metrics: str | Path | None = None,
        **transpile_options: Any,
    ) -> None:
        self.role = role if role is not None else Role.from_env()
        if self.role.is_distributed:
            # Before this process starts a thread (a pserver's usage reports, the RPC threads):
            # a thread that got an arena of its own keeps it, and such an arena maps a big
            # param's buffers fresh every step (ops.rpc.malloc). The thresholds come with the
            # `PServer` or the `RpcClient`, which trim the heap then: what the transpile and a
            # pserver's startup program freed is given back, not kept in the peak.
            malloc_choice()  # a bad PSTRANSPILE_MALLOC fails here, before the transpile
            arenas = arenas_for(largest_param(main))
            if arenas is not None:
                bound_arenas(count=arenas)
        self.main, self.startup = main, startup
        self.sync_mode = self.role.sync_mode if sync_mode is None else bool(sync_mode)
        self.out = out
        self.progress_every = max(1, int(progress_every))
        self.result: TranspileResult | None = None
        if self.role.is_distributed:
            if transpile_options.get("partitioner") is None and getattr(config, "partitioner", None) is None:
                transpile_options["partitioner"] = os.environ.get(PARTITIONER_ENV) or None
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
            from ops.rpc.client import RpcClient  # here: a pserver never loads the client (ops/rpc/__init__.py)

            handshake = Handshake(self.role.trainer_id, self.role.trainers, self.sync_mode, self.plan_fingerprint)
            self.client = RpcClient(self.role.trainer_id, timeout=self.role.rpc_timeout, handshake=handshake)
            env["rpc"] = self.client
            # dropout masks follow an element's place in the global batch (ops/kernels/transformer.py)
            env[BATCH_SHARD] = (self.role.trainer_id, self.role.trainers)
        self.scope = Scope()
        self.executor = Executor(seed=seed, env=env, free_dead=True)  # temporaries dropped after their last read
        # The code of every kernel this process will run, loaded before its startup program
        # allocates the params (`load_kernels`: a family or an RPC module imported mid-step
        # put its objects in the hole a freed weight left, and the trainer's next weight-sized
        # array went to fresh memory: its 64 MB peak 128 -> 192 MB).
        ran = self.result.pservers.get(self.role.current_endpoint, ()) if self.role.is_pserver else (self.program, self.startup_program)
        load_kernels({op.type for program in ran for block in program.blocks for op in block.ops})
        checkpoint_dir, checkpoint_every, restore = launcher_checkpoint_options(checkpoint_dir, checkpoint_every, restore)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = max(0, int(checkpoint_every))
        self.keep_checkpoints = int(keep_checkpoints)
        self.restore_from = Path(restore) if restore is not None else None
        self.init_from = Path(init) if init is not None else None
        if self.checkpoint_every and self.checkpoint_dir is None and not self.role.is_trainer:
            raise PsTranspilerError("checkpoint_every needs a checkpoint_dir")
        # A `{pserver}` template of a distributed job: each pserver restores from its own dir
        # at the step trainer 0 agrees over RPC; the trainers learn it (`ops.rpc.own_dirs`).
        self._agreed = self.restore_from is not None and is_template(self.restore_from) and self.role.is_distributed
        self._restored = CheckpointReader(self.restore_from) if self.restore_from is not None and not self._agreed else None
        self.steps = self._restored.step if self._restored is not None else 0
        self._agreed_state: dict[str, bytes] = {}  # trainer 0's own state at the agreed step (LoDTensor files)
        if self._agreed and self.role.is_trainer:
            self.steps, self._agreed_state = self._agree_restore(os.environ.get(RESTORE_IF_ANY_ENV) == "1")
        self._started_at: float | None = None
        self._finished = False
        metrics = metrics if metrics is not None else (os.environ.get(METRICS_ENV) or None)
        self._metrics = MetricsWriter(metrics) if metrics is not None else None

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
        plan = self.result.plan
        if plan.partitioner != "paddle":  # which cut this pserver serves (a paddle job's log as it was)
            held = plan.by_endpoint().get(self.role.current_endpoint, [])
            print(f"pserver {self.role.current_endpoint}: {len(held)} partition(s) of {len({p.param for p, _ in held})} "
                  f"param(s), partitioner {plan.partitioner}", file=self.out or sys.stdout, flush=True)
        from ops.rpc.serve import serve_program  # here: a trainer never loads the server (ops/rpc/__init__.py)

        self._finished = True
        done = self._report_usage()
        try:
            return serve_program(
                main, startup, timeout=self.role.rpc_timeout, seed=self.executor.seed, scope=self.scope,
                plan_fingerprint=self.plan_fingerprint, plan_text=self.result.plan.to_json_text(),
                checkpoint_dir=self.checkpoint_dir, keep=self.keep_checkpoints,
                restore=self.restore_from if self._agreed else self._restored.folder if self._restored is not None else None,
                init=self.init_from,
            )
        finally:
            done()

    def _report_usage(self):
        """Start printing this pserver's CPU use every USAGE_EVERY seconds; the function that
        stops it (after one last report)."""
        index = self.role.endpoints.index(self.role.current_endpoint)
        wall0, cpu0 = time.monotonic(), time.process_time()
        stop = threading.Event()

        def emit() -> None:
            usage = Usage(index, time.process_time() - cpu0, time.monotonic() - wall0)
            print(format_usage(usage), file=self.out or sys.stdout, flush=True)
            if self._metrics is not None:
                self._metrics.report(usage)

        def loop() -> None:
            while not stop.wait(USAGE_EVERY):
                emit()

        thread = threading.Thread(target=loop, name="pserver-usage", daemon=True)
        thread.start()

        def done() -> None:
            stop.set()
            thread.join(timeout=USAGE_EVERY + 1.0)
            emit()
            self._close_metrics()

        return done

    def _close_metrics(self) -> None:
        if self._metrics is not None:
            self._metrics.close()

    def start(self) -> None:
        """Run the startup program (a trainer's fetches the pservers' initial params;
        local training restores or warm starts here)."""
        self.executor.run(self.startup_program, scope=self.scope)
        if self.result is None and self._restored is not None:
            self._restored.restore(self.scope, local_layout(self.main), "local", 1)
        elif self.result is None and self.init_from is not None:
            warm_start(self.scope, local_layout(self.main), self.init_from, 1, 0)
        elif self.role.is_trainer and self._restored is not None:
            # every trainer restarts its own state (moving stats) from trainer 0's, if kept
            state = self._restored.folder / TRAINER_STATE
            own = self._own_params()
            if own and state.is_dir():
                warm_start(self.scope, {n: v for n, v in local_layout(self.main).items() if n in own}, state, 1, 0)
        elif self.role.is_trainer and self._agreed and self.steps:
            # a `{pserver}` template: trainer 0's state came over RPC with the agreed step (own_dirs)
            own = self._own_params()
            if own and self._agreed_state:
                warm_start_files(self.scope, {n: v for n, v in local_layout(self.main).items() if n in own},
                                 self._agreed_state, f"trainer 0's state of {checkpoint_name(self.steps)}")
            elif own:
                print(f"trainer {self.role.trainer_id}: {checkpoint_name(self.steps)} holds no trainer 0 state in "
                      f"{job_root(self.restore_from)}: {', '.join(sorted(own))} start from the startup program",
                      file=sys.stderr, flush=True)
        elif self.role.is_trainer and self.init_from is not None:
            # the pservers warm start the params they hold; each trainer what it keeps itself
            own = self._own_params()
            warm_start(self.scope, {n: v for n, v in local_layout(self.main).items() if n in own}, self.init_from, 1, 0)
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
        self.executor.stream = self.steps  # random ops draw by the step: a restored trainer draws what it would have
        values = self.executor.run(self.program, feed=feed, fetch_list=fetches, scope=self.scope)
        self.steps += 1
        if self.checkpoint_every and self.steps % self.checkpoint_every == 0:
            self.checkpoint()
        if loss is not None and (self.steps % self.progress_every == 0 or self.steps == 1):
            self.report(float(np.asarray(values[-1]).reshape(-1)[0]))
        return values

    def checkpoint(self, step: int | None = None) -> None:
        """Checkpoint `ckpt-<step>` (default: the steps run): trainer 0 asks every
        pserver (sync: the state after that step); local training writes its own; other
        trainers do nothing."""
        name = checkpoint_name(self.steps if step is None else step)
        if self.client is not None:
            if self.role.trainer_id == 0:
                self._save_own_state(name)
                self._checkpoint_remote(name)
            return
        if self.checkpoint_dir is None:
            raise PsTranspilerError("local checkpoints need a checkpoint_dir")
        Checkpointer(job_root(self.checkpoint_dir), "local", ("local",), local_layout(self.main),
                     keep=self.keep_checkpoints).save(self.scope, name)

    def _checkpoint_remote(self, name: str) -> None:
        """Trainer 0: every pserver writes its part of `name`; with a `{pserver}` template,
        the PART.jsons come back over RPC, the job manifest goes into trainer 0's own dir
        and a copy to every pserver's (`ops.rpc.own_dirs.save`): no process reads another's dir."""
        if self.checkpoint_dir is not None and is_template(self.checkpoint_dir):
            own_dirs.save(self.client, list(self.role.endpoints), self.checkpoint_dir, name,
                          self.result.plan.to_json_text(), self.keep_checkpoints)
        else:
            self.client.checkpoint_notify(list(self.role.endpoints), name)

    def _agree_restore(self, if_any: bool) -> tuple[int, dict[str, bytes]]:
        """A trainer of a job restored from a `{pserver}` template: the agreed step (trainer 0
        has the pservers restore it) and trainer 0's own state at it (trainer 0 reads it from
        its own job dir and sends it; the others receive it). A failure tells the pservers,
        so they stop at once."""
        try:
            return own_dirs.agreed_restore(self.client, list(self.role.endpoints), if_any=if_any,
                                           job_dir=job_root(self.restore_from))
        except BaseException as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            try:
                self.client.complete(self.role.endpoints, failed=True, reason=f"restore: {reason}",
                                     deadline=FAILURE_NOTICE_DEADLINE)
            except Exception:  # noqa: BLE001 - the pservers may be gone; the restore's error matters
                pass
            raise

    def report(self, loss: float | None) -> None:
        elapsed = time.monotonic() - (self._started_at or time.monotonic())
        who = str(self.role.trainer_id) if self.role.is_trainer else "local"
        rate = self.steps / elapsed if elapsed > 0 else None
        stats = self.client.stats if self.client is not None else None
        progress = Progress(who, self.steps, loss, rate, stats.bytes_sent if stats else None,
                            stats.bytes_received if stats else None, elapsed)
        print(format_progress(progress), file=self.out or sys.stdout, flush=True)
        if self._metrics is not None:
            self._metrics.report(progress, trainer=self.role.trainer_id, role="trainer" if self.role.is_trainer else "local")

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
            elif value is None and name in self.executor.lost:  # released by a step that then failed
                raise PsTranspilerError(self.executor.lost[name])
        return out

    def pull(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Whole values of `names` (default: every param, and the distributed table).
        Local: this scope's. A trainer: a dense param it receives whole each step is
        its own copy (in sync mode the pservers' values after the last step, bit for
        bit); the rest (the distributed table, blocks of a `remote_prefetch` table)
        comes from the pservers: in async mode by gets; in sync mode, where the
        pservers answer gets only between steps of every trainer, through a checkpoint
        of this step (`ckpt-<steps>`, which needs the job's `checkpoint_dir`) read back.
        The default also takes the params no pserver holds, which each trainer keeps to
        itself (batch norm's moving mean and variance): this trainer's own values."""
        if self.result is None:
            wanted = list(names) if names is not None else parameter_names(self.main)
            return {name: np.array(value) for name, value in self.params(wanted).items()}
        if self.client is None:
            raise PsTranspilerError("pull() is for trainers and local training; a pserver holds its own scope")
        plan = self.result.plan.to_json()
        params = {p["param"]: p for p in plan["params"]}
        table = plan["table"]["table"] if plan["table"] else None
        own = self._own_params()
        wanted = list(names) if names is not None else [*sorted(params), *([table] if table else []), *sorted(own)]
        out: dict[str, np.ndarray] = {}
        remote = []
        for name in wanted:
            value = self.scope.find_var(name)
            held = isinstance(value, LoDTensor) and not (value.array.size and 0 in value.array.strides)  # not fake_init
            if held and (name in params and not params[name]["remote_prefetch"] or name in own):
                out[name] = np.array(value.array)
            else:
                remote.append(name)
        if remote and not self.sync_mode:
            out |= pull(self.client, plan, remote)
        elif remote:
            if self.checkpoint_dir is None:
                raise PsTranspilerError(
                    f"a sync trainer reads {', '.join(remote)} through a checkpoint of its step: give the Session "
                    "the job's checkpoint_dir (or use `pstranspile fetch` from another process)")
            name = checkpoint_name(self.steps)
            self._checkpoint_remote(name)
            reader = CheckpointReader(job_root(self.checkpoint_dir) / name)
            out |= {var: reader.whole(var) for var in remote}
        return {name: out[name] for name in wanted}

    def _save_own_state(self, name: str) -> None:
        """Trainer 0: write the params no pserver holds into checkpoint `name`'s
        `trainer0/` (before the pservers complete it), when it knows the checkpoint dir."""
        own = self._own_params()
        if not own or self.checkpoint_dir is None:
            return
        folder = confine(job_root(self.checkpoint_dir), name)  # a template's job dir, or the shared root
        if (folder / MANIFEST).is_file():
            return  # complete already: never touch a complete checkpoint
        write_vars(folder / TRAINER_STATE, self.params(sorted(own)))

    def _own_params(self) -> set[str]:
        """The params no pserver holds, which each trainer keeps to itself (batch norm's
        moving mean and variance: persistable, marked as params by Paddle 2.x, in no
        optimizer); empty when local."""
        if self.result is None:
            return set()
        plan = self.result.plan.to_json()
        held = {p["param"] for p in plan["params"]} | ({plan["table"]["table"]} if plan["table"] else set())
        return {name for name in parameter_names(self.main) if name not in held}

    # ------------------------------------------------------------ the end
    def finish(self, *, failed: bool = False, reason: str = "") -> None:
        """Tell the pservers this trainer is done (or failed); idempotent. A job that
        checkpoints ends with one of its last step, unless that step just had one."""
        if self._finished:
            return
        self._finished = True
        self._close_metrics()
        if not failed and self.checkpoint_every and self.steps % self.checkpoint_every and self._started_at is not None:
            self.checkpoint()
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


def launcher_checkpoint_options(
    checkpoint_dir: str | Path | None, checkpoint_every: int | None, restore: str | Path | None,
    env: Mapping[str, str] | None = None,
) -> tuple[str | Path | None, int, str | Path | None]:
    """The checkpoint options a Session runs with: the ones given, else what a launcher put in
    the environment (`launch --checkpoint-dir/--checkpoint-every`, and `PSTRANSPILE_RESTORE`
    on a restart), so a script that passes None runs the same by hand and under restarts."""
    env = os.environ if env is None else env
    if checkpoint_dir is None:
        checkpoint_dir = env.get(CHECKPOINT_DIR_ENV) or None
    if checkpoint_every is None:
        text = env.get(CHECKPOINT_EVERY_ENV, "").strip() or "0"
        try:
            checkpoint_every = int(text)
        except ValueError:
            raise PsTranspilerError(f"{CHECKPOINT_EVERY_ENV}={text!r} is not an integer") from None
    if restore is None:
        restore = env.get(RESTORE_ENV) or None
    return checkpoint_dir, checkpoint_every, restore


def parameter_names(program: Program) -> list[str]:
    """The program's parameters: vars marked `is_parameter`, else (Fluid 1.x programs do
    not mark them) the `Param` args of its optimizer ops, sorted."""
    block = program.global_block()
    marked = [name for name, var in block.vars.items() if var.is_parameter]
    if marked:
        return sorted(marked)
    return sorted({name for op in block.ops for name in op.input("Param")})
