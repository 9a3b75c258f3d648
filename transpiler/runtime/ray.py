"""Run a job's pservers and trainers on a Ray cluster.

    pstranspile launch --backend ray [--address ADDR] --pservers 2 --trainers 2 -- python3 train.py
    result = transpiler.runtime.ray.run(main, startup, train_fn, pservers=2, trainers=2)

Without an address (and no `RAY_ADDRESS` in the environment, which a KubeRay RayJob sets)
a local Ray instance starts on this machine, bound to loopback only (127.0.0.1), and stops
at the end; with one (the GCS address `host:6379`, or `auto`; not `ray://`) the job joins
that cluster, whose nodes need this package installed. A process that already called
`ray.init` keeps its connection. Each attempt of the job (`transpiler.runtime.job`):

1. a placement group holds one bundle of `cpus_per_process` CPUs per pserver and per
   trainer, pservers first; `spread` (the default) spreads bundles over the nodes, so with
   enough nodes the pservers land on different ones; `pack` packs them;
2. one `JobProcess` actor per bundle (`transpiler.runtime.ray_actor`); each pserver's actor
   picks a free port on its node and reports `ip:port`;
3. every actor runs the same command (or, from `run`, a `Session`) with Paddle's
   environment (`PADDLE_PSERVER_ENDPOINTS`, `PADDLE_TRAINER_ID`, ...) and the job's token,
   so a script runs unchanged under `launch`, under Ray and by hand;
4. the driver polls every actor (its new output lines go to `LOG_DIR/<role>.<i>.log` here,
   its progress to the live status line); an actor Ray reports dead (its node died), or a
   process exiting non-zero, fails the attempt, naming the process, its node and the step;
5. every actor is stopped and killed, and the placement group removed, whatever happened.

With `max_restarts` K and a checkpoint dir (on storage every node shares) a failed job
restarts — a new placement group on the nodes still alive — from the newest complete
checkpoint.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO

from ops.rpc.service import DEFAULT_TIMEOUT
from transpiler.errors import PsTranspilerError
from transpiler.runtime.job import TAIL_LINES, LaunchConfig, LaunchError, LaunchResult, ProcessStatus
from transpiler.runtime.launch import BLAS_THREAD_VARS, PACKAGE_ROOT, launch
from transpiler.runtime.progress import Progress, parse_report
from transpiler.runtime.role import TRAINER, Role

PLACEMENT_TIMEOUT = 60.0  # seconds for the placement group's bundles and the actors to come up
CALL_TIMEOUT = 30.0  # seconds for one control call to an actor (start, where, stop)
UNANSWERED = 2.0  # a poll unanswered this long marks its actor as not answering (explains a failure)
KILL_TIMEOUT = 10.0  # seconds to wait for Ray to report the killed actors dead
POLL_EVERY = 0.3  # seconds between polls of one actor: a poll costs the driver and the actor's node CPU
# A local instance checks its nodes often, so a dead one is reported within seconds.
LOCAL_SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_timeout_ms": 500,
                       "health_check_failure_threshold": 3}
RAY_ADDRESS_ENV = "RAY_ADDRESS"  # Ray's own: the cluster a driver joins when given no address
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray uses 127.0.0.1 for every address it binds


class RayUnavailable(LaunchError):
    """Ray is not installed, or its cluster cannot be reached."""


def _import_ray(local: bool):
    """Ray, imported; for a local instance, first told to bind loopback only (Ray reads this
    when imported, so it must be set before: otherwise its processes listen on every
    interface and advertise the machine's network address)."""
    if local and "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_ONLY_ENV, "0")
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailable(
            f"the ray backend needs Ray, an optional dependency ({exc}): "
            "pip install 'ps-transpiler[ray]' (or 'ray>=2.40,<3')"
        ) from None
    return ray


class RayConnection:
    """This process's connection to Ray for one job: joins an initialised Ray, the cluster
    at `address`, or starts a local loopback-only instance; `close` undoes what it did."""

    def __init__(self, address: str | None, bundles: int, cpus_per_process: float, out: TextIO) -> None:
        address = address or os.environ.get(RAY_ADDRESS_ENV) or None  # a RayJob's driver pod sets it
        self.ray = _import_ray(local=address is None)
        self.owned = False
        if self.ray.is_initialized():
            return
        self.owned = True
        started = time.monotonic()
        try:
            if address is None:
                paths = [str(PACKAGE_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
                os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))  # the workers import this package
                cpus = max(os.cpu_count() or 1, int(bundles * cpus_per_process + 0.999))
                if os.environ.get(LOOPBACK_ONLY_ENV) != "0":  # Ray was imported before we could say so
                    print(f"launch: warning: Ray was imported before {LOOPBACK_ONLY_ENV}=0 was set; the local "
                          "instance may listen beyond 127.0.0.1 (set it before importing ray)", file=out, flush=True)
                print(f"launch: starting a local Ray instance (127.0.0.1 only, {cpus} logical CPUs)", file=out, flush=True)
                # address="local": always a new instance, never a `ray start` already running here
                self.ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                              logging_level="warning", _node_ip_address="127.0.0.1", _system_config=LOCAL_SYSTEM_CONFIG)
            else:
                print(f"launch: joining the Ray cluster at {address}", file=out, flush=True)
                self.ray.init(address=address, log_to_driver=False, logging_level="warning")
        except (ConnectionError, ValueError, RuntimeError) as exc:
            self.owned = False
            raise RayUnavailable(f"cannot reach Ray at {address or 'a local instance'}: {exc}") from None
        alive = [n for n in self.ray.nodes() if n.get("Alive")]
        print(f"launch: Ray ready in {time.monotonic() - started:.1f} s: {len(alive)} node(s), "
              f"{sum(n['Resources'].get('CPU', 0) for n in alive):g} CPUs", file=out, flush=True)

    def close(self) -> None:
        if self.owned:
            self.ray.shutdown()
            self.owned = False


