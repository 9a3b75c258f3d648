"""`pstranspile --version` and `--help` start fast: they import none of the heavy libraries
(numpy, networkx, protobuf, grpc) nor the op library; `transpile` imports protobuf and the
op library but neither numpy (only unsliced round-robin placement, Paddle's numpy shuffle,
needs it), networkx nor grpc. Checked on `sys.modules` in a fresh interpreter, not with a
clock."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import PADDLE_PROGRAMS, TESTS

PROBE = """
import json, os, runpy, sys
def _exit(code):  # `transpile` ends the process with os._exit (no teardown): see the modules first
    raise SystemExit(code)
os._exit = _exit
heavy = tuple(json.loads(sys.argv[2]))
sys.argv = ["pstranspile", *json.loads(sys.argv[1])]
try:
    runpy.run_module("transpiler", run_name="__main__")
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
"""


def imported(argv: list[str], heavy: tuple[str, ...]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv), json.dumps(heavy)],
        cwd=TESTS.parent, capture_output=True, text=True, check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["transpile", "--help"]])
def test_startup_imports_nothing_heavy(argv):
    assert imported(argv, ("numpy", "networkx", "google", "grpc", "proto", "ops")) == []


def test_transpile_imports_no_numpy(tmp_path):
    case = PADDLE_PROGRAMS / "mlp_adam_2ps"
    argv = ["transpile", str(case / "main.pb"), "--startup", str(case / "startup.pb"),
            "--pservers", "127.0.0.1:6170,127.0.0.1:6171", "--trainers", "2", "-o", str(tmp_path)]
    assert imported(argv, ("numpy", "networkx", "grpc")) == []
    assert (tmp_path / "trainer.pb").exists()


PROBE_IR = PROBE.replace("m.split(\".\")[0] in heavy", "m.startswith(heavy)")  # modules, not just packages
assert PROBE_IR != PROBE


@pytest.mark.parametrize("argv", [["--version"], ["--help"]])
def test_version_and_help_import_neither_the_ir_nor_subprocess(argv):
    done = subprocess.run(
        [sys.executable, "-c", PROBE_IR, json.dumps(argv), json.dumps(["transpiler.ir", "subprocess", "dataclasses"])],
        cwd=TESTS.parent, capture_output=True, text=True, check=True,
    )
    assert json.loads(done.stdout.splitlines()[-1]) == []


def _run_cli(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transpiler", *argv], cwd=TESTS.parent, capture_output=True,
                          text=True, check=False)


def test_transpile_ends_the_process_quickly_with_its_output_flushed(tmp_path):
    """`transpile` skips the interpreter's teardown (os._exit): its lines must still all be
    there, and its files written."""
    case = PADDLE_PROGRAMS / "mlp_adam_2ps"
    done = _run_cli(["transpile", str(case / "main.pb"), "--startup", str(case / "startup.pb"),
                     "--pservers", "127.0.0.1:6170,127.0.0.1:6171", "--trainers", "2", "-o", str(tmp_path)])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert str(tmp_path / "trainer.pb") in lines and "pservers, imbalance" in lines[-1]
    assert (tmp_path / "trainer.pb").read_bytes() and (tmp_path / "plan.json").read_text()


def test_a_failing_transpile_still_says_why_and_exits_2(tmp_path):
    done = _run_cli(["transpile", str(tmp_path / "missing.pb"), "--startup", str(tmp_path / "missing.pb"),
                     "--pservers", "127.0.0.1:6170", "--trainers", "1", "-o", str(tmp_path / "out")])
    assert done.returncode == 2
    assert done.stderr.startswith("pstranspile: error: ") and "missing.pb" in done.stderr
