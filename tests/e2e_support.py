"""Helpers the end-to-end tests share (no tests here): launch a job of
`examples/train_program.py`, train the same batches locally, and start processes of a
job one by one (`processes`, a fixture)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from conftest import TESTS
from transpiler.ir import Program
from transpiler.runtime.launch import LaunchConfig, LaunchResult, launch

REPO = TESTS.parent
EXAMPLES = REPO / "examples"
STEPS, BATCH, SEED = 20, 16, 0
# Every process of a test, and its local reference run, uses one BLAS thread: a matmul
# split over threads adds in another order, and that rounding is not the runtime's.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def save(tmp: Path, main: Program, startup: Program) -> tuple[Path, Path]:
    tmp.mkdir(parents=True, exist_ok=True)
    main.save(tmp / "main.pb")
    startup.save(tmp / "startup.pb")
    return tmp / "main.pb", tmp / "startup.pb"


def launch_training(
    tmp: Path, main_pb: Path, startup_pb: Path, *, pservers: int, trainers: int = 2, sync_mode: bool = True,
    loss: str = "mean_0.tmp_0", extra: tuple[str, ...] = (), timeout: float = 60.0, env: dict[str, str] | None = None,
) -> LaunchResult:
    command = (
        sys.executable, str(EXAMPLES / "train_program.py"), "--main", str(main_pb), "--startup", str(startup_pb),
        "--loss", loss, "--steps", str(STEPS), "--batch", str(BATCH), "--seed", str(SEED), "--save", str(tmp / "params"),
        *extra,
    )
    return launch_ok(tmp, command, pservers=pservers, trainers=trainers, sync_mode=sync_mode, timeout=timeout, env=env)


def launch_ok(tmp: Path, command: tuple[str, ...], *, pservers: int, trainers: int, sync_mode: bool,
              timeout: float, env: dict[str, str] | None = None) -> LaunchResult:
    """Launch `command` as M pservers and N trainers (one BLAS thread each, `env` added,
    logs under `tmp`); fail the test with every log's tail when the job fails."""
    config = LaunchConfig(command=command, pservers=pservers, trainers=trainers, sync_mode=sync_mode,
                          env={**ONE_THREAD, **(env or {})},
                          log_dir=tmp / "logs", rpc_timeout=timeout, status_every=60.0, exit_grace=30.0)
    tmp.mkdir(parents=True, exist_ok=True)
    log = tmp / "launch.txt"
    with open(log, "w") as out:
        result = launch(config, out=out)
    assert result.ok, f"{result.failure}\n{log.read_text()}\n" + "\n".join(
        f"--- {p.log}\n" + "\n".join(p.tail) for p in result.processes
    )
    return result


def trained_params(tmp: Path, trainer: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(initial, final) params trainer `trainer` saved."""
    saved = np.load(tmp / "params" / f"trainer_{trainer}.npz")
    initial = {k[len("init/"):]: saved[k] for k in saved.files if k.startswith("init/")}
    final = {k[len("final/"):]: saved[k] for k in saved.files if k.startswith("final/")}
    return initial, final


def train_locally(tmp: Path, main_pb: Path, startup_pb: Path, loss: str = "mean_0.tmp_0", *,
                  permute: bool = False) -> dict[str, np.ndarray]:
    """The untranspiled program on the whole batches, from the params trainer 0 received,
    by the same script in a process of its own (one BLAS thread, like the trainers).
    `permute`: each batch's examples in another order, the rounding control (a mean loss
    does not depend on the order; what changes is float32 rounding alone)."""
    out = tmp / ("local_permuted" if permute else "local")
    command = [
        sys.executable, str(EXAMPLES / "train_program.py"), "--main", str(main_pb), "--startup", str(startup_pb),
        "--loss", loss, "--steps", str(STEPS), "--batch", str(BATCH), "--seed", str(SEED),
        "--init", str(tmp / "params" / "trainer_0.npz"), "--save", str(out), *(("--permute",) if permute else ()),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINING_ROLE", "PADDLE_"))}
    env.update(ONE_THREAD)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    saved = np.load(out / "local.npz")
    return {k[len("final/"):]: saved[k] for k in saved.files if k.startswith("final/")}


def scaled_difference(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b|: a difference on the parameter's scale."""
    return float(np.abs(a.astype(np.float64) - b).max()) / (float(np.abs(b).max()) or 1.0)


def differences(dist: dict[str, np.ndarray], local: dict[str, np.ndarray]) -> dict[str, tuple[float, float]]:
    """Per param: (max element-wise relative difference, max |difference| / max |local|)."""
    out = {}
    for name, a in local.items():
        diff = np.abs(dist[name].astype(np.float64) - a)
        scale = float(np.abs(a).max()) or 1.0
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(diff == 0, 0.0, diff / np.abs(a))
        out[name] = (float(rel.max()), float(diff.max()) / scale)
    return out


# ------------------------------------------------------------------ any script


def launch_script(tmp: Path, args: tuple[str, ...], *, pservers: int, trainers: int = 2, sync_mode: bool = True,
                  timeout: float = 60.0) -> LaunchResult:
    """Launch `python3 <args...>` (a script under examples/ and its flags) as M pservers and
    N trainers; fail the test with every log's tail when the job fails."""
    return launch_ok(tmp, (sys.executable, *args), pservers=pservers, trainers=trainers, sync_mode=sync_mode,
                     timeout=timeout)


def run_script_locally(args: tuple[str, ...]) -> str:
    """Run `python3 <args...>` with no role in the environment (local training), one BLAS
    thread; its stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINING_ROLE", "PADDLE_"))}
    env.update(ONE_THREAD)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


# ------------------------------------------------------------------ processes one by one


def job_free_env(**extra: str) -> dict[str, str]:
    """This process's environment without any job's role or settings (`TRAINING_ROLE`,
    `PADDLE_*`, `PSTRANSPILE_*`), with one BLAS thread, this checkout importable,
    unbuffered output, and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINING_ROLE", "PADDLE_", "PSTRANSPILE_"))}
    env.update(ONE_THREAD, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **extra)
    return env


class Processes:
    """The processes a test starts: each in a process group of its own, its output in a
    log, with `job_free_env(**env)`; `stop()` kills those still running, by their own pid."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []

    def start(self, command: Sequence[str], log: Path, **env: str) -> subprocess.Popen:
        with open(log, "w") as out:
            proc = subprocess.Popen(list(command), env=job_free_env(**env), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=REPO)
        self.started.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def processes() -> Iterator[Processes]:
    """`Processes`, stopped after the test (import this fixture into the test module)."""
    started = Processes()
    yield started
    started.stop()
