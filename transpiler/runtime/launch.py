"""`launch`: run M pservers and N trainers of one training script, on this machine or on
a Ray cluster (`backend="ray"`, `transpiler.runtime.ray`).

    result = launch(LaunchConfig(command=("python3", "train.py"), pservers=2, trainers=2))
    result.ok, result.failure, print(result.summary())

Every process runs the same command with Paddle's environment conventions
(`transpiler.runtime.role`: `TRAINING_ROLE`, `PADDLE_PSERVER_ENDPOINTS` and Paddle 2.x's
`PADDLE_PSERVERS_IP_PORT_LIST` (both set, same list), `PADDLE_TRAINER_ID`,
`PADDLE_TRAINERS_NUM`, `PADDLE_CURRENT_ENDPOINT`, plus `PSTRANSPILE_SYNC_MODE` and
`PSTRANSPILE_RPC_TIMEOUT`, and the job's token `PSTRANSPILE_JOB_TOKEN`, made per job
unless one is set: `ops.rpc.auth`), so the script decides what to do from its role. Endpoints
default to free ports on `host`. Each process's stdout and stderr go to
`LOG_DIR/<role>.<i>.log`; trainers' progress lines (`transpiler.runtime.progress`) are shown
live, one status line per `status_every` seconds (rewritten in place on a terminal).

The job fails — every other process is stopped (SIGTERM to its process group, SIGKILL
after `stop_grace` s), the failing process's log tail is shown and `ok` is False — as
soon as any process exits non-zero (or, on Ray, is lost with its node), or when the
pservers have not exited `exit_grace` seconds after the last trainer finished
(`transpiler.runtime.job`). It succeeds when every process exits 0. With a
`checkpoint_dir` and `max_restarts` K, a failed job restarts, every process, from the
newest complete checkpoint, up to K times.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TextIO

from ops.rpc.auth import TOKEN_ENV, has_token
from ops.rpc.engine import EngineChoiceError, engine_env
from ops.rpc.env_choice import EnvChoiceError, check_env_choices
from transpiler.runtime.job import TAIL_LINES, Backend, LaunchConfig, LaunchError, LaunchResult, ProcessStatus, run_job
from transpiler.runtime.metrics import METRICS_ENV
from transpiler.runtime.progress import Progress, parse_report
from transpiler.runtime.role import Role

PACKAGE_ROOT = Path(__file__).resolve().parents[1]

__all__ = ["LaunchConfig", "LaunchError", "LaunchResult", "ProcessStatus", "free_endpoints", "job_env", "launch",
           "process_env"]


def free_endpoints(count: int, host: str = "127.0.0.1") -> list[str]:
    """`count` distinct endpoints on `host` whose ports are free right now (the OS picks
    them; all are held open together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET)
            sock.bind((host.strip("[]"), 0))
            sockets.append(sock)
        ports = [s.getsockname()[1] for s in sockets]
    except OSError as exc:
        raise LaunchError(f"cannot find free ports on {host}: {exc.strerror or exc}") from None
    finally:
        for sock in sockets:
            sock.close()
    return [f"{host}:{port}" for port in ports]


