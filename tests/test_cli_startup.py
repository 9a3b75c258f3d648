"""`pstranspile --version` and `--help` start fast: they import none of the heavy libraries
(numpy, networkx, protobuf, grpc) nor the op library; the commands that need them import
them. Checked on `sys.modules` in a fresh interpreter, not with a clock."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import TESTS

HEAVY = ("numpy", "networkx", "google", "grpc", "proto", "ops")

PROBE = """
import json, runpy, sys
heavy = tuple(json.loads(sys.argv[2]))
sys.argv = ["pstranspile", *json.loads(sys.argv[1])]
try:
    runpy.run_module("transpiler", run_name="__main__")
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
"""


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["transpile", "--help"]])
def test_startup_imports_nothing_heavy(argv):
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv), json.dumps(HEAVY)],
        cwd=TESTS.parent, capture_output=True, text=True, check=True,
    )
    assert json.loads(done.stdout.splitlines()[-1]) == []
