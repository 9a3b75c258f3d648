"""Ours beside Fluid 1.8.5 on the same Paddle-built programs: 2 pservers x 2 trainers, sync.

    python benchmarks/vs_paddle18.py [--steps 200] [--warmup 20] [--repeat 3] [--quick] [--local-only] [--ours-only] [--case emb ...]
    make bench-paddle

Fluid 1.8.5, in its own venv (`tools/paddle_env.py`), builds the workloads and saves their
main/startup programs (`benchmarks/paddle18_workloads.py`): the MLP 784-512-512-10 with
Adam, at batch 64 and 512 per trainer (the 512 row runs a quarter of `--steps`), and a
100k x 64 `is_sparse` embedding (remote prefetch) + fc 64 + fc 10 with SGD, batch 64 per
trainer, and (issue 30) x[8, S] -> fc S (relu) -> fc 10 with SGD at S = 4096 and 8192 (a 64 MB
and a 256 MB weight: the step is moving params; a quarter and a tenth of `--steps`). Each
workload then trains on those same .pb files, 127.0.0.1 only, free ports:

* Paddle: the harness starts 2 pservers and 2 trainers of `paddle18_workloads.py run`
  (`DistributeTranspiler`, `use_program_cache=True`, `PADDLE_SPEED_ENV`) and, once the
  trainers are done, stops the pservers itself (a sync Fluid pserver does not always exit).
* ours: `pstranspile launch --pservers 2 --trainers 2 -- python examples/train_program.py`;
  the embedding with `PSTRANSPILE_GRPC_ENGINE=poller` (its messages are small:
  `ops/rpc/engine.py`), as the table's last lines say.

Runs alternate (Paddle, ours, Paddle, ours, ...; `--repeat` each) and the table shows each
figure's median. A last row trains the MLP locally (no pservers) on both (`--local-only`: that row alone; `--case KEY`, repeatable: those workloads only).

* steps/s: trainer 0's, over the steps after `--warmup` (its `timing:` line).
* CPU ms/step: user + system time of all 4 processes (1 for the local row): each trainer's
  own over its timed window (its `timing:` line), plus the pservers' over trainer 0's window,
  from /proc/<pid>/stat sampled every 0.1 s and interpolated at the window's ends (a pserver
  that exits less than a sample after the window counts its last sample). launch's own
  process is not counted.
* other load: the cores the rest of the machine kept busy meanwhile (/proc/stat), since a
  shared machine makes steps/s noisy; CPU ms/step is the steadier figure.
* RPCs/step/pserver (averaged over the pservers): ours from each pserver's last log line
  (RPCs answered between its first and last optimize, per step); Paddle's from one extra,
  untimed run of at most 50 steps with its gRPC server's request log on
  (`GLOG_vmodule=grpc_server=4`): the sends, gets and prefetches it logged (barriers are
  sends and gets of marker vars; complete notices are left out) within trainer 0's timed
  window, per step.

Under the table, for the big-weight workloads: the MB a step moves per second on each side,
as a share of one raw Python TCP loopback stream measured right then (`raw_stream`), and
the CPU per MB moved; then each role's peak RSS (VmHWM: the largest of the run's pservers,
sampled from /proc with the CPU; the largest of its trainers, which report it on their
`timing:` line right after the last step), median over the runs, beside what such a
process must hold (a trainer: params and their grads; a pserver: its share of the params
and optimizer state and one grad per trainer) as a ratio, and the peaks of an idle process
of ours and of a Python with numpy and gRPC alone (the floor under every peak). `--case wide1g` (not in the
default set: four processes of several GB) does the same with a 1 GB weight (S = 16384,
a twentieth of `--steps`); Paddle's side of it would need more memory than this 24 GB
machine has (its 256 MB peaks, ~1.9 GB a pserver and ~1.5 GB a trainer, four times over),
so `--ours-only --case wide1g` runs ours alone (Paddle still builds the program) and
prints our figures against the raw stream and what must be held. `--case deep2048` (not in the default set either: issue 30's
early sends) trains x[32, 2048] -> 3 x fc 2048 (relu) -> fc 10 with SGD, three 16 MB
weights whose grads are ready one by one during backward (half of `--steps`).

Before the runs it writes this checkout's `.pyc` files (`compile_bytecode`), as an install
does: a process that compiles its modules as it imports them peaks ~1 MB higher.

Exits 0 with one line when Paddle 1.8.5 cannot be installed here.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.local_procs import free_endpoints  # noqa: E402 - not launch's: the harness uses only our CLI
from tools.paddle_env import PADDLE_SPEED_ENV, PaddleUnavailable, ensure, remove_port_file  # noqa: E402

WORKLOADS = ROOT / "benchmarks" / "paddle18_workloads.py"
TRAIN_PROGRAM = ROOT / "examples" / "train_program.py"
HOST = "127.0.0.1"
PSERVERS = TRAINERS = 2
PSERVER_GRACE = 3.0  # seconds Paddle's pservers get to exit after the trainers, before we kill them
LAUNCH_GRACE = 15.0  # seconds launch gets to stop its children after SIGINT
SAMPLE_EVERY = 0.1  # seconds between CPU samples
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ROLE_VARS = ("TRAINING_ROLE", "PADDLE_PSERVER_ENDPOINTS", "PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ID",
             "PADDLE_CURRENT_ENDPOINT", "POD_IP", "PADDLE_PORT")
RPCS_LINE = re.compile(r"([0-9.]+) rpc/step/trainer")  # the pserver's exit line (ops/rpc/server.py)
# Paddle 1.8's gRPC server logs every request it handles at verbosity 4 (time of day first).
PADDLE_RPC_LOG = {"GLOG_minloglevel": "0", "GLOG_v": "0", "GLOG_vmodule": "grpc_server=4", "GLOG_logtostderr": "1"}
PADDLE_REQUEST = re.compile(r"^I\d{4} (\d\d):(\d\d):(\d\d\.\d+) +\d+ grpc_server\.cc:\d+\] "
                            r"Request(?:Send var_name:(?!COMPLETE@)|Get \S* ?from |Prefetch, in_var_name:)")
RPC_COUNT_STEPS = 50  # steps of the extra run that counts Paddle's RPCs


@dataclass(frozen=True)
class Case:
    key: str  # for --case
    label: str
    workload: str  # folder of the built programs
    batch: int  # per trainer
    steps_share: float = 1.0  # of --steps
    local: bool = False
    ours_settings: tuple[tuple[str, str], ...] = ()  # environment of our processes (printed under the table)
    moved_mb: float = 0.0  # MB a step moves over loopback (grads up, params down, every trainer): rates under the table
    param_mb: float = 0.0  # MB of params (and optimizer state, `state_mb`): the memory table under the table
    state_mb: float = 0.0
    default: bool = True  # run without --case

    def needs_mb(self, role: str) -> float:
        """What one process must hold: a trainer its params and their grads; a pserver its
        share of the params and optimizer state and one grad copy per trainer."""
        if role == "trainer":
            return 2 * self.param_mb
        return (self.param_mb * (1 + TRAINERS) + self.state_mb) / PSERVERS


def wide_params_mb(size: int) -> float:
    """MB of x -> fc size -> fc 10's params (float32): the size x size weight, the rest."""
    return (size * size + size + size * 10 + 10) * 4 / 2**20