def job_env(extra: Mapping[str, str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`extra` plus, unless `base` (default `os.environ`) or `extra` already names one, a
    fresh job token (`PSTRANSPILE_JOB_TOKEN`) every process of the job shares: passed in
    the environment, which only the user can read, never on a command line, which anyone
    can (`/proc/<pid>/cmdline`)."""
    env = dict(extra)
    if not has_token({**(os.environ if base is None else base), **env}):
        env[TOKEN_ENV] = secrets.token_urlsafe(32)
    return env


BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def process_env(
    role: Role, extra: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None, *, processes: int = 1
) -> dict[str, str]:
    """The environment of one launched process: `base` (default `os.environ`), `extra`,
    the role's variables, unbuffered output, this package on `PYTHONPATH`, gRPC's I/O
    engine (`ops.rpc.engine`: set before the process imports gRPC, whatever it imports
    first), and — unless already set — BLAS threads capped at `cpu_count // processes`
    (at least 1): several processes with a thread per core each make numpy's BLAS many
    times slower. A bad `PSTRANSPILE_GRPC_ENGINE` is `LaunchError`."""
    env = dict(os.environ if base is None else base)
    env.update(extra or {})
    try:
        env.update(engine_env(env))
    except EngineChoiceError as exc:
        raise LaunchError(str(exc)) from None
    threads = str(max(1, (os.cpu_count() or 1) // max(1, processes)))
    for key in BLAS_THREAD_VARS:
        env.setdefault(key, threads)
    for key in ("TRAINING_ROLE", "PADDLE_TRAINER_ID", "PADDLE_CURRENT_ENDPOINT", "POD_IP", "PADDLE_PORT", METRICS_ENV):
        env.pop(key, None)  # never inherit another role's identity (nor a metrics file: launch writes the job's)
    env.update(role.env())
    env["PYTHONUNBUFFERED"] = "1"
    paths = [str(PACKAGE_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


class _Process:
    """A running child on this machine, its log, and the thread that copies its output there."""

    def __init__(self, status: ProcessStatus, command: Sequence[str], env: dict[str, str], cwd: Path | None) -> None:
        self.status = status
        self.started = time.monotonic()
        self.ended: float | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.lock = threading.Lock()
        status.log.parent.mkdir(parents=True, exist_ok=True)
        self.log: IO[bytes] = open(status.log, "wb")  # noqa: SIM115 - closed in close()
        try:
            self.popen = subprocess.Popen(
                list(command),
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopping it stops its children
            )
        except OSError as exc:
            self.log.close()
            raise LaunchError(f"cannot start {command[0]!r}: {exc.strerror or exc}") from None
        self.reader = threading.Thread(target=self._copy_output, name=f"log-{status.name}", daemon=True)
        self.reader.start()

    def _copy_output(self) -> None:
        assert self.popen.stdout is not None
        for raw in iter(self.popen.stdout.readline, b""):
            self.log.write(raw)
            self.log.flush()
            line = raw.decode("utf-8", "replace").rstrip("\n")
            report = parse_report(line)
            with self.lock:
                self.tail.append(line)
                if report is not None:
                    self.status.reports.append((time.monotonic(), report))  # the job's metrics file (job.py drains them)
                    if isinstance(report, Progress):
                        self.status.progress = report

    def poll(self) -> int | None:
        code = self.popen.poll()
        if code is not None and self.ended is None:
            self.ended = time.monotonic()
            self.reader.join(timeout=1.0)  # its last lines (progress) first, so a failure names the right step
            self.status.returncode = code
        return code

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def close(self) -> None:
        self.reader.join(timeout=5.0)
        self.log.close()
        end = self.ended if self.ended is not None else time.monotonic()
        self.status.seconds = end - self.started
        self.status.tail = list(self.tail)


class LocalBackend:
    """The job's processes as children of this process, on this machine."""

    name = "local"

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config

    def endpoints(self, pservers: int, trainers: int) -> list[str]:
        return list(self.config.endpoints) if self.config.endpoints else free_endpoints(pservers, self.config.host)

    def start(self, status: ProcessStatus, role: Role, env: Mapping[str, str]) -> _Process:
        total = self.config.pservers + self.config.trainers
        return _Process(status, self.config.command, process_env(role, env, processes=total), self.config.cwd)

    def refresh(self, handles: Sequence[_Process]) -> None:
        pass  # each poll() asks the OS

    def stop(self, handles: Sequence[_Process], grace: float) -> None:
        """SIGTERM every running child's process group, then SIGKILL what is left."""
        running = [p for p in handles if p.poll() is None]
        for proc in running:
            proc.status.stopped = True
            proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in running:
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.signal(signal.SIGKILL)
                proc.popen.wait()
            proc.poll()

    def close(self, handles: Sequence[_Process]) -> None:
        for proc in handles:
            proc.close()


def launch(config: LaunchConfig, *, out: TextIO | None = None, backend: Callable[[], Backend] | None = None) -> LaunchResult:
    """Run the job to its end (restarting it from its last checkpoint up to
    `config.max_restarts` times); see the module docstring. `out` gets the live status and
    the summary (default stderr). `config.backend` picks where the processes run: `local`
    (children of this process) or `ray` (actors on a Ray cluster, `transpiler.runtime.ray`)."""
    config.validate()
    try:
        check_env_choices({**os.environ, **config.env})  # a bad choice, before anything starts
    except EnvChoiceError as exc:
        raise LaunchError(str(exc)) from None
    out = out or sys.stderr
    if backend is not None:  # `transpiler.runtime.ray.run`'s own factory
        make_backend = backend
    elif config.backend == "ray":
        from transpiler.runtime.ray import RayJob  # imports ray: only for this backend

        make_backend = RayJob(config, out)
    else:
        def make_backend() -> LocalBackend:
            return LocalBackend(config)

    try:
        return run_job(config, job_env(config.env), make_backend, out)
    finally:
        closer = getattr(make_backend, "shutdown", None)
        if closer is not None:
            closer()
