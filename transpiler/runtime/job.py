"""The life of one launched job, whatever runs its processes (`launch`'s own children on
this machine, or actors on a Ray cluster: `transpiler.runtime.ray`).

`LaunchConfig` says what the job is. A backend places M pservers and N trainers and hands
back one `ProcessHandle` per process;
`run_attempt` watches them (live status line, failure detection, stopping the rest) and
`run_job` restarts the whole job from its last complete checkpoint up to `max_restarts`
times. Sync training is consistent only at a checkpoint, so a restart restarts every
process, with `PSTRANSPILE_RESTORE` pointing at the checkpoint dir (`Session` reads it).
A restart that fails the same way as the restart before it (the same process, exit and
error line, from the same checkpoint, before any trainer passed that checkpoint's step: a
deterministic restore error) stops the job with that reason instead of spending the rest.

The job fails — every other process is stopped, the failing process's log tail is shown —
as soon as any process exits non-zero or is lost (its node died), or when the pservers have
not exited `exit_grace` seconds after the last trainer finished. It succeeds when every
process exits 0.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TextIO

from ops.rpc.service import DEFAULT_TIMEOUT
from transpiler.config import parse_endpoints
from transpiler.errors import PsTranspilerError
from transpiler.runtime.metrics import METRICS_FILE, MetricsWriter
from transpiler.runtime.progress import Progress
from transpiler.runtime.role import (
    CHECKPOINT_DIR_ENV,
    CHECKPOINT_EVERY_ENV,
    PSERVER,
    RESTORE_ENV,
    RESTORE_IF_ANY_ENV,
    TRAINER,
    Role,
)

POLL = 0.1
TAIL_LINES = 12
SETTLE = 4.0  # seconds a failure waits for its cause to show (a lost node outranks the exits it causes)
STATUS_WIDTH = 200  # characters of a live status line: past it, one summary for every trainer


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
    # (time.monotonic() when read, parsed progress or usage line) not yet in the metrics file
    reports: list = field(default_factory=list)

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


BACKENDS = ("local", "ray")
PLACEMENTS = ("spread", "pack")


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
    # Checkpoints and restarts (any backend): every process gets the dir and cadence
    # (`PSTRANSPILE_CHECKPOINT_DIR`/`_EVERY`); a failed job restarts up to `max_restarts`
    # times, from the newest complete checkpoint there (`PSTRANSPILE_RESTORE`).
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    max_restarts: int = 0
    # Asked before each restart (None: always restart): False ends the job instead, e.g. a
    # `RemoteExecutor` whose driver gave up on it.
    restart_while: Callable[[], bool] | None = field(default=None, compare=False, repr=False)
    # Where the processes run: `local`, or `ray` (`transpiler.runtime.ray`): a Ray cluster at
    # `address` (None: a local, loopback-only Ray instance), one placement-group bundle of
    # `cpus_per_process` CPUs per process, bundles spread over nodes or packed.
    backend: str = "local"
    address: str | None = None
    placement: str = "spread"
    cpus_per_process: float = 1.0
    # The job's metrics as TensorBoard event files too (needs tensorboardX); the metrics
    # file LOG_DIR/metrics.jsonl is written anyway.
    tensorboard_dir: Path | None = None
    # Ray only: a process's resources per role (`pserver`, `trainer`): `CPU`, `GPU`, `memory`
    # (bytes), one placement-group bundle each; a role not given gets `cpus_per_process` CPUs.
    resources: Mapping[str, Mapping[str, float]] | None = None

    def bundle(self, role: str) -> dict[str, float]:
        """The Ray resources of one process of `role` (`pserver` or `trainer`)."""
        return dict((self.resources or {}).get(role) or {"CPU": self.cpus_per_process})

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
        if self.backend not in BACKENDS:
            raise LaunchError(f"unknown backend {self.backend!r}; expected one of: {', '.join(BACKENDS)}")
        if self.placement not in PLACEMENTS:
            raise LaunchError(f"unknown placement {self.placement!r}; expected one of: {', '.join(PLACEMENTS)}")
        if self.backend == "ray" and self.endpoints is not None:
            raise LaunchError("the ray backend places the pservers itself; endpoints cannot be given")
        if self.backend != "ray" and self.address is not None:
            raise LaunchError("an address is for the ray backend (--backend ray)")
        if not self.cpus_per_process > 0:
            raise LaunchError(f"cpus per process must be positive, got {self.cpus_per_process:g}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise LaunchError(f"max restarts must be an integer >= 0, got {self.max_restarts!r}")
        if self.checkpoint_every < 0:
            raise LaunchError(f"checkpoint every must be >= 0 steps, got {self.checkpoint_every}")
        if self.max_restarts and self.checkpoint_dir is None:
            raise LaunchError("restarts resume from a checkpoint: give a checkpoint dir (--checkpoint-dir)")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise LaunchError("a checkpoint cadence needs a checkpoint dir (--checkpoint-dir)")


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
        # the logs' folder once, and each log by name: the rows stay short however deep the folder is
        folders = {Path(p.log).parent for p in self.processes}
        shared = folders.pop() if len(folders) == 1 else None
        if shared is not None:
            lines.append(f"  logs in {shared}/")
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
                    Path(p.log).name if shared is not None else str(p.log),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        for row in rows:
            lines.append("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        return "\n".join(lines)


def run_job(config: LaunchConfig, env: Mapping[str, str], make_backend: Callable[[], Backend], out: TextIO
            ) -> LaunchResult:
    """Run attempts until one succeeds, is interrupted, or `max_restarts` restarts are spent;
    the last attempt's result, with the failures restarted after. Every process gets `env`
    (the job's token) and the checkpoint options; attempt k > 0 logs into
    `log_dir/restart-<k>/` and restores from the newest complete checkpoint, if any."""
    checkpoint_dir = Path(config.checkpoint_dir) if config.checkpoint_dir is not None else None
    base = dict(env)
    if checkpoint_dir is not None:
        base[CHECKPOINT_DIR_ENV] = str(checkpoint_dir)
        if config.checkpoint_every:
            base[CHECKPOINT_EVERY_ENV] = str(config.checkpoint_every)
    restarts: list[str] = []
    restore: Path | None = None  # the checkpoint the next attempt starts from
    started = time.monotonic()
    with MetricsWriter(Path(config.log_dir) / METRICS_FILE, fresh=True, tensorboard=config.tensorboard_dir) as metrics:
        return _run_attempts(config, make_backend, out, base, checkpoint_dir, restarts, restore, started, metrics)


def _run_attempts(config: LaunchConfig, make_backend: Callable[[], Backend], out: TextIO, base: dict[str, str],
                  checkpoint_dir: Path | None, restarts: list[str], restore: Path | None, started: float,
                  metrics: MetricsWriter) -> LaunchResult:
    restore_failures: list[tuple[str, ...] | None] = []  # per restart: how it failed before passing its checkpoint
    while True:
        extra = {**base, RESTORE_ENV: str(checkpoint_dir)} if restore is not None else base
        if restarts and checkpoint_dir is not None and "{pserver}" in str(checkpoint_dir):
            # Per-pserver dirs: the processes agree the step over RPC (ops.rpc.own_dirs), whatever this
            # launcher can read; none complete yet: from scratch.
            extra = {**base, RESTORE_ENV: str(checkpoint_dir), RESTORE_IF_ANY_ENV: "1"}
        log_dir = Path(config.log_dir) if not restarts else Path(config.log_dir) / f"restart-{len(restarts)}"
        result = run_attempt(config, make_backend(), extra, log_dir, out, metrics=metrics, attempt=len(restarts))
        result.seconds = time.monotonic() - started
        result.restarts = list(restarts)
        if restarts and not result.ok and result.failure is not None:
            restore_failures.append(restore_failure(result, restore))
            if len(restore_failures) >= 2 and restore_failures[-1] is not None and restore_failures[-1] == restore_failures[-2]:
                origin = restore.name if restore is not None else "the start"
                result.failure = (f"the restart from {origin} failed the same way twice, before any step past it "
                                  f"(not restarting again): {result.failure}")
                _report(result, out)
                return result
        if result.ok or result.interrupted or len(restarts) >= config.max_restarts or result.failure is None or (
                config.restart_while is not None and not config.restart_while()):
            _report(result, out)
            return result
        restarts.append(result.failure)
        restore = _restore_point(checkpoint_dir)
        origin = f"checkpoint {restore.name}" if restore is not None else "the start (no complete checkpoint yet)"
        if restore is None and checkpoint_dir is not None and "{pserver}" in str(checkpoint_dir):
            origin = "the newest checkpoint the pservers agree on (none complete in the job dir seen here)"
        print(f"launch: {result.failure}", file=out)
        print(f"launch: restart {len(restarts)} of {config.max_restarts}, from {origin}", file=out, flush=True)


_ENDPOINT = re.compile(r"\b[\w.-]+:\d{2,5}\b")
_RESTART_DIR = re.compile(r"restart-\d+[/\\]")


def restore_failure(result: LaunchResult, restore: Path | None) -> tuple[str, ...] | None:
    """How a restarted attempt failed, when it failed before any trainer passed the step
    it restored (a deterministic restore error repeats exactly so): the checkpoint, the
    first failed process, its exit, and its last error line (endpoints and restart log
    folders, which change between attempts, blanked). None when it trained past the
    checkpoint (a new crash, worth a restart) or no process failed on its own."""
    restored = step_of_checkpoint(restore)
    steps = [p.progress.step for p in result.processes if p.role == TRAINER and p.progress is not None]
    if steps and max(steps) > restored:
        return None
    named = [p for p in result.processes if p.failed and (result.failure or "").startswith(f"{p.name} ")]
    failed = named or [p for p in result.processes if p.failed and not p.stopped]
    if not failed:
        return None
    first = failed[0]
    lines = [line for line in first.tail if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    last = (errors or lines or [""])[-1]
    last = _RESTART_DIR.sub("", _ENDPOINT.sub("<endpoint>", last.strip()))
    return (restore.name if restore is not None else "", first.name, first.exit_text, last)


def step_of_checkpoint(folder: Path | None) -> int:
    """The step a `ckpt-<step>` folder holds (0: none, the job starts from scratch)."""
    if folder is None:
        return 0
    match = re.fullmatch(r"ckpt-(\d+)", folder.name)
    return int(match.group(1)) if match else 0


def _restore_point(checkpoint_dir: Path | None) -> Path | None:
    if checkpoint_dir is None:
        return None
    from ops.rpc.checkpoint import find_latest  # the checkpoint format; numpy only when restarting

    return find_latest(checkpoint_dir, missing_ok=True)


def run_attempt(config: LaunchConfig, backend: Backend, extra: Mapping[str, str], log_dir: Path, out: TextIO, *,
                metrics: MetricsWriter | None = None, attempt: int = 0) -> LaunchResult:
    """Start every process on `backend`, watch them to the end, stop what is left; every
    progress line a process printed goes into `metrics` (the job's metrics file)."""
    started = time.monotonic()
    handles: list[ProcessHandle] = []
    failure: str | None = None
    interrupted = False
    try:
        endpoints = backend.endpoints(config.pservers, config.trainers)
        for i, endpoint in enumerate(endpoints):
            role = Role(PSERVER, 0, config.trainers, tuple(endpoints), endpoint, config.sync_mode, config.rpc_timeout)
            handles.append(backend.start(ProcessStatus(PSERVER, i, endpoint, log_dir / f"pserver.{i}.log"), role, extra))
        for i in range(config.trainers):
            role = Role(TRAINER, i, config.trainers, tuple(endpoints), None, config.sync_mode, config.rpc_timeout)
            handles.append(backend.start(ProcessStatus(TRAINER, i, None, log_dir / f"trainer.{i}.log"), role, extra))
        failure = _monitor(handles, config, backend, out, lambda: _record(handles, metrics, attempt))
    except KeyboardInterrupt:
        failure, interrupted = "interrupted", True
    except PsTranspilerError as exc:  # the backend's own error (a LaunchError): the job failed to start
        failure = str(exc)
    finally:
        try:
            backend.stop(handles, config.stop_grace)
        finally:
            backend.close(handles)
            _record(handles, metrics, attempt)  # the last lines
    return LaunchResult(
        ok=failure is None,
        failure=failure,
        processes=[h.status for h in handles],
        seconds=time.monotonic() - started,
        sync_mode=config.sync_mode,
        interrupted=interrupted,
        pserver_count=config.pservers,
        trainer_count=config.trainers,
        backend=backend.name,
    )


def _record(handles: Sequence[ProcessHandle], metrics: MetricsWriter | None, attempt: int) -> None:
    """Move the reports the processes printed since the last call into the metrics file
    (without one, drop them: a long job must not keep them all)."""
    for handle in handles:
        reports = handle.status.reports
        count = len(reports)
        if not count:
            continue
        batch = reports[:count]
        del reports[:count]  # a reader thread may append meanwhile: only what was taken goes
        if metrics is None:
            continue
        trainer = handle.status.role == TRAINER
        for stamp, report in batch:
            if isinstance(report, Progress) == trainer:  # a trainer's progress, a pserver's usage: nothing else
                metrics.report(report, trainer=handle.status.index, attempt=attempt, elapsed=stamp - metrics.started)


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


def _monitor(handles: list[ProcessHandle], config: LaunchConfig, backend: Backend, out: TextIO,
             record: Callable[[], None] = lambda: None) -> str | None:
    """Wait for the job's end; the failure, or None when every process exited 0. `record`
    is called every poll (it writes the metrics)."""
    trainers = [h for h in handles if h.status.role == TRAINER]
    pservers = [h for h in handles if h.status.role == PSERVER]
    trainers_done: float | None = None
    next_status = time.monotonic() + config.status_every
    shown: tuple = ()
    live = _Status(out)
    try:
        while True:
            backend.refresh(handles)
            for handle in handles:
                handle.poll()
            record()
            if any(h.status.failed for h in handles):
                return _first_cause(handles, backend)
            now = time.monotonic()
            if all(h.status.returncode == 0 for h in trainers):
                trainers_done = trainers_done or now
                if all(h.status.returncode == 0 for h in pservers):
                    return None
                if now - trainers_done > config.exit_grace:
                    waiting = ", ".join(h.status.name for h in pservers if h.status.returncode is None)
                    return f"{waiting} still running {config.exit_grace:g} s after every trainer finished"
            if now >= next_status:
                next_status = now + config.status_every
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
    line = f"[{label} {elapsed:.1f}s] " + " | ".join(parts)
    if len(line) <= STATUS_WIDTH:
        return line
    # Many trainers: one line for all of them (the summary at the end has a row each).
    reported = [h.status.progress for h in trainers if h.status.progress is not None]
    steps = [p.step for p in reported]
    losses = [p.loss for p in reported if p.loss is not None]
    rates = [p.steps_per_s for p in reported if p.steps_per_s is not None]
    text = f"{len(trainers)} trainers: step {min(steps)}..{max(steps)}" if steps else f"{len(trainers)} trainers"
    if losses:
        text += f", loss {min(losses):.4g}..{max(losses):.4g}"
    if rates:
        text += f", {sum(rates):.3g} steps/s in all"
    if len(reported) < len(trainers):
        text += f", {len(trainers) - len(reported)} starting"
    return f"[{label} {elapsed:.1f}s] {text}"


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