CASES = (
    Case("mlp64", "MLP 784-512-512-10, Adam, batch 64", "mlp", 64),
    Case("mlp512", "MLP 784-512-512-10, Adam, batch 512", "mlp", 512, steps_share=0.25),
    # Its messages are a few kB to 16 kB: gRPC's poller beats its EventEngine there (ops/rpc/engine.py).
    Case("emb", "embedding 100k x 64 sparse + fc 64 + fc 10, SGD, batch 64", "emb", 64,
         ours_settings=(("PSTRANSPILE_GRPC_ENGINE", "poller"),)),
    # Big dense params (issue 30): the step is moving a 64 MB / 256 MB weight to and from the pservers.
    Case("wide64", "x[8, 4096] -> fc 4096 -> fc 10, SGD (64 MB weight), batch 4", "wide4096", 4, steps_share=0.25,
         moved_mb=2 * TRAINERS * 4096 * 4096 * 4 / 2**20, param_mb=wide_params_mb(4096)),
    Case("wide256", "x[8, 8192] -> fc 8192 -> fc 10, SGD (256 MB weight), batch 4", "wide8192", 4, steps_share=0.1,
         moved_mb=2 * TRAINERS * 8192 * 8192 * 4 / 2**20, param_mb=wide_params_mb(8192)),
    # Several big weights: each grad can start to its pserver while backward computes the layers below.
    Case("deep2048", "x[32, 2048] -> 3 x fc 2048 -> fc 10, SGD (3 x 16 MB weights), batch 16", "deep2048", 16,
         steps_share=0.5, default=False, moved_mb=2 * TRAINERS * 3 * 2048 * 2048 * 4 / 2**20,
         param_mb=(3 * (2048 * 2048 + 2048) + 2048 * 10 + 10) * 4 / 2**20),
    # Not in the default set (`--case wide1g`): 4 processes of several GB each.
    Case("wide1g", "x[8, 16384] -> fc 16384 -> fc 10, SGD (1 GB weight), batch 4", "wide16384", 4, steps_share=0.05,
         moved_mb=2 * TRAINERS * 16384 * 16384 * 4 / 2**20, param_mb=wide_params_mb(16384), default=False),
    Case("local", "local step: the MLP, batch 64, no pservers", "mlp", 64, local=True),
)


