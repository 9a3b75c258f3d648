"""Run metrics (issue 24): the progress lines' bytes and the pservers' CPU, the metrics
file `launch` and `Session` write, and `pstranspile report` on a real (short) run."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import PADDLE_PROGRAMS, TESTS
from transpiler.cli import main
from transpiler.runtime.metrics import SCHEMA_KEYS, MetricsFileError, MetricsWriter, read_metrics
from transpiler.runtime.progress import Progress, Usage, format_progress, format_usage, parse_progress, parse_report
from transpiler.runtime.report import clock, summarize, windowed_rate

try:
    import tensorboardX  # noqa: F401
    HAVE_TENSORBOARDX = True
except ImportError:
    HAVE_TENSORBOARDX = False

MLP = PADDLE_PROGRAMS / "mlp_adam_2ps"
TRAIN = TESTS.parent / "examples" / "train_program.py"
STEPS = 12


def test_progress_lines_carry_bytes_and_pserver_usage():
    progress = Progress("1", 7, 0.5, 12.0, 1000, 2000)
    line = format_progress(progress)
    assert line == "[progress] trainer=1 step=7 loss=0.5 steps/s=12 sent=1000 recv=2000"
    assert parse_progress(line) == progress and parse_report(line) == progress
    timed = Progress("0", 3, None, None, None, None, 1.25)
    assert format_progress(timed) == "[progress] trainer=0 step=3 elapsed=1.250" and parse_report(format_progress(timed)) == timed
    usage = Usage(1, 2.5, 10.0)
    assert parse_report(format_usage(usage)) == usage
    assert parse_progress(format_usage(usage)) is None  # a pserver's line is no trainer's progress


def test_metrics_file_round_trips_and_refuses_garbage(tmp_path):
    with MetricsWriter(tmp_path / "m.jsonl", fresh=True) as writer:
        writer.report(Progress("0", 1, 2.0, 5.0, 10, 20), trainer=0, elapsed=0.5)
        writer.report(Usage(0, 0.25, 1.0), elapsed=1.0)
    trainer, pserver = read_metrics(tmp_path / "m.jsonl")
    assert tuple(trainer) == SCHEMA_KEYS["trainer"] and tuple(pserver) == SCHEMA_KEYS["pserver"]
    assert trainer["bytes_received"] == 20 and pserver["cpu"] == 0.25
    with open(tmp_path / "m.jsonl", "a") as handle:
        handle.write('{"time": 1.5, "role": "trai')  # a job killed mid-line: the torn last line is skipped
    assert len(read_metrics(tmp_path / "m.jsonl")) == 2
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n')
    with pytest.raises(MetricsFileError, match="not a metrics record"):
        read_metrics(tmp_path / "bad.jsonl")
    with pytest.raises(MetricsFileError, match="no metrics file"):
        read_metrics(tmp_path / "nowhere")


def test_throughput_is_windowed_and_restarts_start_anew():
    rows = [{"time": t / 10, "step": t} for t in range(1, 31)]  # 10 steps/s
    assert all(rate == pytest.approx(10.0) for _, rate in windowed_rate(rows, 1.0))
    # Lines read in batches (Ray's polls) share a `time`; the trainer's own `elapsed` still times them.
    batched = [{"time": 5.0 + (t // 10), "elapsed": t / 20, "step": t} for t in range(1, 31)]  # 20 steps/s
    assert clock(batched) == "elapsed" and clock(rows) == "time"
    assert all(rate == pytest.approx(20.0) for _, rate in windowed_rate(batched, 0.5, "elapsed"))
    restarted = rows[:10] + [{"time": 3.1 + i / 10, "step": 5 + i} for i in range(10)]
    assert all(rate > 0 for _, rate in windowed_rate(restarted, 1.0))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real job: 2 pservers x 2 trainers of the Paddle-built MLP, through `pstranspile launch --json`."""
    tmp = tmp_path_factory.mktemp("run")
    logs = tmp / "logs"
    board = ["--tensorboard", str(tmp / "tb")] if HAVE_TENSORBOARDX else []
    argv = ["launch", "--pservers", "2", "--trainers", "2", "--log-dir", str(logs), "--json", "-q", *board, "--",
            sys.executable, str(TRAIN), "--main", str(MLP / "main.pb"), "--startup", str(MLP / "startup.pb"),
            "--loss", "mean_0.tmp_0", "--steps", str(STEPS)]
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, json.loads(out.getvalue()), logs


def read_scalars(folder):
    """tag -> [(step, value)] of every TensorBoard event file in `folder` (TFRecord framing:
    length, its CRC, the Event message, its CRC)."""
    import struct
    from collections import defaultdict

    from tensorboardX.proto import event_pb2

    out = defaultdict(list)
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (size,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + size])
            i += 12 + size + 4
            for value in event.summary.value:
                out[value.tag].append((event.step, value.simple_value))
    return dict(out)


@pytest.mark.skipif(not HAVE_TENSORBOARDX, reason="tensorboardX (the `tensorboard` extra) is not installed")
def test_launch_and_report_write_tensorboard_scalars(run_dir, tmp_path, capsys):
    _, _, logs = run_dir
    records = read_metrics(logs)
    live = read_scalars(logs.parent / "tb")
    for trainer in (0, 1):
        rows = [r for r in records if r["role"] == "trainer" and r["trainer"] == trainer]
        assert live[f"trainer_{trainer}/loss"] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
        assert [step for step, _ in live[f"trainer_{trainer}/mb_sent"]] == list(range(1, STEPS + 1))
    assert {"pserver_0/cpu", "pserver_1/cpu"} <= set(live)
    assert main(["report", str(logs), "--no-plot", "--tensorboard", str(tmp_path / "tb")]) == 0
    assert read_scalars(tmp_path / "tb") == live  # the same scalars, from the metrics file afterwards


