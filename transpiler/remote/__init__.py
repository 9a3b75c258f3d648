"""`RemoteExecutor`: change `Executor` to `RemoteExecutor` and a local training loop trains
on pservers and trainers (the Fluid design doc's Remote Executor, seed 001).

    exe = RemoteExecutor(job_desc=JobDesc("mnist", num_trainer=2, num_pserver=2))
    exe.run(fluid.default_startup_program())          # remembered; the job starts on the first step
    for batch in batches:
        loss, = exe.run(main, feed=batch, fetch_list=[avg_cost])   # one global batch a call
    params = exe.pull()                                 # whole params, from the job
    exe.close()                                         # or: with RemoteExecutor(...) as exe:

The first `run` of a training program transpiles it (every process does, as under
`launch`) and starts the job with `transpiler.runtime.launch` — the same code path as
`pstranspile launch`: processes here (`backend="local"`) or Ray actors
(`backend="ray"`, one placement group whose bundles take `JobDesc`'s CPUs, GPUs and memory
per role). Each process runs `python -m transpiler.remote.worker`, which connects back to
this driver (127.0.0.1 by default; `driver_host` for a cluster) over an authenticated
channel. Each `run` splits the feed's rows evenly over the trainers (trainer i gets rows
`[i*n/N, (i+1)*n/N)`; in sync mode N trainers then train exactly as local training on the
whole batch), or with `feed=None` each trainer calls `reader(trainer_id, trainers, step)`
(a picklable, importable function) for its own data. Fetched values come back averaged over
the trainers (the mean loss of the global batch, when the shares are equal), or
per trainer with `per_trainer=True`. A process that dies, or a step that raises, fails
the call with `RemoteJobError` naming the process; the job is then stopped.

Checkpoints and restarts as `launch` has them: `checkpoint_dir` + `checkpoint_every` N
(trainer 0 asks the pservers for a checkpoint every N steps), `keep_checkpoints`,
`restore` (a checkpoint dir: the job starts from its newest complete checkpoint and
`steps` is that checkpoint's), `init` (Fluid LoDTensor files) and `max_restarts` K: a
failed job (a process lost, a step raising) is restarted by `launch`, every process, from
the newest complete checkpoint, up to K times; the driver then resends the global batches
of the steps after that checkpoint (it keeps those of the last two checkpoint periods; a
reader is simply called again with those step numbers) and retries the failed call, so
the loop goes on as if nothing happened (`restarts` lists the failures).
"""

from __future__ import annotations

import os
import pickle
import secrets
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import numpy as np

from transpiler.errors import PsTranspilerError
from transpiler.frontend import default_startup_program
from transpiler.ir import Program
from transpiler.ir.types import OpRole
from transpiler.remote.worker import DRIVER_ENV, KEY_ENV
from transpiler.runtime.job import LaunchConfig, LaunchResult
from transpiler.runtime.launch import launch

CONNECT_TIMEOUT = 120.0  # seconds for every process to start, transpile and connect back
POLL = 0.2  # seconds between looks at the job while waiting for the trainers


class RemoteJobError(PsTranspilerError):
    """The job failed: a process died or a step raised (the message names it)."""


class _Lost(Exception):
    """A trainer's answer did not come (its process or another died, or a step raised)
    while `launch` may still restart the job."""