@dataclass(frozen=True)
class Measurement:
    steps_per_s: float
    cpu_ms: float  # CPU ms per step, all of the run's processes
    elsewhere: float  # cores other processes on the machine kept busy meanwhile
    rpcs: float | None = None  # per step per pserver
    pserver_cpu_ms: float = 0.0  # the pservers' share of cpu_ms
    pserver_peak_mb: float | None = None  # the largest peak RSS (VmHWM) of the run's pservers
    trainer_peak_mb: float | None = None  # ... of its trainers


class RunFailed(RuntimeError):
    """A run exited badly or overran its deadline; the message names its log."""


# ------------------------------------------------------------------ processes and CPU


def proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state, ppid, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def peak_rss(pid: int) -> int | None:
    """A process's peak resident set so far (VmHWM, bytes), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None


def machine_busy_ticks() -> int:
    """Clock ticks all cores spent on anything but idling (/proc/stat), since boot."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return user + nice + system + irq + softirq + steal


def is_pserver(pid: int) -> bool:
    """Whether launch started `pid` as a pserver (its environment says so)."""
    try:
        return b"TRAINING_ROLE=PSERVER" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (launch's pservers and trainers)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = proc_stat(int(entry.name))
            if fields is not None and fields[1] == str(pid):
                found.append(int(entry.name))
    return found


class CpuSampler:
    """CPU seconds (user + system, all threads) of a run's pservers, sampled from /proc.

    Trainers report their own CPU; pservers cannot (Paddle's are killed, never exiting
    cleanly; ours are launch's children), so they are sampled from outside and trainer 0's
    timing window picks the samples, interpolated at its ends. The whole machine's busy
    time is sampled too: what other processes took from the run shows."""

    def __init__(self, find_pids: Callable[[], list[int]], expected: int) -> None:
        self._find_pids = find_pids
        self._expected = expected
        self._series: dict[int, list[tuple[float, int]]] = {}
        self._peaks: dict[int, int] = {}  # pid -> its last VmHWM sample (bytes)
        self._machine: list[tuple[float, int]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _loop(self) -> None:
        pids: list[int] = []
        while True:
            if len(pids) < self._expected:
                pids = self._find_pids()
            now = time.time()
            self._machine.append((now, machine_busy_ticks()))
            for pid in pids:
                fields = proc_stat(pid)
                if fields is not None:
                    self._series.setdefault(pid, []).append((now, int(fields[11]) + int(fields[12])))
                    peak = peak_rss(pid)
                    if peak is not None:
                        self._peaks[pid] = peak
            if self._done.wait(SAMPLE_EVERY):
                return

    def seconds(self, start: float, end: float) -> float:
        """CPU seconds all sampled processes spent between wall-clock `start` and `end`."""
        if len(self._series) < self._expected:
            raise RunFailed(f"only {len(self._series)} of {self._expected} processes were sampled")
        return sum(spent(series, start, end, f"process {pid}") for pid, series in self._series.items())

    def peak_mb(self) -> float | None:
        """The largest peak RSS (VmHWM, MB) of the sampled processes, as last sampled."""
        return max(self._peaks.values()) / 2**20 if self._peaks else None

    def machine_cores(self, start: float, end: float) -> float:
        """Cores the whole machine kept busy on average between `start` and `end`."""
        return spent(self._machine, start, end, "the machine") / (end - start)


def spent(series: list[tuple[float, int]], start: float, end: float, what: str) -> float:
    """CPU seconds between `start` and `end` from (wall time, cumulative ticks) samples; a
    process gone before `end` counts its last sample."""
    times, ticks = zip(*series)
    if times[0] > start:
        raise RunFailed(f"{what} was not sampled from the start of the timed window")
    return float(np.interp(end, times, ticks) - np.interp(start, times, ticks)) / CLOCK_TICKS


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any role or PYTHONPATH (Paddle's python must not see this
    checkout), with Paddle's speed settings for both sides: one BLAS thread per process, as
    4 processes share the cores."""
    env = {k: v for k, v in os.environ.items() if k not in (*ROLE_VARS, "PYTHONPATH")}
    env.update(PADDLE_SPEED_ENV)
    env.update(extra)
    return env


def ours_env(case: Case) -> dict[str, str]:
    """`clean_env`, with this checkout first on PYTHONPATH (over an installed copy) and
    the case's settings."""
    return clean_env(PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
                     **dict(case.ours_settings))


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A process in its own session (so its group can be killed by its pid), output to `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen([str(a) for a in argv], env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait(procs: list[subprocess.Popen], deadline: float, what: str) -> None:
    """Wait for every process of `procs` to exit 0 by the monotonic `deadline`."""
    for proc in procs:
        try:
            code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RunFailed(f"{what} did not finish in time") from None
        if code != 0:
            raise RunFailed(f"{what} exited with code {code}")


def kill_group(proc: subprocess.Popen, grace: float, first: int = signal.SIGKILL) -> None:
    """Unless `proc` exits within `grace` seconds, send its process group `first`, then
    SIGKILL if it still runs `LAUNCH_GRACE` seconds later (launch stops its children on SIGINT)."""
    for sig, wait_for in ((None, grace), (first, LAUNCH_GRACE), (signal.SIGKILL, None)):
        if sig is not None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=wait_for)
            return
        except subprocess.TimeoutExpired:
            continue


def deadline_for(steps: int, case: Case | None = None) -> float:
    """Generous: startup, and 2 s a step (the slowest small row runs about 4 steps/s), or a
    second per 200 MB a step moves if that is more."""
    per_step = max(2.0, case.moved_mb / 200) if case is not None else 2.0
    return time.monotonic() + 120.0 + per_step * steps


def leads_group(pid: int) -> bool:
    """`pid` is alive and the leader of its process group (as launch starts its children)."""
    fields = proc_stat(pid)
    return fields is not None and fields[2] == str(pid)


# ------------------------------------------------------------------ one run


def timing(log: Path) -> dict:
    """The `timing:` line a trainer printed (train_program.py and paddle18_workloads.py)."""
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("timing: "):
            return json.loads(line[len("timing: "):])
    raise RunFailed(f"no timing line in {log}")


def measure(cpu: CpuSampler, logs: Path, trainers: int, rpcs: float | None = None) -> Measurement:
    """The figures of one run: steps/s over trainer 0's timed window; CPU per step, each
    trainer's own over its window plus the pservers' over trainer 0's."""
    windows = [timing(logs / f"trainer.{i}.log") for i in range(trainers)]
    first = windows[0]
    start, end, steps = first["start"], first["end"], first["steps"]
    pservers = cpu.seconds(start, end)
    cpu_ms = (pservers / steps + sum(w["cpu"] / w["steps"] for w in windows)) * 1000
    cores = pservers / (end - start) + sum(w["cpu"] / w["seconds"] for w in windows)
    trainer_peaks = [w["peak_rss"] for w in windows if w.get("peak_rss")]
    return Measurement(steps / first["seconds"], cpu_ms, cpu.machine_cores(start, end) - cores, rpcs,
                       pservers / steps * 1000, cpu.peak_mb(),
                       max(trainer_peaks) / 2**20 if trainer_peaks else None)


def run_paddle(python: Path, folder: Path, case: Case, steps: int, warmup: int, logs: Path,
               count_rpcs: bool = False) -> Measurement:
    """Paddle's pservers and trainers (or one local process), started and stopped here;
    `count_rpcs` turns on the pservers' request log (which slows them) and counts it."""
    argv = [python, WORKLOADS, "run", folder, "--steps", steps, "--warmup", warmup]
    if case.local:
        return run_local([*argv, "--batch", case.batch], clean_env(), steps + warmup, logs)
    endpoints = free_endpoints(PSERVERS)
    common = {"PADDLE_PSERVER_ENDPOINTS": ",".join(endpoints), "PADDLE_TRAINERS_NUM": str(TRAINERS)}
    argv += ["--batch", case.batch * TRAINERS]
    pservers: list[subprocess.Popen] = []
    trainers: list[subprocess.Popen] = []
    try:
        with CpuSampler(lambda: [p.pid for p in pservers], PSERVERS) as cpu:
            for i, endpoint in enumerate(endpoints):
                env = clean_env(TRAINING_ROLE="PSERVER", PADDLE_CURRENT_ENDPOINT=endpoint, **common)
                env.update(PADDLE_RPC_LOG if count_rpcs else {})
                pservers.append(start(argv, env, logs / f"pserver.{i}.log"))
            for i in range(TRAINERS):
                env = clean_env(TRAINING_ROLE="TRAINER", PADDLE_TRAINER_ID=str(i), **common)
                trainers.append(start(argv, env, logs / f"trainer.{i}.log"))
            wait(trainers, deadline_for(steps + warmup, case), f"Paddle's trainers (logs: {logs})")
    finally:
        grace_ends = time.monotonic() + PSERVER_GRACE
        for proc in pservers + trainers:
            kill_group(proc, max(0.0, grace_ends - time.monotonic()))
        for proc in pservers:
            remove_port_file(proc.pid)
    result = measure(cpu, logs, TRAINERS)
    return replace(result, rpcs=paddle_rpcs(logs, timing(logs / "trainer.0.log"))) if count_rpcs else result


def paddle_rpcs(logs: Path, window: dict) -> float:
    """Requests per step per pserver that Paddle's pservers logged within `window`."""
    start, end = day_seconds(window["start"]), day_seconds(window["end"])
    counts = []
    for i in range(PSERVERS):
        times = request_times(logs / f"pserver.{i}.log")
        inside = [t for t in times if (start <= t <= end if start <= end else t >= start or t <= end)]
        counts.append(len(inside) / window["steps"])
    return statistics.mean(counts)


def request_times(log: Path) -> list[float]:
    """The time of day (s) of each request a Paddle pserver's log records."""
    with open(log, errors="replace") as lines:
        found = (PADDLE_REQUEST.match(line) for line in lines)
        return [int(h) * 3600 + int(m) * 60 + float(sec) for h, m, sec in (match.groups() for match in found if match)]


def day_seconds(epoch: float) -> float:
    """Local time of day in seconds, as glog stamps its lines (a window may span midnight)."""
    t = time.localtime(epoch)
    return t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec + epoch % 1


def run_local(argv: list, env: dict[str, str], steps: int, logs: Path) -> Measurement:
    """One local training process (it reports its own CPU; the machine is sampled)."""
    proc = None
    try:
        with CpuSampler(list, 0) as cpu:
            proc = start(argv, env, logs / "trainer.0.log")
            wait([proc], deadline_for(steps), f"local training (log: {logs / 'trainer.0.log'})")
    finally:
        if proc is not None:
            kill_group(proc, 0.0)
    return measure(cpu, logs, 1)


def run_ours(folder: Path, case: Case, steps: int, warmup: int, logs: Path) -> Measurement:
    """`pstranspile launch` (or train_program.py locally) on the same programs."""
    loss = json.loads((folder / "workload.json").read_text())["loss"]
    train = [sys.executable, TRAIN_PROGRAM, "--main", folder / "main.pb", "--startup", folder / "startup.pb",
             "--loss", loss, "--steps", steps, "--warmup", warmup]
    if case.local:
        return run_local([*train, "--batch", case.batch], ours_env(case), steps + warmup, logs)
    argv = [sys.executable, "-m", "transpiler", "launch", "--pservers", PSERVERS, "--trainers", TRAINERS,
            "--host", HOST, "--log-dir", logs, "--timeout", 60, "--exit-grace", 10, "--status-every", 3600,
            "--", *train, "--batch", case.batch * TRAINERS]
    launcher = None
    try:
        with CpuSampler(lambda: list(filter(is_pserver, children(launcher.pid))) if launcher else [], PSERVERS) as cpu:
            launcher = start(argv, ours_env(case), logs / "launch.log")
            wait([launcher], deadline_for(steps + warmup, case), f"pstranspile launch (logs: {logs})")
    finally:
        if launcher is not None:
            launched = children(launcher.pid)
            kill_group(launcher, 0.0, first=signal.SIGINT)  # SIGINT: launch stops its children
            for pid in filter(leads_group, launched):  # what a killed launch left behind
                os.killpg(pid, signal.SIGKILL)
    return measure(cpu, logs, TRAINERS, pserver_rpcs(logs))


def pserver_rpcs(logs: Path) -> float | None:
    """RPCs per step per pserver, from our pservers' exit lines (their mean): each gives
    RPCs per step per trainer over the whole run (the startup fetch and the complete
    notices included, 1% over 200 steps)."""
    found = []
    for i in range(PSERVERS):
        match = RPCS_LINE.search((logs / f"pserver.{i}.log").read_text(errors="replace"))
        if match:
            found.append(float(match.group(1)) * TRAINERS)
    return statistics.mean(found) if found else None


# ------------------------------------------------------------------ the table


def median(runs: list[Measurement]) -> Measurement:
    def of(name: str) -> float | None:
        found = [getattr(r, name) for r in runs if getattr(r, name) is not None]
        return statistics.median(found) if found else None

    return Measurement(of("steps_per_s"), of("cpu_ms"), of("elsewhere"), of("rpcs"), of("pserver_cpu_ms"),
                       of("pserver_peak_mb"), of("trainer_peak_mb"))


def row(case: Case, paddle: Measurement, ours: Measurement) -> str:
    """Throughput as steps/s, except the local row: ms per step, as a local step is quoted."""
    if case.local:
        speed = [f"{1000 / m.steps_per_s:.1f} ms/step" for m in (paddle, ours)]
        speed_ratio = paddle.steps_per_s / ours.steps_per_s
    else:
        speed = [f"{m.steps_per_s:.1f} steps/s" for m in (paddle, ours)]
        speed_ratio = ours.steps_per_s / paddle.steps_per_s
    rpcs = "-" if case.local else " / ".join("?" if m.rpcs is None else f"{m.rpcs:.1f}" for m in (paddle, ours))
    cells = [case.label, *speed, f"{speed_ratio:.2f}", f"{paddle.cpu_ms:.1f}", f"{ours.cpu_ms:.1f}",
             f"{ours.cpu_ms / paddle.cpu_ms:.2f}", rpcs, f"{paddle.elsewhere:.2f} / {ours.elsewhere:.2f}"]
    return "| " + " | ".join(cells) + " |"


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.machine())
    return f"{os.cpu_count()} cores, {model}"


def print_table(results: list[tuple[Case, Measurement, Measurement]], args: argparse.Namespace) -> None:
    print(f"Ours vs Fluid 1.8.5, same Paddle-built programs, {PSERVERS} pservers x {TRAINERS} trainers, sync, "
          f"127.0.0.1 ({time.strftime('%Y-%m-%d', time.gmtime())}, {machine()}); median of {args.repeat} "
          f"alternating runs of {args.steps} timed steps after {args.warmup} warm-up (batch 512: a quarter)")
    print()
    print("| workload (batch per trainer) | Paddle 1.8.5 | ps-transpiler | ours/Paddle | Paddle CPU ms/step "
          "| ours CPU ms/step | ours/Paddle | RPCs/step/pserver Paddle / ours | other load, cores |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case, paddle, ours in results:
        print(row(case, paddle, ours))
    print()
    print("CPU: all 4 processes (1 when local), user + system. Local row: ms per step, ratio ours/Paddle in time. "
          "Other load: cores the rest of the machine kept busy during the runs (Paddle's / ours).")
    moving = [(case, paddle, ours) for case, paddle, ours in results if case.moved_mb]
    if moving:
        rate, core_ms = raw_stream()
        print(f"One raw Python TCP loopback stream (sendall of a memoryview, recv_into a kept buffer), measured now: "
              f"{rate:,.0f} MB/s at {core_ms:.2f} core-ms/MB.")
        for case, paddle, ours in moving:
            cells = [f"{who} {m.steps_per_s * case.moved_mb:,.0f} MB/s ({m.steps_per_s * case.moved_mb / rate:.0%} of it), "
                     f"{m.cpu_ms / case.moved_mb:.2f} core-ms/MB" for who, m in (("Paddle", paddle), ("ours", ours))]
            print(f"{case.label}: {case.moved_mb:,.0f} MB moved per step: " + "; ".join(cells) + ".")
    holding = [(case, paddle, ours) for case, paddle, ours in results if case.param_mb]
    if holding:
        print()
        print("Peak RSS (VmHWM) per process, the largest of each role's, median of the runs, against what the process "
              "must hold (a trainer: params + grads; a pserver: its share of params + optimizer state + one grad per "
              "trainer):")
        print()
        idle = idle_mb()
        print(floor_line(idle) + (" The last column compares our peak with what must be held plus the first." if idle else ""))
        print()
        print("| workload | process | must hold | Paddle 1.8.5 peak (x needed) | ours peak (x needed) "
              "| ours peak / (must hold + idle) |")
        print("|---|---|---:|---:|---:|---:|")
        for case, paddle, ours in holding:
            for role in ("pserver", "trainer"):
                needs = case.needs_mb(role)
                cells = [f"{peak:,.0f} MB ({peak / needs:.2f}x)" if peak else "?" for peak in
                         (getattr(m, f"{role}_peak_mb") for m in (paddle, ours))]
                peak = getattr(ours, f"{role}_peak_mb")
                cells.append(f"{peak / (needs + idle):.2f}x" if peak and idle else "?")
                print(f"| {case.label} | {role} | {needs:,.0f} MB | " + " | ".join(cells) + " |")
    for case, _, _ in results:
        if case.ours_settings:
            print(f"{case.label}: ours with " + " ".join(f"{k}={v}" for k, v in case.ours_settings) + ".")


def print_ours(results: list[tuple[Case, None, Measurement]], args: argparse.Namespace) -> None:
    """`--ours-only`: our figures alone, against the raw stream and what must be held."""
    print(f"ps-transpiler alone, Paddle-built programs, {PSERVERS} pservers x {TRAINERS} trainers, sync, 127.0.0.1 "
          f"({time.strftime('%Y-%m-%d', time.gmtime())}, {machine()}); median of {args.repeat} runs of "
          f"{args.steps} timed steps (times each case's share: wide1g a twentieth) after {args.warmup} warm-up")
    rate, core_ms = raw_stream() if any(case.moved_mb for case, _, _ in results) else (0.0, 0.0)
    idle = idle_mb()
    if rate:
        print(f"One raw Python TCP loopback stream, measured now: {rate:,.0f} MB/s at {core_ms:.2f} core-ms/MB.")
    print(floor_line(idle))
    print()
    print("| workload | steps/s | CPU ms/step | MB/s (of the raw stream) | core-ms/MB "
          "| peak RSS pserver / trainer (x must hold; x must hold + idle) |")
    print("|---|---:|---:|---:|---:|---:|")
    for case, _, ours in results:
        moved = ours.steps_per_s * case.moved_mb
        stream = f"{moved:,.0f} ({moved / rate:.0%})" if case.moved_mb and rate else "-"
        per_mb = f"{ours.cpu_ms / case.moved_mb:.2f}" if case.moved_mb else "-"
        peaks = []
        for role in ("pserver", "trainer"):
            peak, needs = getattr(ours, f"{role}_peak_mb"), case.needs_mb(role) if case.param_mb else 0
            with_idle = f"; {peak / (needs + idle):.2f}x" if peak and needs and idle else ""
            peaks.append(f"{mb(peak)} ({peak / needs:.2f}x{with_idle})" if peak and needs else mb(peak))
        print(f"| {case.label} | {ours.steps_per_s:.2f} | {ours.cpu_ms:.1f} | {stream} | {per_mb} | {' / '.join(peaks)} |")


PEAK_LINE = "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')))"
IDLE_CODE = f"import numpy, grpc, ops.executor, ops.kernels, ops.rpc.server, ops.rpc.client, ops.rpc.bulk; {PEAK_LINE}"
FLOOR_CODE = f"import numpy, grpc; {PEAK_LINE}"  # what no runtime of ours can go below


def idle_mb(code: str = IDLE_CODE) -> float | None:
    """The peak RSS (MB) of a process of ours that imported what a pserver or a trainer
    runs on and holds nothing: the floor under every peak in the memory table. With
    `FLOOR_CODE`: of a Python that imported numpy and gRPC alone."""
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        return int(done.stdout.split()[-1]) / 1024 if done.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def floor_line(idle: float | None) -> str:
    """The idle process's peak beside Python + numpy + gRPC's alone."""
    floor = idle_mb(FLOOR_CODE)
    return (f"An idle process of ours (Python, numpy, gRPC and the runtime imported, nothing held): {mb(idle)}; "
            f"Python with numpy and gRPC alone: {mb(floor)}.")


def raw_stream(total_mb: int = 2048, chunk_mb: int = 32) -> tuple[float, float]:
    """(MB/s, core-ms per MB of both ends) of one TCP loopback stream in Python: the
    ceiling a transport over one connection can reach on this machine right now."""
    chunk = np.ones(chunk_mb << 20, np.uint8)
    with socket.create_server((HOST, 0)) as server:
        port = server.getsockname()[1]

        def receive() -> None:
            connection, _ = server.accept()
            with connection:
                buffer, got = memoryview(bytearray(chunk_mb << 20)), 0
                while got < total_mb << 20:
                    n = connection.recv_into(buffer)
                    if not n:
                        break
                    got += n

        receiver = threading.Thread(target=receive)
        receiver.start()
        cpu, start = time.process_time(), time.perf_counter()
        with socket.create_connection((HOST, port)) as sender:
            for _ in range(total_mb // chunk_mb):
                sender.sendall(memoryview(chunk))
            receiver.join()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return total_mb / seconds, cpu * 1000 / total_mb


# ------------------------------------------------------------------ main


def compile_bytecode() -> None:
    """Write this checkout's `.pyc` files first, as installing a package does: a module
    whose `.pyc` is missing or stale is compiled in every process that imports it (always,
    under `PYTHONDONTWRITEBYTECODE=1`), which costs each process ~1 MB of peak RSS and
    its start-up time, a property of the checkout, not of the runtime measured."""
    for package in ("ops", "transpiler", "proto", "examples"):
        compileall.compile_dir(str(ROOT / package), quiet=2)


def build(python: Path, out: Path) -> None:
    done = subprocess.run([str(python), str(WORKLOADS), "build", str(out)], env=clean_env(),
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RunFailed(f"building the workloads with Paddle failed: {done.stderr.strip()[-2000:]}")


def compare(python: Path, work: Path, case: Case, args: argparse.Namespace) -> tuple[Measurement | None, Measurement]:
    """Paddle, ours, Paddle, ours, ...: the medians (Paddle's None with `--ours-only`)."""
    steps = max(1, round(args.steps * case.steps_share))
    folder = work / case.workload
    runs: dict[str, list[Measurement]] = {"ours": []} if args.ours_only else {"paddle": [], "ours": []}
    for rep in range(args.repeat):
        for who in runs:
            logs = work / "logs" / f"{case.workload}-{case.batch}{'-local' if case.local else ''}-{who}-{rep}"
            logs.mkdir(parents=True, exist_ok=True)
            if who == "paddle":
                got = run_paddle(python, folder, case, steps, args.warmup, logs)
            else:
                got = run_ours(folder, case, steps, args.warmup, logs)
            runs[who].append(got)
            print(f"  {case.label}: {who} run {rep + 1}: {got.steps_per_s:.1f} steps/s, "
                  f"{got.cpu_ms:.1f} CPU ms/step ({got.pserver_cpu_ms:.1f} on pservers), other load {got.elsewhere:.2f} cores, "
                  f"peak RSS pserver / trainer {mb(got.pserver_peak_mb)} / {mb(got.trainer_peak_mb)}",
                  file=sys.stderr, flush=True)
    if args.ours_only:
        return None, median(runs["ours"])
    counted = None if case.local else count_paddle_rpcs(python, work, case, min(steps, RPC_COUNT_STEPS), args.warmup)
    return replace(median(runs["paddle"]), rpcs=counted), median(runs["ours"])


def mb(value: float | None) -> str:
    return "?" if value is None else f"{value:,.0f} MB"


def count_paddle_rpcs(python: Path, work: Path, case: Case, steps: int, warmup: int) -> float:
    """Paddle's RPCs per step per pserver, from an extra run with its request log on."""
    logs = work / "logs" / f"{case.workload}-{case.batch}-paddle-rpcs"
    logs.mkdir(parents=True, exist_ok=True)
    return run_paddle(python, work / case.workload, case, steps, warmup, logs, count_rpcs=True).rpcs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per run (batch 512: a quarter)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps before them")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each side per workload")
    parser.add_argument("--quick", action="store_true", help="a short smoke run: 20 steps, 5 warm-up, 1 repeat")
    parser.add_argument("--keep", type=Path, help="keep programs and logs here (default: a temporary folder)")
    parser.add_argument("--local-only", action="store_true", help="only the local row (no pservers)")
    parser.add_argument("--ours-only", action="store_true",
                        help="run only our side (a size whose Paddle side does not fit in memory: --case wide1g)")
    parser.add_argument("--case", choices=[case.key for case in CASES], action="append",
                        help="only this workload (repeatable; default: all)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeat = 20, 5, 1
    if min(args.steps, args.repeat) < 1 or args.warmup < 0:
        parser.error("--steps and --repeat must be >= 1, --warmup >= 0")
    try:
        python = ensure("1.8.5", log=lambda line: print(line, file=sys.stderr))
    except PaddleUnavailable as error:
        print(f"vs_paddle18: skipped: Paddle 1.8.5 is unavailable here ({error})")
        return 0
    compile_bytecode()
    with tempfile.TemporaryDirectory(prefix="vs_paddle18_") as tmp:
        work = args.keep or Path(tmp)
        build(python, work)
        try:
            cases = [case for case in CASES if (case.local or not args.local_only)
                     and (case.key in args.case if args.case else case.default)]
            results = [(case, *compare(python, work, case, args)) for case in cases]
        except RunFailed as error:
            print(f"vs_paddle18: {error}", file=sys.stderr)
            return 1
    (print_ours if args.ours_only else print_table)(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
