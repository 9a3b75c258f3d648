"""The life of one launched job, whatever runs its processes (`launch`'s own children on
this machine, or actors on a Ray cluster: `transpiler.runtime.ray`).

A backend places M pservers and N trainers and hands back one `ProcessHandle` per process;
`run_attempt` watches them (live status line, failure detection, stopping the rest) and
`run_job` restarts the whole job from its last complete checkpoint up to `max_restarts`
times. Sync training is consistent only at a checkpoint, so a restart restarts every
process, with `PSTRANSPILE_RESTORE` pointing at the checkpoint dir (`Session` reads it).

The job fails — every other process is stopped, the failing process's log tail is shown —
as soon as any process exits non-zero or is lost (its node died), or when the pservers have
not exited `exit_grace` seconds after the last trainer finished. It succeeds when every
process exits 0.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TextIO

from transpiler.errors import PsTranspilerError
from transpiler.runtime.progress import Progress
from transpiler.runtime.role import CHECKPOINT_DIR_ENV, CHECKPOINT_EVERY_ENV, PSERVER, RESTORE_ENV, TRAINER, Role

POLL = 0.1
TAIL_LINES = 12
SETTLE = 4.0  # seconds a failure waits for its cause to show (a lost node outranks the exits it causes)


@dataclass
class ProcessStatus:
    """One launched process, as the summary reports it."""

    role: str
    index: int
    endpoint: str | None
    log: Path
    returncode: int | None = None
    stopped: bool = False  # the launcher stopped it
    lost: str | None = None  # why the backend lost it (e.g. its node died); None while it runs or exited
    node: str | None = None  # where it ran, when the backend spans machines
    seconds: float = 0.0
    progress: Progress | None = None
    tail: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.role}.{self.index}"

    @property
    def failed(self) -> bool:
        return self.lost is not None or self.returncode not in (None, 0)

    @property
    def exit_text(self) -> str:
        if self.lost is not None:
            return "lost"
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


class ProcessHandle(Protocol):
    """What a backend gives back for each process it started."""

    status: ProcessStatus
    started: float
    ended: float | None

    def poll(self) -> int | None: ...


class Backend(Protocol):
    """Where a job's processes run. `start` is called for every pserver, then every trainer."""

    name: str

    def endpoints(self, pservers: int, trainers: int) -> list[str]: ...

    def start(self, status: ProcessStatus, role: Role, env: Mapping[str, str]) -> ProcessHandle: ...

    def refresh(self, handles: Sequence[ProcessHandle]) -> None: ...

    def stop(self, handles: Sequence[ProcessHandle], grace: float) -> None: ...

    def close(self, handles: Sequence[ProcessHandle]) -> None: ...