def test_launch_json_and_its_metrics_file(run_dir):
    code, doc, logs = run_dir
    assert code == 0 and doc["ok"] and doc["schema"] == "pstranspile.launch/1"
    assert doc["metrics"] == str(logs / "metrics.jsonl") and (doc["pservers"], doc["trainers"]) == (2, 2)
    assert [p["name"] for p in doc["processes"]] == ["pserver.0", "pserver.1", "trainer.0", "trainer.1"]
    assert all(set(p) == {"name", "role", "index", "endpoint", "node", "exit", "returncode", "steps", "loss",
                          "steps_per_s", "seconds", "log"} for p in doc["processes"])
    records = read_metrics(logs)
    for trainer in (0, 1):
        rows = [r for r in records if r["role"] == "trainer" and r["trainer"] == trainer]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert all(r["loss"] is not None and r["steps_per_s"] > 0 for r in rows)
        elapsed = [r["elapsed"] for r in rows]  # the trainer's own clock, and steps/s agrees with it
        assert elapsed == sorted(elapsed)
        for r in rows:  # steps/s has 3 significant digits, elapsed 3 decimals
            low, high = r["step"] / (r["elapsed"] + 0.0006), r["step"] / max(r["elapsed"] - 0.0006, 1e-9)
            assert low * 0.994 <= r["steps_per_s"] <= high * 1.006, r
        sent = [r["bytes_sent"] for r in rows]
        assert sent == sorted(sent) and sent[0] > 0 and rows[-1]["bytes_received"] > rows[0]["bytes_received"]
        (final,) = [p for p in doc["processes"] if p["name"] == f"trainer.{trainer}"]
        assert final["steps"] == STEPS and final["loss"] == rows[-1]["loss"]
    times = [r["time"] for r in records if r["role"] == "trainer" and r["trainer"] == 0]
    assert times == sorted(times)
    for pserver in (0, 1):  # every pserver reports at least once, at the end
        rows = [r for r in records if r["role"] == "pserver" and r["pserver"] == pserver]
        assert rows and rows[-1]["cpu_seconds"] > 0 and 0 < rows[-1]["cpu"] <= 2.5


def test_report_summarizes_and_draws_the_run(run_dir, tmp_path, capsys):
    _, _, logs = run_dir
    records = read_metrics(logs)
    code = main(["report", str(logs), "--json", "--no-plot"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["schema"] == "pstranspile.report/1" and doc["picture"] is None
    assert [t["trainer"] for t in doc["trainers"]] == [0, 1] and [p["pserver"] for p in doc["pservers"]] == [0, 1]
    last0 = [r for r in records if r["role"] == "trainer" and r["trainer"] == 0][-1]
    assert doc["trainers"][0]["steps"] == STEPS and doc["trainers"][0]["last_loss"] == last0["loss"]
    assert doc["trainers"][0]["bytes_sent"] == last0["bytes_sent"] and doc == {
        **summarize(records), "metrics": str(logs / "metrics.jsonl"), "picture": None}
    pytest.importorskip("matplotlib", reason="matplotlib (the `plot` extra) is not installed")
    for name in ("run.png", "run.svg"):
        code = main(["report", str(logs), "-o", str(tmp_path / name)])
        out = capsys.readouterr().out
        assert code == 0 and out.splitlines()[-1] == f"picture: {tmp_path / name}"
        assert "trainer  steps" in out and f"  0        {STEPS} " in out
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "run.svg").read_bytes()[:2000]


def test_report_errors_are_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics file" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["report", str(tmp_path), "-o", str(tmp_path / "x.gif")]) == 2
    assert "name it .png or .svg" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "no records yet" in capsys.readouterr().err


def test_local_session_writes_its_own_metrics(tmp_path, monkeypatch):
    import subprocess

    metrics = tmp_path / "local.jsonl"
    env = {"PYTHONPATH": str(TESTS.parent), "PSTRANSPILE_METRICS": str(metrics), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(TRAIN), "--main", str(MLP / "main.pb"), "--startup",
                           str(MLP / "startup.pb"), "--loss", "mean_0.tmp_0", "--steps", "4"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = read_metrics(metrics)
    assert [(r["role"], r["trainer"], r["step"]) for r in rows] == [("local", 0, s) for s in range(1, 5)]
    assert all(r["bytes_sent"] is None and r["loss"] is not None for r in rows)


def test_report_without_matplotlib_prints_the_summary_and_says_how_to_draw(tmp_path):
    import os
    import subprocess

    with MetricsWriter(tmp_path / "metrics.jsonl", fresh=True) as writer:
        for step in range(1, 4):
            writer.report(Progress("0", step, 1.0 / step, 10.0, 100 * step, 200 * step, step / 10), trainer=0,
                          elapsed=step / 10)
    blocked = tmp_path / "blocked" / "matplotlib"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = {**os.environ, "PYTHONPATH": f"{blocked.parent}{os.pathsep}{TESTS.parent}"}

    def report(*extra):
        return subprocess.run([sys.executable, "-m", "transpiler", "report", str(tmp_path), *extra], env=env,
                              capture_output=True, text=True, timeout=60, check=False)

    done = report()
    assert done.returncode == 0 and "pip install 'ps-transpiler[plot]'" in done.stderr
    row = done.stdout.splitlines()[2].split()
    assert row == ["0", "3", "1", "0.3333", "0.3333", "10", "300", "B", "600", "B"] and "picture" not in done.stdout
    assert not (tmp_path / "report.png").exists()
    done = report("-o", str(tmp_path / "r.png"))
    assert done.returncode == 2 and done.stderr.startswith("pstranspile: error: drawing needs matplotlib")
