"""`transpiler.runtime.launch` and `pstranspile serve|launch` on tiny scripts: Paddle's
environment conventions, one log per process, live progress, the summary, and a
failing process stopping the job with a non-zero exit."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import TESTS
from transpiler.runtime.launch import LaunchConfig, LaunchError, free_endpoints, launch
from transpiler.runtime.progress import Progress, format_progress, parse_progress

REPO = TESTS.parent

# Trainers record their environment and report progress; pservers wait for every
# trainer's record (as real ones wait for every trainer's complete notice). MODE picks
# a misbehaviour.
SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    role = os.environ["TRAINING_ROLE"]
    keys = [k for k in os.environ if k.startswith(("PADDLE_", "PSTRANSPILE_", "TRAINING_ROLE", "POD_IP"))]
    keys += ["OPENBLAS_NUM_THREADS", "PYTHONUNBUFFERED"]
    me = os.environ.get("PADDLE_TRAINER_ID") if role == "TRAINER" else os.environ["PADDLE_CURRENT_ENDPOINT"].replace(":", "_")
    with open(os.path.join(out, f"{role}.{me}.json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
    if role == "TRAINER":
        for step in range(1, 4):
            print(f"[progress] trainer={me} step={step} loss={1.0 / step:.4f} steps/s=10")
        print("some other output")
        if mode == "fail" and me == "1":
            print("trainer 1: giving up", file=sys.stderr)
            sys.exit(3)
        sys.exit(0)
    if mode in ("fail", "linger"):
        time.sleep(600)
    n = int(os.environ["PADDLE_TRAINERS_NUM"])
    while sum(name.startswith("TRAINER.") for name in os.listdir(out)) < n:
        time.sleep(0.05)
    """
)


def run(tmp_path, mode: str = "ok", **config) -> tuple:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    (tmp_path / "out").mkdir()
    config.setdefault("pservers", 2)
    config.setdefault("trainers", 2)
    out = io.StringIO()
    result = launch(LaunchConfig(command=(sys.executable, str(script), str(tmp_path / "out"), mode),
                                 log_dir=tmp_path / "logs", status_every=0.2, **config), out=out)
    return result, out.getvalue()


def test_every_process_gets_paddle_s_environment_and_a_log(tmp_path):
    result, text = run(tmp_path, rpc_timeout=33.0)
    assert result.ok and result.failure is None, text
    records = {p.name: json.loads(p.read_text()) for p in (tmp_path / "out").iterdir()}
    endpoints = [p.endpoint for p in result.processes if p.role == "pserver"]
    assert len(set(endpoints)) == 2 and all(ep.startswith("127.0.0.1:") for ep in endpoints)
    for tid in ("0", "1"):
        env = records[f"TRAINER.{tid}.json"]
        assert env["TRAINING_ROLE"] == "TRAINER" and env["PADDLE_TRAINER_ID"] == tid
        assert env["PADDLE_TRAINERS_NUM"] == "2" and env["PADDLE_PSERVER_ENDPOINTS"] == ",".join(endpoints)
        assert env["PSTRANSPILE_SYNC_MODE"] == "1" and env["PSTRANSPILE_RPC_TIMEOUT"] == "33"
        assert "PADDLE_CURRENT_ENDPOINT" not in env and env["PYTHONUNBUFFERED"] == "1"
        assert env["OPENBLAS_NUM_THREADS"] is not None
    for endpoint in endpoints:
        env = records[f"PSERVER.{endpoint.replace(':', '_')}.json"]
        assert env["TRAINING_ROLE"] == "PSERVER" and env["PADDLE_CURRENT_ENDPOINT"] == endpoint
        assert env["POD_IP"] == "127.0.0.1" and env["PADDLE_PORT"] == endpoint.rpartition(":")[2]
        assert "PADDLE_TRAINER_ID" not in env
    (token,) = {env["PSTRANSPILE_JOB_TOKEN"] for env in records.values()}  # one per job, in every process
    assert len(token) >= 40 and token not in text
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["metrics.jsonl", "pserver.0.log", "pserver.1.log", "trainer.0.log", "trainer.1.log"]
    assert "some other output" in (tmp_path / "logs" / "trainer.1.log").read_text()


def test_progress_is_parsed_and_the_summary_lists_every_process(tmp_path):
    result, text = run(tmp_path, sync_mode=False)
    assert result.ok, text
    for trainer in result.trainers():
        assert trainer.progress == Progress(str(trainer.index), 3, 0.3333, 10.0)
    summary = result.summary()
    assert summary.splitlines()[0].startswith("launch: 2 pserver(s) x 2 trainer(s), async,") and summary.endswith(
        "trainer.1.log") and ": ok" in summary.splitlines()[0]
    assert "trainer.0" in summary and "0.3333" in summary and "pserver.1" in summary
    assert summary in text