@dataclass(frozen=True)
class JobSpec:
    """What every attempt of a job shares (`LaunchConfig` carries it)."""

    pservers: int
    trainers: int
    sync_mode: bool
    rpc_timeout: float
    log_dir: Path
    env: Mapping[str, str]
    exit_grace: float
    stop_grace: float
    status_every: float
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    max_restarts: int = 0


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
    backend: str = "local"
    restarts: list[str] = field(default_factory=list)  # the failures the job restarted after, in order

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
        where = "" if self.backend == "local" else f" on {self.backend}"
        lines = [f"launch: {pservers} pserver(s) x {trainers} trainer(s){where}, {mode}, {self.seconds:.1f} s: {verdict}"]
        for i, failure in enumerate(self.restarts, 1):
            lines.append(f"  restart {i} after: {failure}")
        if not self.processes:
            return "\n".join(lines)
        with_node = any(p.node for p in self.processes)
        header = ("process", "endpoint", *(("node",) if with_node else ()), "exit", "steps", "loss", "steps/s", "time", "log")
        rows = [header]
        for p in self.processes:
            prog = p.progress
            rows.append(
                (
                    p.name,
                    p.endpoint or "-",
                    *((p.node or "-",) if with_node else ()),
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


def run_job(spec: JobSpec, make_backend: Callable[[], Backend], out: TextIO) -> LaunchResult:
    """Run attempts until one succeeds, is interrupted, or `max_restarts` restarts are spent;
    the last attempt's result, with the failures restarted after. Attempt k > 0 logs
    into `log_dir/restart-<k>/`."""
    restarts: list[str] = []
    started = time.monotonic()
    while True:
        extra = dict(spec.env)
        if spec.checkpoint_dir is not None:
            extra[CHECKPOINT_DIR_ENV] = str(spec.checkpoint_dir)
            if spec.checkpoint_every:
                extra[CHECKPOINT_EVERY_ENV] = str(spec.checkpoint_every)
        restore = _restore_point(spec.checkpoint_dir) if restarts else None
        if restore is not None:
            extra[RESTORE_ENV] = str(spec.checkpoint_dir)
        log_dir = spec.log_dir if not restarts else spec.log_dir / f"restart-{len(restarts)}"
        result = run_attempt(spec, make_backend(), extra, log_dir, out)
        result.seconds = time.monotonic() - started
        result.restarts = list(restarts)
        if result.ok or result.interrupted or len(restarts) >= spec.max_restarts or result.failure is None:
            _report(result, out)
            return result
        restarts.append(result.failure)
        point = _restore_point(spec.checkpoint_dir)
        origin = f"checkpoint {point.name}" if point is not None else "the start (no complete checkpoint yet)"
        print(f"launch: {result.failure}", file=out)
        print(f"launch: restart {len(restarts)} of {spec.max_restarts}, from {origin}", file=out, flush=True)


def _restore_point(checkpoint_dir: Path | None) -> Path | None:
    if checkpoint_dir is None:
        return None
    from ops.rpc.checkpoint import find_latest  # the checkpoint format; numpy only when restarting

    return find_latest(checkpoint_dir, missing_ok=True)


def run_attempt(spec: JobSpec, backend: Backend, extra: Mapping[str, str], log_dir: Path, out: TextIO) -> LaunchResult:
    """Start every process on `backend`, watch them to the end, stop what is left."""
    started = time.monotonic()
    handles: list[ProcessHandle] = []
    failure: str | None = None
    interrupted = False
    try:
        endpoints = backend.endpoints(spec.pservers, spec.trainers)
        for i, endpoint in enumerate(endpoints):
            role = Role(PSERVER, 0, spec.trainers, tuple(endpoints), endpoint, spec.sync_mode, spec.rpc_timeout)
            handles.append(backend.start(ProcessStatus(PSERVER, i, endpoint, log_dir / f"pserver.{i}.log"), role, extra))
        for i in range(spec.trainers):
            role = Role(TRAINER, i, spec.trainers, tuple(endpoints), None, spec.sync_mode, spec.rpc_timeout)
            handles.append(backend.start(ProcessStatus(TRAINER, i, None, log_dir / f"trainer.{i}.log"), role, extra))
        failure = _monitor(handles, spec, backend, out)
    except KeyboardInterrupt:
        failure, interrupted = "interrupted", True
    except PsTranspilerError as exc:  # the backend's own error (a LaunchError): the job failed to start
        failure = str(exc)
    finally:
        try:
            backend.stop(handles, spec.stop_grace)
        finally:
            backend.close(handles)
    return LaunchResult(
        ok=failure is None,
        failure=failure,
        processes=[h.status for h in handles],
        seconds=time.monotonic() - started,
        sync_mode=spec.sync_mode,
        interrupted=interrupted,
        pserver_count=spec.pservers,
        trainer_count=spec.trainers,
        backend=backend.name,
    )


def _report(result: LaunchResult, out: TextIO) -> None:
    failed = [p for p in result.processes if p.failed and not p.stopped]
    for status in failed[:1]:
        if status.tail:
            print(f"--- last lines of {status.log} ---", file=out)
            for line in status.tail:
                print(f"  {line}", file=out)
    print(result.summary(), file=out, flush=True)


def job_step(handles: Sequence[ProcessHandle]) -> int | None:
    """The furthest step any trainer reported, or None before the first report."""
    steps = [h.status.progress.step for h in handles if h.status.role == TRAINER and h.status.progress is not None]
    return max(steps) if steps else None


def failure_text(status: ProcessStatus, step: int | None) -> str:
    """`trainer.1 exited with code 3 (log: …)`; where the backend spans machines, also the node,
    and the job's step once trainers reported one."""
    where = f" on node {status.node}" if status.node else ""
    at = f" at step {step}" if step is not None else ""
    if status.lost is not None:
        return f"{status.name}{where} was lost{at}: {status.lost} (log: {status.log})"
    return f"{status.name}{where} exited with {exit_words(status.returncode)}{at} (log: {status.log})"


def _monitor(handles: list[ProcessHandle], spec: JobSpec, backend: Backend, out: TextIO) -> str | None:
    """Wait for the job's end; the failure, or None when every process exited 0."""
    trainers = [h for h in handles if h.status.role == TRAINER]
    pservers = [h for h in handles if h.status.role == PSERVER]
    trainers_done: float | None = None
    next_status = time.monotonic() + spec.status_every
    shown: tuple = ()
    live = _Status(out)
    try:
        while True:
            backend.refresh(handles)
            for handle in handles:
                handle.poll()
            if any(h.status.failed for h in handles):
                return _first_cause(handles, backend)
            now = time.monotonic()
            if all(h.status.returncode == 0 for h in trainers):
                trainers_done = trainers_done or now
                if all(h.status.returncode == 0 for h in pservers):
                    return None
                if now - trainers_done > spec.exit_grace:
                    waiting = ", ".join(h.status.name for h in pservers if h.status.returncode is None)
                    return f"{waiting} still running {spec.exit_grace:g} s after every trainer finished"
            if now >= next_status:
                next_status = now + spec.status_every
                snapshot = tuple(h.status.progress for h in trainers)
                if snapshot != shown and any(snapshot):
                    shown = snapshot
                    live.show(_status_line(trainers, now - handles[0].started, backend.name))
            time.sleep(POLL)
    finally:
        live.done()


def _first_cause(handles: list[ProcessHandle], backend: Backend) -> str:
    """The failure to report. A lost process (its node died) outranks the exits it causes
    (trainers whose pserver vanished), and a backend learns of a loss later than of an exit:
    where processes can be lost, wait up to SETTLE seconds for one to show."""
    step = job_step(handles)
    explain = getattr(backend, "explain", None)
    if explain is not None and not any(h.status.lost for h in handles):
        since = time.monotonic()
        while time.monotonic() < since + SETTLE and not any(h.status.lost for h in handles):
            time.sleep(POLL)
            backend.refresh(handles)
            if explain(handles, since):
                break
    lost = [h for h in handles if h.status.lost is not None]
    if lost:
        return failure_text(lost[0].status, step)
    failed = sorted((h for h in handles if h.status.failed), key=lambda h: h.ended or 0.0)
    return failure_text(failed[0].status, step)


def exit_words(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _status_line(trainers: list[ProcessHandle], elapsed: float, backend: str) -> str:
    parts = []
    for handle in trainers:
        prog = handle.status.progress
        if prog is None:
            parts.append(f"{handle.status.name}: starting")
            continue
        text = f"{handle.status.name}: step {prog.step}"
        if prog.loss is not None:
            text += f" loss {prog.loss:.4g}"
        if prog.steps_per_s is not None:
            text += f" {prog.steps_per_s:.3g} steps/s"
        parts.append(text)
    label = "launch" if backend == "local" else f"launch {backend}"
    return f"[{label} {elapsed:.1f}s] " + " | ".join(parts)


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
