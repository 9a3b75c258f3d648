"""`launch`: run M pservers and N trainers of one training script on this machine.

    result = launch(LaunchConfig(command=("python3", "train.py"), pservers=2, trainers=2))
    result.ok, result.failure, print(result.summary())

Every process runs the same command with Paddle's environment conventions
(`transpiler.runtime.role`: `TRAINING_ROLE`, `PADDLE_PSERVER_ENDPOINTS`, `PADDLE_TRAINER_ID`,
`PADDLE_TRAINERS_NUM`, `PADDLE_CURRENT_ENDPOINT`, plus `PSTRANSPILE_SYNC_MODE` and
`PSTRANSPILE_RPC_TIMEOUT`, and the job's token `PSTRANSPILE_JOB_TOKEN`, made per job
unless one is set: `ops.rpc.auth`), so the script decides what to do from its role. Endpoints
default to free ports on `host`. Each process's stdout and stderr go to
`LOG_DIR/<role>.<i>.log`; trainers' progress lines (`transpiler.runtime.progress`) are shown
live, one status line per `status_every` seconds (rewritten in place on a terminal).

The job fails — every other process is stopped (SIGTERM to its process group, SIGKILL
after `stop_grace` s), the failing process's log tail is shown and `ok` is False — as
soon as any process exits non-zero, or when the pservers have not exited `exit_grace`
seconds after the last trainer finished. It succeeds when every process exits 0.
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TextIO

from ops.rpc.auth import TOKEN_ENV, has_token
from ops.rpc.service import DEFAULT_TIMEOUT
from transpiler.config import parse_endpoints
from transpiler.errors import PsTranspilerError
from transpiler.runtime.progress import Progress, parse_progress
from transpiler.runtime.role import PSERVER, TRAINER, Role

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
POLL = 0.1
TAIL_LINES = 12


class LaunchError(PsTranspilerError):
    """A launch configuration that cannot run (bad counts, endpoints, command)."""


@dataclass(frozen=True)
class LaunchConfig:
    command: tuple[str, ...]
    pservers: int = 1
    trainers: int = 1
    sync_mode: bool = True
    host: str = "127.0.0.1"
    endpoints: tuple[str, ...] | None = None  # default: free ports on `host`
    log_dir: Path = Path("logs")
    rpc_timeout: float = DEFAULT_TIMEOUT
    env: Mapping[str, str] = field(default_factory=dict)  # extra variables for every process
    exit_grace: float = 30.0  # seconds the pservers get to exit after the trainers finished
    stop_grace: float = 5.0  # seconds between SIGTERM and SIGKILL when stopping
    status_every: float = 2.0  # seconds between live progress lines
    cwd: Path | None = None

    def validate(self) -> None:
        if not self.command:
            raise LaunchError("no command to launch (put it after `--`)")
        for what, count in (("pservers", self.pservers), ("trainers", self.trainers)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise LaunchError(f"{what} must be an integer >= 1, got {count!r}")
        if self.endpoints is not None:
            try:
                endpoints = parse_endpoints(list(self.endpoints))
            except PsTranspilerError as exc:
                raise LaunchError(str(exc)) from None
            if len(endpoints) != self.pservers:
                raise LaunchError(f"{len(endpoints)} endpoint(s) given for {self.pservers} pserver(s)")
        if not self.rpc_timeout > 0:
            raise LaunchError(f"the RPC timeout must be positive, got {self.rpc_timeout}")


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
    the role's variables, unbuffered output, this package on `PYTHONPATH`, and — unless
    already set — BLAS threads capped at `cpu_count // processes` (at least 1): several
    processes with a thread per core each make numpy's BLAS many times slower."""
    env = dict(os.environ if base is None else base)
    env.update(extra or {})
    threads = str(max(1, (os.cpu_count() or 1) // max(1, processes)))
    for key in BLAS_THREAD_VARS:
        env.setdefault(key, threads)
    for key in ("TRAINING_ROLE", "PADDLE_TRAINER_ID", "PADDLE_CURRENT_ENDPOINT", "POD_IP", "PADDLE_PORT"):
        env.pop(key, None)  # never inherit another role's identity
    env.update(role.env())
    env["PYTHONUNBUFFERED"] = "1"
    paths = [str(PACKAGE_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


@dataclass
class ProcessStatus:
    """One launched process, as the summary reports it."""

    role: str
    index: int
    endpoint: str | None
    log: Path
    returncode: int | None = None
    stopped: bool = False  # the launcher stopped it
    seconds: float = 0.0
    progress: Progress | None = None
    tail: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.role}.{self.index}"

    @property
    def exit_text(self) -> str:
        if self.stopped:
            return "stopped"
        if self.returncode is None:
            return "?"
        if self.returncode < 0:
            try:
                return signal.Signals(-self.returncode).name
            except ValueError:
                return f"signal {-self.returncode}"
        return str(self.returncode)


@dataclass
class LaunchResult:
    ok: bool
    failure: str | None
    processes: list[ProcessStatus]
    seconds: float
    sync_mode: bool = True
    interrupted: bool = False
    # The configured counts (None: count `processes`); the job may fail before all start.
    pserver_count: int | None = None
    trainer_count: int | None = None

    def trainers(self) -> list[ProcessStatus]:
        return [p for p in self.processes if p.role == TRAINER]

    def summary(self) -> str:
        """A table of every process, and the verdict."""
        pservers = sum(p.role == PSERVER for p in self.processes) if self.pserver_count is None else self.pserver_count
        trainers = len(self.trainers()) if self.trainer_count is None else self.trainer_count
        mode = "sync" if self.sync_mode else "async"
        verdict = "ok" if self.ok else f"FAILED: {self.failure}"
        if len(self.processes) < pservers + trainers:
            verdict += f" ({len(self.processes)} of {pservers + trainers} processes started)"
        lines = [f"launch: {pservers} pserver(s) x {trainers} trainer(s), {mode}, {self.seconds:.1f} s: {verdict}"]
        if not self.processes:
            return lines[0]
        header = ("process", "endpoint", "exit", "steps", "loss", "steps/s", "time", "log")
        rows = [header]
        for p in self.processes:
            prog = p.progress
            rows.append(
                (
                    p.name,
                    p.endpoint or "-",
                    p.exit_text,
                    str(prog.step) if prog else "-",
                    f"{prog.loss:.6g}" if prog and prog.loss is not None else "-",
                    f"{prog.steps_per_s:.3g}" if prog and prog.steps_per_s is not None else "-",
                    f"{p.seconds:.1f}s",
                    str(p.log),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        for row in rows:
            lines.append("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        return "\n".join(lines)


class _Process:
    """A running child, its log, and the thread that copies its output there."""

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
            progress = parse_progress(line)
            with self.lock:
                self.tail.append(line)
                if progress is not None:
                    self.status.progress = progress

    def poll(self) -> int | None:
        code = self.popen.poll()
        if code is not None and self.ended is None:
            self.ended = time.monotonic()
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


def launch(config: LaunchConfig, *, out: TextIO | None = None) -> LaunchResult:
    """Run the job to its end; see the module docstring. `out` gets the live status and
    the summary (default stderr)."""
    config.validate()
    out = out or sys.stderr
    endpoints = list(config.endpoints) if config.endpoints else free_endpoints(config.pservers, config.host)
    extra = job_env(config.env)
    log_dir = Path(config.log_dir)
    started = time.monotonic()
    procs: list[_Process] = []
    failure: str | None = None
    interrupted = False
    total = config.pservers + config.trainers
    try:
        for i, endpoint in enumerate(endpoints):
            role = Role(PSERVER, 0, config.trainers, tuple(endpoints), endpoint, config.sync_mode, config.rpc_timeout)
            status = ProcessStatus(PSERVER, i, endpoint, log_dir / f"pserver.{i}.log")
            procs.append(_Process(status, config.command, process_env(role, extra, processes=total), config.cwd))
        for i in range(config.trainers):
            role = Role(TRAINER, i, config.trainers, tuple(endpoints), None, config.sync_mode, config.rpc_timeout)
            status = ProcessStatus(TRAINER, i, None, log_dir / f"trainer.{i}.log")
            procs.append(_Process(status, config.command, process_env(role, extra, processes=total), config.cwd))
        failure = _monitor(procs, config, out)
    except KeyboardInterrupt:
        failure, interrupted = "interrupted", True
    except LaunchError as exc:
        failure = str(exc)
    finally:
        _stop_all(procs, config.stop_grace)
        for proc in procs:
            proc.close()
    result = LaunchResult(
        ok=failure is None,
        failure=failure,
        processes=[p.status for p in procs],
        seconds=time.monotonic() - started,
        sync_mode=config.sync_mode,
        interrupted=interrupted,
        pserver_count=config.pservers,
        trainer_count=config.trainers,
    )
    failed = [p.status for p in procs if p.status.returncode not in (0, None) and not p.status.stopped]
    for status in failed[:1]:
        if status.tail:
            print(f"--- last lines of {status.log} ---", file=out)
            for line in status.tail:
                print(f"  {line}", file=out)
    print(result.summary(), file=out, flush=True)
    return result


def _monitor(procs: list[_Process], config: LaunchConfig, out: TextIO) -> str | None:
    """Wait for the job's end; the failure, or None when every process exited 0."""
    trainers = [p for p in procs if p.status.role == TRAINER]
    pservers = [p for p in procs if p.status.role == PSERVER]
    trainers_done: float | None = None
    next_status = time.monotonic() + config.status_every
    shown: tuple = ()
    live = _Status(out)
    try:
        while True:
            for proc in procs:
                proc.poll()
            failed = sorted((p for p in procs if p.status.returncode not in (None, 0)), key=lambda p: p.ended or 0.0)
            if failed:
                first = failed[0].status
                return f"{first.name} exited with {_exit_words(first.returncode)} (log: {first.log})"
            now = time.monotonic()
            if all(p.status.returncode == 0 for p in trainers):
                trainers_done = trainers_done or now
                if all(p.status.returncode == 0 for p in pservers):
                    return None
                if now - trainers_done > config.exit_grace:
                    waiting = ", ".join(p.status.name for p in pservers if p.status.returncode is None)
                    return f"{waiting} still running {config.exit_grace:g} s after every trainer finished"
            if now >= next_status:
                next_status = now + config.status_every
                snapshot = tuple((p.status.progress for p in trainers))
                if snapshot != shown and any(snapshot):
                    shown = snapshot
                    live.show(_status_line(trainers, now - procs[0].started))
            time.sleep(POLL)
    finally:
        live.done()


def _exit_words(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _status_line(trainers: list[_Process], elapsed: float) -> str:
    parts = []
    for proc in trainers:
        prog = proc.status.progress
        if prog is None:
            parts.append(f"{proc.status.name}: starting")
            continue
        text = f"{proc.status.name}: step {prog.step}"
        if prog.loss is not None:
            text += f" loss {prog.loss:.4g}"
        if prog.steps_per_s is not None:
            text += f" {prog.steps_per_s:.3g} steps/s"
        parts.append(text)
    return f"[launch {elapsed:.1f}s] " + " | ".join(parts)


class _Status:
    """Live status lines: rewritten in place on a terminal, appended otherwise."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.dirty = False

    def show(self, line: str) -> None:
        if self.tty:
            self.out.write("\r\x1b[K" + line)
            self.dirty = True
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def done(self) -> None:
        if self.dirty:
            self.out.write("\n")
            self.out.flush()


def _stop_all(procs: list[_Process], grace: float) -> None:
    """SIGTERM every running child's process group, then SIGKILL what is left."""
    running = [p for p in procs if p.poll() is None]
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