def test_a_failing_trainer_stops_the_others_and_fails_the_job(tmp_path):
    result, text = run(tmp_path, "fail", trainers=3)
    assert not result.ok
    assert result.failure == f"trainer.1 exited with code 3 at step 3 (log: {tmp_path / 'logs' / 'trainer.1.log'})"
    states = {p.name: p.exit_text for p in result.processes}
    assert states["trainer.1"] == "3" and states["pserver.0"] == "stopped" and states["pserver.1"] == "stopped"
    assert "trainer 1: giving up" in text  # the failing log's tail is shown
    assert "FAILED: trainer.1 exited with code 3" in text


def test_pservers_that_outlive_the_trainers_fail_the_job(tmp_path):
    result, text = run(tmp_path, "linger", pservers=1, trainers=1, exit_grace=0.5)
    assert not result.ok and result.failure == "pserver.0 still running 0.5 s after every trainer finished"
    assert {p.name: p.exit_text for p in result.processes} == {"pserver.0": "stopped", "trainer.0": "0"}


def test_bad_configurations_are_launch_errors(tmp_path):
    for config, match in (
        (LaunchConfig(command=()), "no command"),
        (LaunchConfig(command=("true",), trainers=0), "trainers must be an integer >= 1"),
        (LaunchConfig(command=("true",), pservers=2, endpoints=("127.0.0.1:1",)), "1 endpoint"),
        (LaunchConfig(command=("true",), endpoints=("nohost",)), "malformed pserver endpoint"),
        (LaunchConfig(command=("true",), pservers=2, endpoints=("127.0.0.1:1", "")), "entry 2 of 2 is empty"),
    ):
        with pytest.raises(LaunchError, match=match):
            launch(config, out=io.StringIO())
    out = io.StringIO()
    result = launch(LaunchConfig(command=(str(tmp_path / "missing"),), pservers=2, trainers=3, log_dir=tmp_path),
                    out=out)
    assert not result.ok and "cannot start" in result.failure
    # the configured counts, not the (zero) processes that started
    assert result.summary() == out.getvalue().strip() == (
        f"launch: 2 pserver(s) x 3 trainer(s), sync, {result.seconds:.1f} s: FAILED: cannot start "
        f"'{tmp_path / 'missing'}': No such file or directory (0 of 5 processes started)")


# A job that fails on its first attempt: trainer 1 exits 5, after trainer 0 "checkpointed"
# (a complete checkpoint folder, as `ops.rpc.checkpoint` writes it) unless told not to.
RESTARTING = textwrap.dedent(
    """
    import json, os, pathlib, sys, time
    out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
    env = os.environ
    me = env["TRAINING_ROLE"] + "." + env.get("PADDLE_TRAINER_ID", env.get("PADDLE_CURRENT_ENDPOINT", ""))
    attempt = "restored" if env.get("PSTRANSPILE_RESTORE") else "first"
    keys = ("PSTRANSPILE_CHECKPOINT_DIR", "PSTRANSPILE_CHECKPOINT_EVERY", "PSTRANSPILE_RESTORE")
    (out / f"{attempt}.{me}.json").write_text(json.dumps({k: env.get(k) for k in keys}))
    ckpt = pathlib.Path(env["PSTRANSPILE_CHECKPOINT_DIR"])
    if env["TRAINING_ROLE"] == "TRAINER" and env["PADDLE_TRAINER_ID"] == "0" and mode == "checkpoint":
        (ckpt / "ckpt-4").mkdir(parents=True, exist_ok=True)
        (ckpt / "ckpt-4" / "MANIFEST.json").write_text(json.dumps({"step": 4}))
        (ckpt / "latest").write_text("ckpt-4")
    print(f"[progress] trainer={env.get('PADDLE_TRAINER_ID', 'x')} step=6")
    if me == "TRAINER.1" and (attempt == "first" or mode == "always"):
        for _ in range(100):  # after trainer 0's checkpoint
            if mode != "checkpoint" or (ckpt / "latest").exists():
                break
            time.sleep(0.05)
        sys.exit(5)
    """
)