@dataclass
class SessionPayload:
    """What `run` gives every actor instead of a command: the programs and, for trainers,
    the function to call with the started session."""

    train_fn: Callable[[Any, Role], Any]
    main: bytes
    startup: bytes
    options: Mapping[str, Any] = field(default_factory=dict)


class _RayProcess:
    """The driver's side of one actor: its status, its log here, the poll in flight."""

    def __init__(self, actor, status: ProcessStatus, where: Mapping[str, Any]) -> None:
        self.actor, self.status, self.where = actor, status, where
        self.started = time.monotonic()
        self.ended: float | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.pending = None  # the poll in flight
        self.asked = 0.0  # when it was sent
        self.answered = 0.0  # when the last poll came back
        status.node = f"{where['ip']}/{where['node_id'][:8]}"
        status.log.parent.mkdir(parents=True, exist_ok=True)
        self.log: IO[str] = open(status.log, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()

    @property
    def running(self) -> bool:
        return self.status.returncode is None and self.status.lost is None

    def take(self, code: int | None, lines: list[str]) -> None:
        self.answered = time.monotonic()
        for line in lines:
            self.log.write(line + "\n")
            self.tail.append(line)
            report = parse_report(line)
            if report is not None:
                self.status.reports.append((self.answered, report))  # the job's metrics file (job.py drains them)
                if isinstance(report, Progress):
                    self.status.progress = report
        self.log.flush()
        if code is not None:
            self.status.returncode = code
            self.ended = time.monotonic()

    def lose(self, reason: str) -> None:
        self.status.lost = reason
        self.ended = self.ended or time.monotonic()

    def poll(self) -> int | None:
        return self.status.returncode

    def close(self) -> None:
        self.log.close()
        self.status.seconds = (self.ended or time.monotonic()) - self.started
        self.status.tail = list(self.tail)


class RayBackend:
    """One attempt's placement group and actors (`transpiler.runtime.job.Backend`)."""

    name = "ray"

    def __init__(self, config: LaunchConfig, ray, payload: SessionPayload | None, results: dict[int, Any]) -> None:
        self.config, self.ray, self.payload, self.results = config, ray, payload, results
        self.group = None
        self.actors: list[Any] = []
        self.wheres: list[Mapping[str, Any]] = []
        self.per_node: Counter[str] = Counter()

    # ------------------------------------------------------------ placing
    def endpoints(self, pservers: int, trainers: int) -> list[str]:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from transpiler.runtime.ray_actor import JobProcess

        ray, cpus = self.ray, self.config.cpus_per_process
        bundles = pservers + trainers
        shapes = [self.config.bundle("pserver")] * pservers + [self.config.bundle("trainer")] * trainers
        self.group = placement_group(shapes, strategy=self.config.placement.upper())
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            free = sum(n["Resources"].get("CPU", 0) for n in alive)
            kinds = ", ".join(dict.fromkeys(" ".join(f"{k}={v:g}" for k, v in b.items()) for b in shapes))
            raise LaunchError(f"Ray could not place {bundles} bundle(s) of {kinds} within "
                              f"{PLACEMENT_TIMEOUT:g} s: the cluster has {free:g} CPUs on {len(alive)} alive node(s)") from None
        actor_class = ray.remote(JobProcess)
        self.actors = [
            actor_class.options(num_cpus=shape.get("CPU", cpus), num_gpus=shape.get("GPU", 0), memory=shape.get("memory"),
                                max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                                    self.group, placement_group_bundle_index=i)).remote()
            for i, shape in enumerate(shapes)
        ]
        self.wheres = self._call([a.where.remote() for a in self.actors], "report its node", PLACEMENT_TIMEOUT)
        self.per_node = Counter(w["node_id"] for w in self.wheres)
        return self._call([a.reserve_endpoint.remote() for a in self.actors[:pservers]], "pick a port")

    def _call(self, refs: list, what: str, timeout: float = CALL_TIMEOUT) -> list:
        try:
            return self.ray.get(refs, timeout=timeout)
        except self.ray.exceptions.GetTimeoutError:
            raise LaunchError(f"a Ray actor did not {what} within {timeout:g} s") from None
        except self.ray.exceptions.RayError as exc:
            raise LaunchError(f"a Ray actor could not {what}: {_first_line(exc)}") from None

    def start(self, status: ProcessStatus, role: Role, env: Mapping[str, str]) -> _RayProcess:
        index = status.index if role.is_pserver else self.config.pservers + status.index
        actor, where = self.actors[index], self.wheres[index]
        handle = _RayProcess(actor, status, where)
        here = self.per_node[where["node_id"]]
        extra = dict(env)
        if self.config.cpus_per_process >= 1:  # a process's BLAS threads: its bundle's CPUs, unless set
            for key in BLAS_THREAD_VARS:
                extra.setdefault(key, str(int(self.config.cpus_per_process)))
        if self.payload is None:
            cwd = str(self.config.cwd or Path.cwd())
            ref = actor.run_command.remote(list(self.config.command), role, extra, here, cwd)
        else:
            p = self.payload
            ref = actor.run_session.remote(p.train_fn if role.is_trainer else None, p.main, p.startup, role, extra,
                                           here, dict(p.options))
        try:
            self.ray.get(ref, timeout=CALL_TIMEOUT)
        except self.ray.exceptions.RayTaskError as exc:
            handle.close()
            raise LaunchError(_first_line(exc.cause if exc.cause is not None else exc)) from None
        except self.ray.exceptions.RayError as exc:
            handle.lose(f"its actor died while starting: {_first_line(exc)}")
        return handle

    # ------------------------------------------------------------ watching
    def refresh(self, handles: Sequence[_RayProcess]) -> None:
        """Ask every running actor for news (one poll in flight each, a new one at most every
        POLL_EVERY s), take what answered."""
        ray, now = self.ray, time.monotonic()
        for h in handles:
            if h.running and h.pending is None and now - h.asked >= POLL_EVERY:
                h.pending, h.asked = h.actor.poll.remote(), now
        waiting = [h for h in handles if h.pending is not None]
        if not waiting:
            return
        ready, _ = ray.wait([h.pending for h in waiting], num_returns=len(waiting), timeout=0.05)
        ready = set(ready)
        for h in waiting:
            if h.pending not in ready:
                continue
            ref, h.pending = h.pending, None
            try:
                code, lines = ray.get(ref)
            except ray.exceptions.RayError as exc:
                h.lose(_loss_reason(exc))
                continue
            h.take(code, lines)

    def explain(self, handles: Sequence[_RayProcess], since: float) -> bool:
        """After another process failed: mark actors whose poll went unanswered for
        UNANSWERED s as lost (a silent actor is the likelier cause: its node is going away);
        True once every running actor answered a poll since `since` (nothing else to learn)."""
        now = time.monotonic()
        for h in handles:
            if h.running and h.pending is not None and now - h.asked > UNANSWERED:
                h.lose(f"its actor stopped answering {now - h.asked:.1f} s ago (its node may have died)")
        return all(not h.running or h.answered >= since for h in handles)

    # ------------------------------------------------------------ ending
    def stop(self, handles: Sequence[_RayProcess], grace: float) -> None:
        """Stop every running process (SIGTERM, SIGKILL after `grace`), collect the trainers'
        results (`run`), then kill every actor; a dead node's actors are left to Ray."""
        ray = self.ray
        running = [h for h in handles if h.running]
        for h in running:
            h.status.stopped = True
        if running and self.payload is None:
            refs = [h.actor.stop.remote(grace) for h in running]
            ray.wait(refs, num_returns=len(refs), timeout=grace + 6.0)
        self.refresh_final(handles)
        if self.payload is not None:
            done = [h for h in handles if h.status.role == TRAINER and h.status.returncode == 0]
            refs = [h.actor.get_result.remote() for h in done]
            try:
                for h, value in zip(done, ray.get(refs, timeout=CALL_TIMEOUT), strict=True):
                    self.results[h.status.index] = value
            except ray.exceptions.RayError as exc:
                raise LaunchError(f"cannot collect the trainers' results: {_first_line(exc)}") from None

    def refresh_final(self, handles: Sequence[_RayProcess]) -> None:
        """Collect the last lines and exit codes of the processes that answer at once."""
        for h in handles:
            if h.status.lost is None and h.pending is None:
                h.pending, h.asked = h.actor.poll.remote(), time.monotonic()
        refs = [h.pending for h in handles if h.pending is not None]
        if refs:
            self.ray.wait(refs, num_returns=len(refs), timeout=2.0)
        self.refresh(handles)

    def close(self, handles: Sequence[_RayProcess]) -> None:
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
        self._await_deaths()
        if self.group is not None:
            try:
                remove_placement_group(self.group)
            except Exception:  # noqa: BLE001 - the GCS forgets groups of a dead job anyway
                pass
        for h in handles:
            h.close()
        self.actors = []

    def _await_deaths(self) -> None:
        """Return once Ray has every killed actor dead (a kill is asynchronous): a call to
        each fails when it is, so a job that returned has left no actor behind; bounded."""
        probes = []
        for actor in self.actors:
            try:
                probes.append(actor.where.remote())
            except Exception:  # noqa: BLE001 - its handle is already unusable: dead
                pass
        if probes:
            self.ray.wait(probes, num_returns=len(probes), timeout=KILL_TIMEOUT)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _loss_reason(exc: BaseException) -> str:
    text = str(exc)
    if "node has died" in text or "node died" in text or "NodeDiedError" in text:
        return "its node died"
    return f"its actor died ({type(exc).__name__})"


