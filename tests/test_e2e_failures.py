"""A trainer killed mid-run: the pserver (`pstranspile serve`) names it and the step,
and exits non-zero once the timeout has passed; the surviving trainer fails with the
pserver's reason instead of hanging. Processes are started here and stopped by their
pids (`e2e_support.Processes`)."""

from __future__ import annotations

import signal
import subprocess
import sys

from e2e_support import EXAMPLES, processes  # noqa: F401 - a fixture

from conftest import PADDLE_PROGRAMS
from transpiler.api import transpile
from transpiler.ir import Program
from transpiler.runtime.launch import free_endpoints
from transpiler.output import pserver_file_stem

TIMEOUT = 3.0
WAIT = 120  # a bound for the test process, not an assertion on speed


def test_a_killed_trainer_makes_the_pserver_fail_naming_it(tmp_path, processes):
    case = PADDLE_PROGRAMS / "mlp_adam_2ps"
    (endpoint,) = free_endpoints(1)
    result = transpile(Program.load(case / "main.pb"), Program.load(case / "startup.pb"), pservers=endpoint, trainers=2)
    result.save(tmp_path / "programs")
    stem = tmp_path / "programs" / pserver_file_stem(endpoint)

    def start(command: list[str], log: str, **env: str) -> subprocess.Popen:
        return processes.start(command, tmp_path / log, **env)

    pserver = start([sys.executable, "-m", "transpiler", "serve", "--program", f"{stem}.pb",
                     "--startup", f"{stem}_startup.pb", "--timeout", str(TIMEOUT)], "pserver.log")
    trainers = [
        start([sys.executable, str(EXAMPLES / "train_program.py"), "--main", str(case / "main.pb"),
               "--startup", str(case / "startup.pb"), "--loss", "mean_0.tmp_0", "--steps", "100",
               "--die-at-step", "3", "--die-trainer", "1"], f"trainer{tid}.log",
              TRAINING_ROLE="TRAINER", PADDLE_PSERVER_ENDPOINTS=endpoint, PADDLE_TRAINERS_NUM="2",
              PADDLE_TRAINER_ID=str(tid), PSTRANSPILE_RPC_TIMEOUT=str(TIMEOUT))
        for tid in range(2)
    ]
    assert pserver.wait(WAIT) == 1
    assert trainers[1].wait(WAIT) == -signal.SIGKILL
    assert trainers[0].wait(WAIT) == 1

    lines = (tmp_path / "pserver.log").read_text().splitlines()
    errors = [line for line in lines if line.startswith("pstranspile: error:")]
    assert len(errors) == 1, lines
    assert f"pserver {endpoint}: trainer 1 sent nothing for 3 s (its last request: fetch barrier at step 3)" in errors[0]
    assert "step 4 waits for its send barrier" in errors[0]
    survivor = (tmp_path / "trainer0.log").read_text()
    assert "trainer 1 sent nothing for 3 s" in survivor and "[progress] trainer=0 step=3" in survivor
    # The surviving trainer's script says why in one line (run_script), not with a traceback.
    assert "Traceback" not in survivor
    assert [line for line in survivor.splitlines() if line.startswith("train_program.py: error: ")], survivor