def run_restarting(tmp_path, mode: str, **config) -> tuple:
    script = tmp_path / "job.py"
    script.write_text(RESTARTING)
    (tmp_path / "out").mkdir()
    out = io.StringIO()
    result = launch(LaunchConfig(command=(sys.executable, str(script), str(tmp_path / "out"), mode), pservers=1,
                                 trainers=2, log_dir=tmp_path / "logs", status_every=60.0,
                                 checkpoint_dir=tmp_path / "ckpt", **config), out=out)
    return result, out.getvalue()


def test_max_restarts_restarts_every_process_from_the_newest_checkpoint(tmp_path):
    result, text = run_restarting(tmp_path, "checkpoint", max_restarts=2, checkpoint_every=4)
    assert result.ok, text
    first_failure = f"trainer.1 exited with code 5 at step 6 (log: {tmp_path / 'logs' / 'trainer.1.log'})"
    assert result.restarts == [first_failure]
    assert "launch: restart 1 of 2, from checkpoint ckpt-4" in text and f"restart 1 after: {first_failure}" in text
    records = {p.name: json.loads(p.read_text()) for p in (tmp_path / "out").iterdir()}
    assert sorted(name.split(".")[0] for name in records) == ["first"] * 3 + ["restored"] * 3  # every process, twice
    for name, env in records.items():
        assert env["PSTRANSPILE_CHECKPOINT_DIR"] == str(tmp_path / "ckpt") and env["PSTRANSPILE_CHECKPOINT_EVERY"] == "4"
        assert env["PSTRANSPILE_RESTORE"] == (str(tmp_path / "ckpt") if name.startswith("restored") else None), name
    assert sorted(p.name for p in (tmp_path / "logs" / "restart-1").iterdir()) == [
        "pserver.0.log", "trainer.0.log", "trainer.1.log"]
    assert all(str(p.log).startswith(str(tmp_path / "logs" / "restart-1")) for p in result.processes)
    # One metrics file for the job, each record marked with its attempt; the pserver's
    # progress-looking line is no trainer's record.
    metrics = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["attempt"], r["role"], r["trainer"], r["step"]) for r in metrics) == [
        (0, "trainer", 0, 6), (0, "trainer", 1, 6), (1, "trainer", 0, 6), (1, "trainer", 1, 6)]


def test_a_restart_before_any_checkpoint_starts_from_scratch_and_restarts_are_bounded(tmp_path):
    result, text = run_restarting(tmp_path, "always", max_restarts=1)
    assert not result.ok and len(result.restarts) == 1, text
    assert "restart 1 of 1, from the start (no complete checkpoint yet)" in text
    assert not any(name.startswith("restored") for name in (p.name for p in (tmp_path / "out").iterdir()))
    assert result.failure.startswith("trainer.1 exited with code 5") and "logs/restart-1/" in result.failure


# A job whose first attempt checkpoints and fails, and whose restores then fail in the
# pserver before any step (as an unrestorable checkpoint did): the same error line each
# time, but for the endpoint (a new port each attempt), unless MODE is `varying`.
RESTORE_FAILS = textwrap.dedent(
    """
    import json, os, pathlib, sys, time
    out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
    env = os.environ
    ckpt = pathlib.Path(env["PSTRANSPILE_CHECKPOINT_DIR"])
    restored = bool(env.get("PSTRANSPILE_RESTORE"))
    if env["TRAINING_ROLE"] == "PSERVER":
        if restored:
            attempts = len(list(out.iterdir()))
            (out / f"attempt{attempts}").write_text("")
            detail = f" (attempt {attempts})" if mode == "varying" else ""
            print(f"pserver {env['PADDLE_CURRENT_ENDPOINT']}: error: {ckpt}/ckpt-4/ps0/lr: shape [1], the manifest says []"
                  + detail, file=sys.stderr, flush=True)
            sys.exit(2)
        time.sleep(600)
    if restored:
        time.sleep(600)  # waits for the pserver, which fails first
    (ckpt / "ckpt-4").mkdir(parents=True, exist_ok=True)
    (ckpt / "ckpt-4" / "MANIFEST.json").write_text(json.dumps({"step": 4}))
    (ckpt / "latest").write_text("ckpt-4")
    print(f"[progress] trainer={env['PADDLE_TRAINER_ID']} step=6", flush=True)
    sys.exit(5)
    """
)