class RayJob:
    """The backend factory `launch` calls once per attempt; owns the connection."""

    def __init__(self, config: LaunchConfig, out: TextIO, payload: SessionPayload | None = None) -> None:
        self.config, self.out, self.payload = config, out, payload
        self.connection: RayConnection | None = None
        self.results: dict[int, Any] = {}

    def __call__(self) -> RayBackend:
        if self.connection is None:
            bundles = self.config.pservers + self.config.trainers
            self.connection = RayConnection(self.config.address, bundles, self.config.cpus_per_process, self.out)
        return RayBackend(self.config, self.connection.ray, self.payload, self.results)

    def shutdown(self) -> None:
        if self.connection is not None:
            self.connection.close()


@dataclass
class RunResult:
    """`run`'s answer: the job's result (`ok`, `failure`, `summary()`) and what each trainer's
    `train_fn` returned, by trainer id."""

    job: LaunchResult
    results: dict[int, Any]

    @property
    def ok(self) -> bool:
        return self.job.ok

    @property
    def failure(self) -> str | None:
        return self.job.failure

    def summary(self) -> str:
        return self.job.summary()


def run(main, startup, train_fn: Callable[[Any, Role], Any], *, pservers: int, trainers: int,
        address: str | None = None, sync_mode: bool = True, placement: str = "spread",
        cpus_per_process: float = 1.0, max_restarts: int = 0, checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 0, log_dir: str | Path = "logs", rpc_timeout: float = DEFAULT_TIMEOUT,
        env: Mapping[str, str] | None = None, status_every: float = 2.0, out: TextIO | None = None,
        **session_options: Any) -> RunResult:
    """Train `main`/`startup` (Programs) on a Ray cluster: M pserver actors serve, N trainer
    actors each run `train_fn(session, role)` on a started `Session` (its return value comes
    back in `results`). `session_options` go to every `Session` (e.g. `seed`, `progress_every`,
    transpile options). Restarts (`max_restarts`) resume from `checkpoint_dir`; a `train_fn`
    should loop from `session.steps` to skip the steps a restored job already trained."""
    if not callable(train_fn):
        raise PsTranspilerError(f"train_fn must be callable, got {type(train_fn).__name__}")
    name = getattr(train_fn, "__qualname__", type(train_fn).__name__)
    config = LaunchConfig(
        command=(f"<{name}>",), pservers=pservers, trainers=trainers, sync_mode=sync_mode, log_dir=Path(log_dir),
        rpc_timeout=rpc_timeout, env=dict(env or {}), status_every=status_every, backend="ray", address=address,
        placement=placement, cpus_per_process=cpus_per_process, max_restarts=max_restarts,
        checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir is not None else None, checkpoint_every=checkpoint_every,
    )
    payload = SessionPayload(train_fn, main.to_bytes(), startup.to_bytes(), session_options)
    job = RayJob(config, out or sys.stderr, payload)
    result = launch(config, out=out, backend=job)
    return RunResult(result, dict(sorted(job.results.items())))
