"""The job token and the handshake across real processes: a job whose trainer 1 was
started with `PADDLE_TRAINERS_NUM=3` against pservers built for 2 stops on every process
with one clear reason; a launched job trains over mutual TLS; `serve` refuses a
non-loopback address without a token before anything binds. Processes listen on
127.0.0.1 only (6170 is never bound: the refusals come first) and are stopped by their
own pids (`e2e_support.Processes`, `launch`)."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from e2e_support import EXAMPLES, ONE_THREAD, REPO, job_free_env, processes  # noqa: F401 - a fixture
from rpc_support import self_signed

from conftest import PADDLE_PROGRAMS
from transpiler.api import transpile
from transpiler.ir import Program
from transpiler.output import pserver_file_stem
from transpiler.runtime.launch import LaunchConfig, free_endpoints, launch

WAIT = 120  # a bound for the test process, not an assertion on speed
TOKEN = "e2e-job-token-0123456789abcdefghij"


def serve_cli(tmp_path, *flags: str, cwd=REPO) -> subprocess.CompletedProcess:
    """`pstranspile serve` of a 1-trainer pserver program for 127.0.0.1:6170 with `flags`,
    expected to fail before anything binds."""
    case = PADDLE_PROGRAMS / "mlp_adam_2ps"
    endpoint = "127.0.0.1:6170"
    transpile(Program.load(case / "main.pb"), Program.load(case / "startup.pb"), pservers=endpoint,
              trainers=1).save(tmp_path)
    stem = tmp_path / pserver_file_stem(endpoint)
    return subprocess.run([sys.executable, "-m", "transpiler", "serve", "--program", f"{stem}.pb", "--startup",
                           f"{stem}_startup.pb", *flags], env=job_free_env(), capture_output=True, text=True,
                          timeout=WAIT, cwd=cwd, check=False)


def test_a_trainer_started_for_3_trainers_stops_a_job_built_for_2_on_every_process(tmp_path, processes):
    case = PADDLE_PROGRAMS / "mlp_adam_2ps"
    endpoints = free_endpoints(2)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    transpile(Program.load(case / "main.pb"), Program.load(case / "startup.pb"), pservers=endpoints,
              trainers=2).save(tmp_path / "programs")
    stem = tmp_path / "programs" / pserver_file_stem(endpoints[0])
    script = [sys.executable, str(EXAMPLES / "train_program.py"), "--main", str(case / "main.pb"),
              "--startup", str(case / "startup.pb"), "--loss", "mean_0.tmp_0", "--steps", "50"]
    job = {"PADDLE_PSERVER_ENDPOINTS": ",".join(endpoints), "PSTRANSPILE_RPC_TIMEOUT": "60",
           "PSTRANSPILE_JOB_TOKEN_FILE": str(token_file)}

    def start(command: list[str], log: str, **env: str) -> subprocess.Popen:
        return processes.start(command, tmp_path / log, **job, **env)

    # pserver 0 through the CLI (token file, plan.json), pserver 1 through a Session, as `launch` runs them
    start([sys.executable, "-m", "transpiler", "serve", "--program", f"{stem}.pb", "--startup", f"{stem}_startup.pb",
           "--token-file", str(token_file), "--plan", str(tmp_path / "programs" / "plan.json")], "pserver0.log")
    start(script, "pserver1.log", TRAINING_ROLE="PSERVER", PADDLE_TRAINERS_NUM="2",
          PADDLE_CURRENT_ENDPOINT=endpoints[1])
    start(script, "trainer0.log", TRAINING_ROLE="TRAINER", PADDLE_TRAINERS_NUM="2", PADDLE_TRAINER_ID="0")
    start(script, "trainer1.log", TRAINING_ROLE="TRAINER", PADDLE_TRAINERS_NUM="3", PADDLE_TRAINER_ID="1")
    codes = [proc.wait(WAIT) for proc in processes.started]

    logs = {name: (tmp_path / f"{name}.log").read_text() for name in ("pserver0", "pserver1", "trainer0", "trainer1")}
    reason = "trainer 1 was started for 3 trainer(s), sync"
    assert all(code != 0 for code in codes), (codes, logs)
    for name, text in logs.items():
        assert reason in text and "the trainer count (PADDLE_TRAINERS_NUM) differs" in text, (name, text)
        assert TOKEN not in text, name
    errors = [line for line in logs["pserver0"].splitlines() if line.startswith("pstranspile: error:")]
    assert len(errors) == 1 and "but this pserver serves 2 trainer(s), sync: " in errors[0], logs["pserver0"]
    assert f"pserver {endpoints[0]}: job token required on every RPC, no TLS" in logs["pserver0"]
    assert "FAILED_PRECONDITION" in logs["trainer1"]


def test_serve_refuses_a_non_loopback_address_without_a_token(tmp_path):
    done = serve_cli(tmp_path, "--endpoint", "0.0.0.0:6170")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "pstranspile: error: pserver 127.0.0.1:6170: refusing to listen on 0.0.0.0:6170 without a job token"), lines


def test_launch_tls_files_that_cannot_work_are_user_errors(tmp_path):
    for flags, says in ((("--tls-cert", "missing.pem", "--tls-key", "missing.key"), "cannot read the TLS key"),
                        (("--tls-ca", "ca.pem"), "TLS needs a certificate and key"),
                        (("--tls-key", "k.pem"), "TLS needs a certificate and its key together")):
        done = subprocess.run([sys.executable, "-m", "transpiler", "launch", "--pservers", "1", "--trainers", "1",
                               *flags, "--", "true"], cwd=tmp_path, env=job_free_env(), capture_output=True, text=True,
                              timeout=60, check=False)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and says in lines[0], (flags, done.stderr)
        assert not (tmp_path / "logs").exists()  # nothing started


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--tls-cert", "missing.pem", "--tls-key", "missing.key"), "cannot read the TLS key missing.key"),
        (("--tls-cert", "missing.pem"), "TLS needs a certificate and its key together"),
        (("--token-file", "missing"), "cannot read the job token file missing"),
        (("--plan", "missing.json"), "cannot read the plan missing.json"),
    ],
)
def test_serve_security_settings_that_cannot_work_are_user_errors(tmp_path, flags, says):
    done = serve_cli(tmp_path, *flags, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pstranspile: error: ") and says in lines[0], lines


def test_a_launched_job_trains_over_mutual_tls(tmp_path):
    """`pstranspile launch --tls-cert/--tls-key/--tls-ca` with one certificate for every
    process (pservers: server cert; trainers: client cert, and the CA that verifies the
    pservers): it trains, with a job token."""
    certs = self_signed(tmp_path, "job")
    case = PADDLE_PROGRAMS / "mlp_adam_2ps"
    command = (sys.executable, str(EXAMPLES / "train_program.py"), "--main", str(case / "main.pb"),
               "--startup", str(case / "startup.pb"), "--loss", "mean_0.tmp_0", "--steps", "5")
    env = job_free_env(**ONE_THREAD)
    done = subprocess.run([sys.executable, "-m", "transpiler", "launch", "--pservers", "2", "--trainers", "2",
                           "--log-dir", "logs", "--timeout", "60", "--tls-cert", "job.pem", "--tls-key",
                           "job.key", "--tls-ca", "job.pem", "--", *command],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
    logs = {p.stem: p.read_text() for p in (tmp_path / "logs").iterdir()}
    assert done.returncode == 0, (done.stderr, logs)
    for name in ("pserver.0", "pserver.1"):
        assert "job token required on every RPC, TLS with client certificates" in logs[name], logs[name]
    assert all("[progress] trainer=" in logs[f"trainer.{i}"] and "step=5" in logs[f"trainer.{i}"] for i in (0, 1))