@pytest.mark.parametrize("mode", ["same", "varying"])
def test_a_restore_that_fails_the_same_way_twice_stops_the_job(tmp_path, mode):
    script = tmp_path / "job.py"
    script.write_text(RESTORE_FAILS)
    (tmp_path / "out").mkdir()
    out = io.StringIO()
    result = launch(LaunchConfig(command=(sys.executable, str(script), str(tmp_path / "out"), mode), pservers=1,
                                 trainers=1, log_dir=tmp_path / "logs", status_every=60.0, stop_grace=1.0,
                                 checkpoint_dir=tmp_path / "ckpt", max_restarts=4), out=out)
    assert not result.ok
    if mode == "same":  # the first restart's failure, then the same again: stop, 2 restarts of 4 spent
        assert len(result.restarts) == 2 and len(list((tmp_path / "out").iterdir())) == 2, out.getvalue()
        assert result.failure.startswith("the restart from ckpt-4 failed the same way twice, before any step past it "
                                         "(not restarting again): pserver.0 exited with code 2"), result.failure
        assert "failed the same way twice" in out.getvalue()
    else:  # errors that differ are not one deterministic failure: every restart is spent
        assert len(result.restarts) == 4 and len(list((tmp_path / "out").iterdir())) == 4, out.getvalue()
        assert result.failure.startswith("pserver.0 exited with code 2"), result.failure


def test_restart_and_backend_options_are_checked():
    for config, match in (
        (LaunchConfig(command=("true",), max_restarts=1), "give a checkpoint dir"),
        (LaunchConfig(command=("true",), checkpoint_every=3), "a checkpoint cadence needs a checkpoint dir"),
        (LaunchConfig(command=("true",), max_restarts=-1), "max restarts must be an integer >= 0"),
        (LaunchConfig(command=("true",), backend="slurm"), "unknown backend 'slurm'"),
        (LaunchConfig(command=("true",), backend="ray", endpoints=("127.0.0.1:1",)), "places the pservers itself"),
        (LaunchConfig(command=("true",), address="10.0.0.1:6379"), "an address is for the ray backend"),
        (LaunchConfig(command=("true",), backend="ray", placement="strict"), "unknown placement 'strict'"),
        (LaunchConfig(command=("true",), backend="ray", cpus_per_process=0), "cpus per process must be positive"),
    ):
        with pytest.raises(LaunchError, match=match):
            launch(config, out=io.StringIO())


def test_free_endpoints_are_distinct():
    endpoints = free_endpoints(5)
    assert len(set(endpoints)) == 5


def test_progress_lines_round_trip():
    line = format_progress(Progress("0", 12, 0.25, 31.5))
    assert line == "[progress] trainer=0 step=12 loss=0.25 steps/s=31.5"
    assert parse_progress(line) == Progress("0", 12, 0.25, 31.5)
    assert parse_progress("[progress] trainer=local step=3") == Progress("local", 3)
    assert parse_progress("step=3 loss=1") is None and parse_progress("[progress] step=x") is None


# ------------------------------------------------------------------ the CLI


