"""What runs on a Ray node for one pserver or trainer of a job (`transpiler.runtime.ray`
drives it).

A `JobProcess` actor sits in its placement-group bundle and runs either the job's command
as a child process (`pstranspile launch --backend ray -- CMD ...`) or, for the Python API
(`transpiler.runtime.ray.run`), a `Session` in a thread of the actor itself. Either way it
keeps the output lines the driver has not collected yet, and the exit code. A pserver's
actor first picks a free port on its node (`reserve_endpoint`), which the driver hands to
every process as Paddle's `PADDLE_PSERVER_ENDPOINTS`.

A child dies with its actor (`PR_SET_PDEATHSIG`), and the actor with its node's raylet
(a watch thread): when Ray kills the actor, or gives up on its node, no training process is
left behind there.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transpiler.runtime.launch import process_env
from transpiler.runtime.role import Role

PR_SET_PDEATHSIG = 1
MAX_LINES_PER_POLL = 5000  # bounds one poll's answer; the rest waits for the next poll
WATCH_EVERY = 0.2  # seconds between checks that the node's raylet still runs


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that started it (alive exactly as
    long as the child, see `_Command`) goes away with the actor."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class _Lines:
    """Output lines waiting for the driver, and a file-like sink for in-process output."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: deque[str] = deque()
        self.partial = ""

    def add(self, line: str) -> None:
        with self.lock:
            self.pending.append(line)

    # file-like, for sys.stdout / sys.stderr of an in-process run
    def write(self, text: str) -> int:
        with self.lock:
            self.partial += text
            *lines, self.partial = self.partial.split("\n")
            self.pending.extend(lines)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def take(self) -> list[str]:
        with self.lock:
            count = min(len(self.pending), MAX_LINES_PER_POLL)
            return [self.pending.popleft() for _ in range(count)]

    def drain_partial(self) -> None:
        with self.lock:
            if self.partial:
                self.pending.append(self.partial)
                self.partial = ""


class JobProcess:
    """One process of a job, as a Ray actor (decorated with `ray.remote` by the driver)."""

    def __init__(self) -> None:
        self.lines = _Lines()
        self.code: int | None = None
        self.result: Any = None
        self.popen: subprocess.Popen | None = None
        self.thread: threading.Thread | None = None
        threading.Thread(target=self._leave_with_the_raylet, args=(os.getppid(),), name="raylet-watch",
                         daemon=True).start()

    def _leave_with_the_raylet(self, raylet: int) -> None:
        """Exit, with the child, once this worker's raylet (its parent) is gone. Ray declares
        such a node dead and the driver restarts the job elsewhere: a pserver left running
        there would keep serving stale state to anyone still connected to it."""
        while os.getppid() == raylet:
            time.sleep(WATCH_EVERY)
        popen = self.popen
        if popen is not None and popen.poll() is None:
            try:
                os.killpg(popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        os._exit(1)

    def where(self) -> dict[str, Any]:
        """This actor's node: Ray's node id, the node's IP, its host name, the actor's pid."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "host": socket.gethostname(), "pid": os.getpid(), "cpus": os.cpu_count() or 1}

    def reserve_endpoint(self) -> str:
        """A free port on this node's IP (the OS picks it), as `host:port`."""
        import ray

        ip = ray.util.get_node_ip_address()
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family) as sock:
            sock.bind((ip, 0))
            port = sock.getsockname()[1]
        return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"

    # ------------------------------------------------------------ running
    def run_command(self, command: Sequence[str], role: Role, extra: Mapping[str, str], processes_here: int,
                    cwd: str | None) -> None:
        """Start `command` with the role's environment (Paddle's variables, the job token,
        BLAS threads shared among the `processes_here` processes of this job on this node);
        raise OSError's message when it cannot start."""
        env = process_env(role, extra, processes=processes_here)
        started = threading.Event()
        failure: list[str] = []

        def own_the_child() -> None:  # lives exactly as long as the child: PDEATHSIG's anchor
            try:
                self.popen = subprocess.Popen(
                    list(command), env=env, cwd=cwd if cwd and os.path.isdir(cwd) else None,
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_die_with_parent,
                )
            except OSError as exc:
                failure.append(f"cannot start {command[0]!r} on {socket.gethostname()}: {exc.strerror or exc}")
                self.code = 127
                return
            finally:
                started.set()
            assert self.popen.stdout is not None
            for raw in iter(self.popen.stdout.readline, b""):
                self.lines.add(raw.decode("utf-8", "replace").rstrip("\n"))
            self.code = self.popen.wait()

        self.thread = threading.Thread(target=own_the_child, name="job-process", daemon=True)
        self.thread.start()
        started.wait()
        if failure:
            raise RuntimeError(failure[0])

    def run_session(self, train_fn: Callable | None, main: bytes, startup: bytes, role: Role,
                    extra: Mapping[str, str], processes_here: int, session_options: Mapping[str, Any]) -> None:
        """Run this role's `Session` in a thread of the actor: a pserver serves; a trainer
        starts and calls `train_fn(session, role)`, whose return value `result()` gives."""
        os.environ.update(process_env(role, extra, processes=processes_here))  # the token, checkpoint options
        sys.stdout = sys.stderr = self.lines  # the actor is this process's only job: its output is the log

        def session_thread() -> None:
            from transpiler.ir import Program
            from transpiler.runtime.session import Session

            try:
                programs = Program.from_bytes(main), Program.from_bytes(startup)
                with Session(*programs, role=role, **session_options) as session:
                    if role.is_pserver:
                        session.serve()
                    else:
                        session.start()
                        self.result = train_fn(session, role) if train_fn is not None else None
                code = 0
            except BaseException:  # noqa: BLE001 - the job's failure, reported as its log and exit code
                for line in traceback.format_exc().splitlines():
                    self.lines.add(line)
                code = 1
            self.lines.drain_partial()
            self.code = code

        self.thread = threading.Thread(target=session_thread, name="job-session", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------ watching
    def poll(self) -> tuple[int | None, list[str]]:
        """(the exit code once every output line was collected, else None; new lines)."""
        code = self.code
        lines = self.lines.take()
        if code is not None and self.lines.pending:
            code = None  # more lines first
        return code, lines

    def get_result(self) -> Any:
        return self.result

    def stop(self, grace: float) -> int | None:
        """SIGTERM the child's process group, SIGKILL after `grace` seconds; its exit code.
        (An in-process session cannot be stopped: the driver kills the actor.)"""
        popen = self.popen
        if popen is None or popen.poll() is not None:
            return self.code
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(popen.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            deadline = time.monotonic() + wait
            while popen.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if popen.poll() is not None:
                break
        return popen.poll()
