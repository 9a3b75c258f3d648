"""`ops.rpc.env_choice`: the runtime's choice settings (`PSTRANSPILE_GRPC_ENGINE`,
`PSTRANSPILE_MALLOC`) read one way, and a bad one refused by `launch` (`LaunchError`) and
by the CLI's `launch` and `serve` (one line, exit 2) before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import TESTS
from ops.rpc.engine import ENGINE_ENV, EngineChoiceError
from ops.rpc.env_choice import EnvChoiceError, check_env_choices, env_choice
from ops.rpc.malloc import MALLOC_ENV, MallocChoiceError
from transpiler.runtime.launch import LaunchConfig, LaunchError, launch

REPO = TESTS.parent
BAD = [  # (variable, a value it refuses, the error line)
    (ENGINE_ENV, "fast", "PSTRANSPILE_GRPC_ENGINE='fast': expected one of event_engine, poller"),
    (MALLOC_ENV, "never", "PSTRANSPILE_MALLOC='never': expected one of keep, default"),
]


def test_a_choice_ignores_case_and_spaces_and_defaults_to_the_first():
    assert env_choice({"V": " B "}, "V", ("a", "b")) == "b"
    assert env_choice({}, "V", ("a", "b")) == "a" and env_choice({"V": ""}, "V", ("a", "b")) == "a"
    with pytest.raises(EnvChoiceError, match=r"^V='c': expected one of a, b$"):
        env_choice({"V": "c"}, "V", ("a", "b"))


def test_check_env_choices_raises_each_setting_s_own_error():
    check_env_choices({})
    with pytest.raises(EngineChoiceError):
        check_env_choices({ENGINE_ENV: "fast"})
    with pytest.raises(MallocChoiceError):
        check_env_choices({MALLOC_ENV: "never"})


@pytest.mark.parametrize(("variable", "value", "line"), BAD)
def test_launch_refuses_a_bad_choice_before_starting_anything(variable, value, line, tmp_path):
    config = LaunchConfig(command=(sys.executable, "-c", "raise SystemExit(9)"), pservers=1, trainers=1,
                          env={variable: value}, log_dir=tmp_path / "logs")
    with pytest.raises(LaunchError, match=f"{variable}='{value}'"):
        launch(config)
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())


@pytest.mark.parametrize(("variable", "value", "line"), BAD)
@pytest.mark.parametrize("command", [["launch", "--pservers", "1", "--trainers", "1", "--", sys.executable, "-c", "pass"],
                                     ["serve", "--program", "p.pb", "--startup", "s.pb"]])
def test_the_cli_refuses_a_bad_choice_in_one_line_with_exit_2(command, variable, value, line, tmp_path):
    env = {**os.environ, variable: value, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "transpiler", *command], env=env, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"pstranspile: error: {line}"]