def cli(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transpiler", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, check=False)


def test_cli_launch_runs_the_command_after_the_double_dash(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    (tmp_path / "out").mkdir()
    done = cli("launch", "--pservers", "1", "--trainers", "2", "--log-dir", str(tmp_path / "logs"), "--timeout", "9",
               "--", sys.executable, str(script), str(tmp_path / "out"), "ok")
    assert done.returncode == 0, done.stderr
    assert "launch: 1 pserver(s) x 2 trainer(s), sync" in done.stderr and ": ok" in done.stderr
    failed = cli("launch", "--pservers", "1", "--trainers", "2", "--log-dir", str(tmp_path / "logs2"),
                 "--", sys.executable, str(script), str(tmp_path / "out"), "fail")
    assert failed.returncode == 1 and "FAILED: trainer.1 exited with code 3" in failed.stderr


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["launch", "--pservers", "1", "--trainers", "1"], "needs the command to run after `--`"),
        (["launch", "--pservers", "0", "--trainers", "1", "--", "true"], "--pservers must be >= 1"),
        (["launch", "--trainers", "1", "--", "true"], "the following arguments are required: --pservers"),
        (["launch", "--pservers", "1", "--trainers", "1", "--timeout", "0", "--", "true"], "--timeout must be positive"),
        (["launch", "--pservers", "2", "--trainers", "1", "--endpoints", "127.0.0.1:6170,,127.0.0.1:6171",
          "--", "true"],
         "malformed pserver endpoint list '127.0.0.1:6170,,127.0.0.1:6171': entry 2 of 3 is empty"),
        (["launch", "--pservers", "1", "--trainers", "1", "--max-restarts", "1", "--", "true"],
         "--max-restarts and --checkpoint-every need --checkpoint-dir"),
        (["launch", "--pservers", "1", "--trainers", "1", "--address", "127.0.0.1:6379", "--", "true"],
         "--address is for --backend ray"),
        (["launch", "--backend", "ray", "--pservers", "1", "--trainers", "1", "--endpoints", "127.0.0.1:6170",
          "--", "true"], "--backend ray places the pservers itself"),
        (["launch", "--backend", "ray", "--pservers", "1", "--trainers", "1", "--cpus-per-process", "0", "--", "true"],
         "--cpus-per-process must be positive"),
        (["launch", "--backend", "k8s", "--pservers", "1", "--trainers", "1", "--", "true"], "invalid choice: 'k8s'"),
        (["serve", "--program", "missing.pb", "--startup", "missing.pb"], "missing.pb"),
        (["serve", "--program", "tests/fixtures/paddle_programs/mlp_adam_2ps/main.pb",
          "--startup", "tests/fixtures/paddle_programs/mlp_adam_2ps/startup.pb"], "one listen_and_serv op"),
    ],
)
def test_cli_user_errors_are_one_line_and_exit_2(args, match):
    done = cli(*args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pstranspile: error: ") and match in lines[0], done.stderr


def test_cli_serve_on_a_busy_port_is_a_user_error(tmp_path):
    import socket

    from transpiler.api import transpile
    from transpiler.ir import Program
    from transpiler.output import pserver_file_stem

    case = REPO / "tests" / "fixtures" / "paddle_programs" / "mlp_adam_2ps"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
        transpile(Program.load(case / "main.pb"), Program.load(case / "startup.pb"), pservers=endpoint,
                  trainers=1).save(tmp_path)
        stem = tmp_path / pserver_file_stem(endpoint)
        done = cli("serve", "--program", f"{stem}.pb", "--startup", f"{stem}_startup.pb")
        assert done.returncode == 2 and f"cannot listen on {endpoint}" in done.stderr
        mismatch = cli("serve", "--program", f"{stem}.pb", "--startup", f"{stem}_startup.pb", "--endpoint", "0.0.0.0:1")
        assert mismatch.returncode == 2 and "does not match the program's endpoint" in mismatch.stderr


def test_cli_launch_backend_ray_without_ray_says_how_to_install_it(tmp_path):
    """Ray is an optional extra: with the module missing (`sys.modules["ray"] = None` makes
    `import ray` fail as on an install without it), `launch --backend ray` is one line, exit 2,
    naming the extra to install."""
    code = ("import sys; sys.modules['ray'] = None; from transpiler.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run(
        [sys.executable, "-c", code, "launch", "--backend", "ray", "--pservers", "1", "--trainers", "1",
         "--log-dir", str(tmp_path / "logs"), "--", sys.executable, "-c", "pass"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pstranspile: error: the ray backend needs Ray"), done.stderr
    assert "pip install 'ps-transpiler[ray]'" in lines[0], done.stderr


def test_the_live_status_line_of_many_trainers_stays_short():
    from types import SimpleNamespace

    from transpiler.runtime.job import STATUS_WIDTH, ProcessStatus, _status_line

    def handle(i, progress):
        status = ProcessStatus("trainer", i, None, Path(f"trainer.{i}.log"), progress=progress)
        return SimpleNamespace(status=status)

    two = [handle(0, Progress("0", 40, 0.5, 30.0)), handle(1, None)]
    assert _status_line(two, 9.25, "local") == "[launch 9.2s] trainer.0: step 40 loss 0.5 30 steps/s | trainer.1: starting"
    many = [handle(i, Progress(str(i), 40 + i, 0.5 + i / 100, 30.0)) for i in range(15)] + [handle(15, None)]
    line = _status_line(many, 9.25, "ray")
    assert len(line) <= STATUS_WIDTH
    assert line == "[launch ray 9.2s] 16 trainers: step 40..54, loss 0.5..0.64, 450 steps/s in all, 1 starting"


def test_the_summary_names_the_logs_folder_once_so_rows_stay_short(tmp_path):
    from transpiler.runtime.job import LaunchResult, ProcessStatus

    deep = tmp_path / ("a-very-long-folder-name-" * 6) / "logs"
    processes = [ProcessStatus("pserver", 0, "127.0.0.1:6170", deep / "pserver.0.log"),
                 ProcessStatus("trainer", 0, None, deep / "trainer.0.log")]
    text = LaunchResult(ok=True, failure=None, processes=processes, seconds=1.0).summary()
    assert f"  logs in {deep}/" in text.splitlines()
    rows = text.splitlines()[2:]
    assert rows[1].rstrip().endswith("pserver.0.log") and str(deep) not in "".join(rows)
