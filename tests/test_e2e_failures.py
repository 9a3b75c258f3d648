"""A trainer killed mid-run: the pserver (`pstranspile serve`) names it and the step,
and exits non-zero seconds later (its connection closed), not after the RPC timeout; the
surviving trainer fails with the pserver's reason instead of hanging. A frozen pserver
(SIGSTOP): the healthy one names it, not an innocent trainer; a frozen trainer: the
pserver names it. Processes are started here and stopped by their pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from e2e_support import EXAMPLES, Processes, processes  # noqa: F401  (the fixture)

from conftest import PADDLE_PROGRAMS
from transpiler.api import transpile
from transpiler.ir import Program
from transpiler.runtime.launch import free_endpoints
from transpiler.output import pserver_file_stem

WAIT = 120  # a bound for the test process, not an assertion on speed


def _start(tmp_path, processes: Processes, command: list[str], log: str, **env: str) -> subprocess.Popen:
    return processes.start(command, tmp_path / log, **env)


def _serve(tmp_path, processes, stem, log: str, *extra: str) -> subprocess.Popen:
    return _start(tmp_path, processes, [sys.executable, "-m", "transpiler", "serve", "--program", f"{stem}.pb",
                                        "--startup", f"{stem}_startup.pb", *extra], log)


def _trainer(tmp_path, processes, case, endpoints: str, tid: int, *extra: str, **env: str) -> subprocess.Popen:
    return _start(tmp_path, processes,
                  [sys.executable, str(EXAMPLES / "train_program.py"), "--main", str(case / "main.pb"),
                   "--startup", str(case / "startup.pb"), "--loss", "mean_0.tmp_0", *extra], f"trainer{tid}.log",
                  TRAINING_ROLE="TRAINER", PADDLE_PSERVER_ENDPOINTS=endpoints, PADDLE_TRAINERS_NUM="2",
                  PADDLE_TRAINER_ID=str(tid), **env)


def _errors(path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("pstranspile: error:")]


def test_a_killed_trainer_makes_the_pserver_fail_naming_it(tmp_path, processes):
    """With the default timeout (120 s): the killed trainer's connection closed, and the
    pserver names it after the grace (3 s), not after the timeout."""
    case = PADDLE_PROGRAMS / "mlp_adam_2ps"
    (endpoint,) = free_endpoints(1)
    result = transpile(Program.load(case / "main.pb"), Program.load(case / "startup.pb"), pservers=endpoint, trainers=2)
    result.save(tmp_path / "programs")
    stem = tmp_path / "programs" / pserver_file_stem(endpoint)
    pserver = _serve(tmp_path, processes, stem, "pserver.log")
    # Early receives off: the step-3 fetch barrier then has its replies when the trainer dies
    # after step 3, so the pserver's last request from it is that one (with them on, it may
    # die while they are in flight: tests/test_early_recv.py).
    trainers = [_trainer(tmp_path, processes, case, endpoint, tid, "--steps", "100", "--die-at-step", "3",
                         "--die-trainer", "1", PSTRANSPILE_EARLY_RECV="off") for tid in range(2)]
    assert trainers[1].wait(WAIT) == -signal.SIGKILL
    died = time.monotonic()
    assert pserver.wait(WAIT) == 1
    detected = time.monotonic() - died  # the grace, the pserver's linger (1 s) and its exit
    print(f"killed trainer -> pserver exit: {detected:.1f} s (rpc timeout 120 s)")
    assert detected < 60  # a bound on a loaded machine; measured 4.4-4.6 s
    assert trainers[0].wait(WAIT) == 1

    errors = _errors(tmp_path / "pserver.log")
    assert len(errors) == 1, errors
    assert f"pserver {endpoint}: trainer 1's connection closed at step " in errors[0]
    assert "and it did not come back within 3 s (its last request: fetch barrier at step 3)" in errors[0]
    assert "step 4 waits for its send barrier" in errors[0]
    survivor = (tmp_path / "trainer0.log").read_text()
    assert "trainer 1's connection closed" in survivor and "[progress] trainer=0 step=3" in survivor
    # The surviving trainer's script says why in one line (run_script), not with a traceback.
    assert "Traceback" not in survivor
    assert [line for line in survivor.splitlines() if line.startswith("train_program.py: error: ")], survivor


def test_a_frozen_pserver_is_named_not_an_innocent_trainer(tmp_path, processes):
    """SIGSTOP one of two pservers mid-run: the trainers' keepalive finds it frozen, they
    fail naming it, and the healthy pserver's error carries that (not "trainer K sent
    nothing"). The frozen pserver is killed by its pid at the end."""
    case = PADDLE_PROGRAMS / "mlp_adam_2ps"
    endpoints = free_endpoints(2)
    eps = ",".join(endpoints)
    result = transpile(Program.load(case / "main.pb"), Program.load(case / "startup.pb"), pservers=eps, trainers=2)
    result.save(tmp_path / "programs")
    healthy, frozen = (_serve(tmp_path, processes, tmp_path / "programs" / pserver_file_stem(ep), f"pserver{i}.log")
                       for i, ep in enumerate(endpoints))
    trainers = [_trainer(tmp_path, processes, case, eps, tid, "--steps", "100000") for tid in range(2)]
    log = tmp_path / "trainer0.log"
    deadline = time.monotonic() + WAIT
    while "[progress] trainer=0 step=3" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "[progress] trainer=0 step=3" in log.read_text()
    os.kill(frozen.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    assert healthy.wait(WAIT) == 1
    detected = time.monotonic() - stopped
    print(f"frozen pserver -> healthy pserver exit: {detected:.1f} s (rpc timeout 120 s)")
    assert detected < 90  # keepalive 3 s + 10 s, then the failure notice; a bound on a loaded machine
    for trainer in trainers:
        assert trainer.wait(WAIT) == 1
    (error,) = _errors(tmp_path / "pserver0.log")
    assert f"pserver {endpoints[0]}: trainer " in error and " failed: " in error
    assert f"on pserver {endpoints[1]}" in error and "sent nothing" not in error, error
    os.kill(frozen.pid, signal.SIGKILL)
    frozen.wait(WAIT)


def test_a_frozen_trainer_is_named_by_the_pserver(tmp_path, processes):
    """SIGSTOP a trainer mid-run: the pserver's keepalive finds its connection dead, its
    Watch ends, and after the grace the pserver names it (timeout 120 s)."""
    case = PADDLE_PROGRAMS / "mlp_adam_2ps"
    (endpoint,) = free_endpoints(1)
    result = transpile(Program.load(case / "main.pb"), Program.load(case / "startup.pb"), pservers=endpoint, trainers=2)
    result.save(tmp_path / "programs")
    pserver = _serve(tmp_path, processes, tmp_path / "programs" / pserver_file_stem(endpoint), "pserver.log")
    trainers = [_trainer(tmp_path, processes, case, endpoint, tid, "--steps", "100000") for tid in range(2)]
    log = tmp_path / "trainer1.log"
    deadline = time.monotonic() + WAIT
    while "[progress] trainer=1 step=3" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(trainers[1].pid, signal.SIGSTOP)
    stopped = time.monotonic()
    assert pserver.wait(WAIT) == 1
    print(f"frozen trainer -> pserver exit: {time.monotonic() - stopped:.1f} s (rpc timeout 120 s)")
    assert trainers[0].wait(WAIT) == 1
    (error,) = _errors(tmp_path / "pserver.log")
    assert f"pserver {endpoint}: trainer 1's connection closed at step " in error, error
    os.kill(trainers[1].pid, signal.SIGKILL)
    trainers[1].wait(WAIT)