@dataclass(frozen=True)
class JobDesc:
    """The job's shape and resources (the design doc's `JobDesc`, in its order). Memory in
    bytes (Ray's unit); CPUs and GPUs may be fractions. GPUs and memory are Ray resources:
    the local backend runs every process on this machine and ignores them."""

    jobname: str = "job"
    num_trainer: int = 1
    num_pserver: int = 1
    cpu_per_trainer: float = 1.0
    gpu_per_trainer: float = 0.0
    mem_per_trainer: int | None = None
    cpu_per_pserver: float = 1.0
    mem_per_pserver: int | None = None

    def validate(self) -> None:
        for what, count in (("num_trainer", self.num_trainer), ("num_pserver", self.num_pserver)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise PsTranspilerError(f"JobDesc.{what} must be an integer >= 1, got {count!r}")
        for what, value in (("cpu_per_trainer", self.cpu_per_trainer), ("cpu_per_pserver", self.cpu_per_pserver)):
            if not value > 0:
                raise PsTranspilerError(f"JobDesc.{what} must be positive, got {value!r}")
        if self.gpu_per_trainer < 0:
            raise PsTranspilerError(f"JobDesc.gpu_per_trainer must be >= 0, got {self.gpu_per_trainer!r}")
        for what, value in (("mem_per_trainer", self.mem_per_trainer), ("mem_per_pserver", self.mem_per_pserver)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise PsTranspilerError(f"JobDesc.{what} must be a positive number of bytes, got {value!r}")

    def resources(self, pserver: bool) -> dict[str, float]:
        """The Ray resources of one process of this role: `CPU`, and `GPU`/`memory` when set."""
        if pserver:
            out = {"CPU": float(self.cpu_per_pserver)}
            if self.mem_per_pserver:
                out["memory"] = float(self.mem_per_pserver)
            return out
        out = {"CPU": float(self.cpu_per_trainer)}
        if self.gpu_per_trainer:
            out["GPU"] = float(self.gpu_per_trainer)
        if self.mem_per_trainer:
            out["memory"] = float(self.mem_per_trainer)
        return out


def _name(item: Any) -> str:
    if isinstance(item, str):
        return item
    name = getattr(item, "name", None)
    if not isinstance(name, str):
        raise PsTranspilerError(f"fetch_list takes Variables or names, got {type(item).__name__}")
    return name


def _is_startup(program: Program) -> bool:
    """A startup program: no backward or optimize op, and every var it names persistable
    (initializers of params, accumulators, the learning rate)."""
    block = program.global_block()
    if not block.ops or any(op.role & (OpRole.Backward | OpRole.Optimize) for op in block.ops):
        return False
    return all(block.find_var(n) is None or block.find_var(n).persistable
               for op in block.ops for n in op.output_names)


class RemoteExecutor:
    """See the module docstring. `transpile_options` (e.g. `sync_mode`, `config`,
    `split_method`, `min_block_size`, `seed`) go to every process's `Session`;
    `checkpoint_dir`/`checkpoint_every`/`keep_checkpoints`/`restore`/`init`/`max_restarts`
    as `Session` and `launch` take them."""

    def __init__(
        self,
        job_desc: JobDesc | None = None,
        backend: str = "local",
        address: str | None = None,
        *,
        reader: Callable[[int, int, int], Mapping[str, Any]] | None = None,
        startup_program: Program | None = None,
        sync_mode: bool = True,
        log_dir: str | Path | None = None,
        driver_host: str = "127.0.0.1",
        rpc_timeout: float = 60.0,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 0,
        restore: str | Path | None = None,
        init: str | Path | None = None,
        max_restarts: int = 0,
        env: Mapping[str, str] | None = None,
        **transpile_options: Any,
    ) -> None:
        self.job_desc = job_desc if job_desc is not None else JobDesc()
        self.job_desc.validate()
        if backend not in ("local", "ray"):
            raise PsTranspilerError(f"unknown backend {backend!r}; expected 'local' or 'ray'")
        if backend != "ray" and address is not None:
            raise PsTranspilerError("an address is for the ray backend")
        if reader is not None and not callable(reader):
            raise PsTranspilerError(f"reader must be callable, got {type(reader).__name__}")
        if reader is not None and getattr(reader, "__module__", None) == "__main__":
            raise PsTranspilerError("the reader runs in the trainers, which import it by name: define it in a module, "
                                    "not in the __main__ script")
        self.backend, self.address, self.reader = backend, address, reader
        self.startup_program = startup_program
        self.sync_mode = bool(sync_mode)
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix=f"{self.job_desc.jobname}-"))
        self.driver_host, self.rpc_timeout = driver_host, float(rpc_timeout)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = int(checkpoint_every)
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise PsTranspilerError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
        if max_restarts and (self.checkpoint_dir is None or self.checkpoint_every < 1):
            raise PsTranspilerError("max_restarts resumes from a checkpoint: give checkpoint_dir and "
                                    "checkpoint_every (the driver resends the batches since the last one)")
        self.max_restarts = max_restarts
        self.restarts: list[str] = []  # why each restart happened
        self._history: list[tuple[int, list[Any], list[str]]] = []  # (step, shares, fetches) to resend
        self._job: bytes | None = None
        self.restore, self.init = restore, init
        self.env = dict(env or {})
        self.transpile_options = transpile_options
        self.program: Program | None = None
        self.steps = 0
        self._trainers: dict[int, Any] = {}
        self.pids: dict[str, int] = {}  # "trainer 0", "pserver 127.0.0.1:6170" -> its process id (on its node)
        self._listener: Listener | None = None
        self._thread: threading.Thread | None = None
        self._result: LaunchResult | None = None
        self._launch_error: BaseException | None = None
        self._closed = False
        self._failed: str | None = None

    # ------------------------------------------------------------ the job
    @property
    def trainers(self) -> int:
        return self.job_desc.num_trainer

    def _config(self, key: str) -> LaunchConfig:
        host, port = self._listener.address[:2]
        env = {**self.env, DRIVER_ENV: f"{host}:{port}", KEY_ENV: key}
        root = _import_root(self.reader)
        if root is not None:  # the workers import the reader's module by name
            paths = [root, *[p for p in env.get("PYTHONPATH", os.environ.get("PYTHONPATH", "")).split(os.pathsep) if p]]
            env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        resources = None
        if self.backend == "ray":
            resources = {"pserver": self.job_desc.resources(True), "trainer": self.job_desc.resources(False)}
        return LaunchConfig(
            command=(sys.executable, "-m", "transpiler.remote.worker"), pservers=self.job_desc.num_pserver,
            trainers=self.trainers, sync_mode=self.sync_mode, log_dir=self.log_dir, rpc_timeout=self.rpc_timeout,
            env=env, status_every=3600.0, exit_grace=30.0, backend=self.backend, address=self.address,
            cpus_per_process=float(self.job_desc.cpu_per_trainer), checkpoint_dir=self.checkpoint_dir,
            checkpoint_every=self.checkpoint_every, resources=resources, max_restarts=self.max_restarts,
            restart_while=self._wants_restart,
        )

    def _wants_restart(self) -> bool:
        """`launch` asks before each restart: not once this driver gave up or closed."""
        return self._failed is None and not self._closed

    def start(self, program: Program) -> None:
        """Transpile `program` (with the startup program) and start the job; the first
        `run` of a training program calls it."""
        if self.program is not None:
            raise PsTranspilerError("this RemoteExecutor already runs a program; close() it first")
        if self._closed:
            raise PsTranspilerError("this RemoteExecutor is closed")
        startup = self.startup_program if self.startup_program is not None else default_startup_program()
        session = {"sync_mode": self.sync_mode, **self.transpile_options}
        if self.restore is not None:
            session["restore"] = str(self.restore)
        if self.init is not None:
            session["init"] = str(self.init)
        job = pickle.dumps({"main": program.to_bytes(), "startup": startup.to_bytes(), "session": session,
                            "reader": pickle.dumps(self.reader) if self.reader is not None else None})
        key = secrets.token_hex(32)
        self._listener = Listener((self.driver_host, 0), authkey=key.encode())
        config = self._config(key)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.program = program
        self._thread = threading.Thread(target=self._launch, args=(config,), name="remote-job", daemon=True)
        self._thread.start()
        self._job = job
        self._accept(job)
        self.steps = self._ask_all({0: ("steps",)}, "report its step")[0]  # restored: the checkpoint's

    def _launch(self, config: LaunchConfig) -> None:
        try:
            with open(self.log_dir / "launch.txt", "w") as out:
                self._result = launch(config, out=out)
        except BaseException as exc:  # noqa: BLE001 - reported by the driver's next call
            self._launch_error = exc

    def _job_failure(self) -> str | None:
        """Why the job ended, once it did (None while it runs)."""
        if self._thread is not None and self._thread.is_alive():
            return None
        if self._launch_error is not None:
            return f"the job could not run: {self._launch_error}"
        if self._result is not None and not self._result.ok:
            return self._result.failure or "the job failed"
        return "the job ended"

    def _accept(self, job: bytes, restartable: bool = False) -> None:
        """Take every process's connection: give each the job; keep the trainers'."""
        accepted: list[Any] = []
        done = threading.Event()

        def accept_all() -> None:
            expected = self.trainers + self.job_desc.num_pserver
            while len(accepted) < expected and not done.is_set():
                try:
                    accepted.append(self._listener.accept())
                except (OSError, EOFError):
                    if done.is_set():
                        return
                    continue  # a connection that failed authentication: not one of ours

        acceptor = threading.Thread(target=accept_all, name="remote-accept", daemon=True)
        acceptor.start()
        deadline = time.monotonic() + CONNECT_TIMEOUT
        seen = 0
        expected = self.trainers + self.job_desc.num_pserver
        while len(self.pids) < expected:
            while seen < len(accepted):
                conn = accepted[seen]
                seen += 1
                if not conn.poll(10.0):
                    continue
                _, kind, who, pid = conn.recv()
                conn.send_bytes(job)
                self.pids[f"{kind} {who}"] = int(pid)
                if kind == "trainer":
                    self._trainers[int(who)] = conn
            failure = self._job_failure()
            if failure is not None:
                self._fail(failure)
            if time.monotonic() > deadline:
                self._fail(f"only {len(self.pids)} of {expected} process(es) connected within "
                           f"{CONNECT_TIMEOUT:g} s (logs: {self.log_dir})")
            time.sleep(0.05)
        done.set()
        for trainer in sorted(self._trainers):
            self._reply(trainer, "start the job", restartable)

    def _fail(self, message: str) -> None:
        self._failed = message
        self._stop()
        raise RemoteJobError(message)

    def _reply(self, trainer: int, what: str, restartable: bool = False) -> Any:
        """Trainer `trainer`'s answer; a dead process or a raised step is `RemoteJobError`."""
        conn = self._trainers[trainer]
        while True:
            try:
                if conn.poll(POLL):
                    answer = conn.recv()
                    break
            except (EOFError, OSError):
                answer = None
                break
            failure = self._job_failure()
            if failure is not None:
                self._fail(f"{what}: the job failed: {failure}")
        if answer is None:
            if restartable and self._can_restart():
                raise _Lost(f"{what}: trainer {trainer} lost its connection")
            if self._thread is not None:
                self._thread.join(timeout=15.0)  # let launch name the process that died
            self._fail(f"{what}: the job failed: {self._job_failure() or f'trainer {trainer} lost its connection'}")
        if answer[0] == "error":
            if restartable and self._can_restart():
                raise _Lost(f"{what}: trainer {trainer} raised {answer[1]}")
            self._fail(f"{what}: trainer {trainer} raised {answer[1]}")
        return answer[1]

    def _can_restart(self) -> bool:
        return len(self.restarts) < self.max_restarts and self._failed is None and (
            self._thread is not None and self._thread.is_alive())

    def _recover(self, lost: _Lost) -> None:
        """`launch` restarts the job from its newest complete checkpoint: take the new
        processes' connections, then resend the steps after that checkpoint."""
        self.restarts.append(str(lost))
        for conn in self._trainers.values():
            try:
                conn.close()
            except OSError:
                pass
        self._trainers, self.pids = {}, {}
        self._accept(self._job, restartable=True)
        restored = self._ask_all({0: ("steps",)}, "report its step after the restart", True)[0]
        replay = [entry for entry in self._history if restored < entry[0] <= self.steps]
        if restored > self.steps or len(replay) != self.steps - restored:
            self._fail(f"restart {len(self.restarts)}: the job restored step {restored}, but this driver keeps the "
                       f"batches of steps {self._history[0][0] if self._history else self.steps + 1}..{self.steps} "
                       "only; it cannot go on")
        for step, shares, fetches in replay:
            self._ask_all({i: ("run", shares[i], fetches) for i in range(self.trainers)}, f"resend step {step}", True)

    def _step(self, shares: list[Any], fetches: list[str]) -> dict[int, Any]:
        """One step on every trainer; after a restart (`max_restarts`), the resent steps, then this."""
        step, lost = self.steps + 1, None
        while True:
            try:
                if lost is not None:
                    self._recover(lost)
                values = self._ask_all({i: ("run", shares[i], fetches) for i in range(self.trainers)},
                                       f"step {step}", restartable=True)
                break
            except _Lost as again:
                lost = again
        if self.max_restarts:  # the batches since the checkpoint before the newest one
            self._history.append((step, shares, fetches))
            every = self.checkpoint_every
            oldest = (step // every) * every - every
            self._history = [entry for entry in self._history if entry[0] > oldest]
        return values

    def _ask_all(self, messages: Mapping[int, tuple], what: str, restartable: bool = False) -> dict[int, Any]:
        if self._failed is not None:
            raise RemoteJobError(f"the job failed earlier: {self._failed}")
        for trainer in sorted(messages):
            try:
                self._trainers[trainer].send(messages[trainer])
            except (OSError, EOFError):
                pass  # the reply wait reports it
        return {trainer: self._reply(trainer, what, restartable) for trainer in sorted(messages)}

    # ------------------------------------------------------------ running
    def shard(self, feed: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Each trainer's contiguous, equal share of every array in `feed`."""
        out: list[dict[str, Any]] = [{} for _ in range(self.trainers)]
        for name, value in feed.items():
            array = np.asarray(value)
            rows = len(array) if array.ndim else 0
            if rows % self.trainers:
                raise PsTranspilerError(f"feed {name!r} has {rows} rows, which do not split evenly over "
                                        f"{self.trainers} trainers")
            for i in range(self.trainers):
                out[i][name] = array[rows * i // self.trainers: rows * (i + 1) // self.trainers]
        return out

    def run(
        self,
        program: Program | None = None,
        feed: Mapping[str, Any] | None = None,
        fetch_list: Sequence[Any] | None = None,
        *,
        per_trainer: bool = False,
        **_executor_options: Any,
    ) -> list[Any]:
        """One step on one global batch (see the module docstring). Running a startup
        program only records it: the job's pservers initialise the params."""
        if program is None:
            from transpiler.frontend import default_main_program

            program = default_main_program()
        if self.program is None and (program is self.startup_program or program is default_startup_program()
                                     or _is_startup(program)):
            self.startup_program = program
            return []
        if feed is None and self.reader is None:
            raise PsTranspilerError("run(feed=None) needs a reader: RemoteExecutor(..., reader=fn)")
        if self.program is None:
            self.start(program)
        elif program is not self.program:
            raise PsTranspilerError("a RemoteExecutor runs one training program; this is another "
                                    "(use a second RemoteExecutor for it)")
        if isinstance(fetch_list, (str,)) or hasattr(fetch_list, "name"):
            fetch_list = [fetch_list]
        fetches = [_name(item) for item in (fetch_list or ())]
        shares = self.shard(feed) if feed is not None else [None] * self.trainers
        values = self._step(shares, fetches)
        self.steps += 1
        per = [values[i] for i in range(self.trainers)]
        if per_trainer:
            return per
        return [_average([row[k] for row in per]) for k in range(len(fetches))]

    def pull(self, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Whole values of `names` (default: every param), read by trainer 0 (`Session.pull`)."""
        if self.program is None:
            raise PsTranspilerError("pull() before the job started: run a training step (or start()) first")
        return self._ask_all({0: ("pull", list(names) if names is not None else None)}, "pull params")[0]

    # ------------------------------------------------------------ the end
    def close(self) -> LaunchResult | None:
        """Tell the trainers to finish (the pservers then stop) and wait for the job; the
        launch result (None if the job never started). Idempotent."""
        if self._closed:
            return self._result
        self._closed = True
        if self.program is not None and self._failed is None:
            try:
                self._ask_all({i: ("close",) for i in sorted(self._trainers)}, "close")
            except RemoteJobError:
                pass
            if self._thread is not None:
                self._thread.join(timeout=60.0)
        self._stop()
        return self._result

    def _stop(self) -> None:
        for conn in self._trainers.values():
            try:
                conn.close()
            except OSError:
                pass
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=60.0)  # a lost connection makes the workers exit; launch stops the rest

    def __enter__(self) -> RemoteExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _import_root(function: Any) -> str | None:
    """The folder from which `function`'s module imports by its name (None: no file)."""
    module = sys.modules.get(getattr(function, "__module__", "") or "")
    path = getattr(module, "__file__", None)
    if function is None or module is None or path is None or module.__name__ == "__main__":
        return None
    folder = Path(path).resolve().parent
    for _ in range(module.__name__.count(".") + (Path(path).name == "__init__.py")):
        folder = folder.parent
    return str(folder)


def _average(values: list[Any]) -> Any:
    arrays = [np.asarray(v) for v in values]
    if all(a.dtype.kind == "f" for a in arrays) and len({a.shape for a in arrays}) == 1:
        return np.mean(np.stack(arrays), axis=0).astype(arrays[0].dtype)
    return arrays[0] if len(arrays) == 1 else arrays


__all__ = ["JobDesc", "RemoteExecutor", "RemoteJobError"]
