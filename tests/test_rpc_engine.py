"""`ops.rpc.engine`: `PSTRANSPILE_GRPC_ENGINE=poller` reaches gRPC before it starts (on
`import ops.rpc`, and in every process `launch` starts), never over the user's own
`GRPC_EXPERIMENTS`; a bad choice is a specific error (`launch` and the CLI refuse it:
test_rpc_env_choice.py); a job trains to the same bytes on either engine."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from e2e_support import EXAMPLES, launch_training, save, trained_params

from conftest import TESTS
from ops.rpc.engine import ENGINE_ENV, EXPERIMENTS_ENV, POLLER_EXPERIMENTS, EngineChoiceError, engine_env, prefer_poller
from transpiler.runtime.launch import LaunchError, process_env
from transpiler.runtime.role import TRAINER, Role

REPO = TESTS.parent
POLLER = {EXPERIMENTS_ENV: POLLER_EXPERIMENTS}


def test_the_poller_is_asked_for_only_when_chosen():
    assert engine_env({ENGINE_ENV: "poller"}) == POLLER
    assert engine_env({ENGINE_ENV: " Poller "}) == POLLER
    assert engine_env({}) == {} and engine_env({ENGINE_ENV: ""}) == {}  # gRPC's default, untouched
    assert engine_env({ENGINE_ENV: "event_engine"}) == {}


def test_the_user_s_own_grpc_experiments_are_never_overwritten():
    assert engine_env({ENGINE_ENV: "poller", EXPERIMENTS_ENV: "-something"}) == {}
    assert engine_env({ENGINE_ENV: "poller", EXPERIMENTS_ENV: ""}) == {}


def test_a_bad_choice_is_a_specific_error_naming_the_variable():
    with pytest.raises(EngineChoiceError, match=r"PSTRANSPILE_GRPC_ENGINE='epoll'.*event_engine, poller"):
        engine_env({ENGINE_ENV: "epoll"})


def test_prefer_poller_does_nothing_once_grpc_started_here():
    import grpc  # noqa: F401  (started in this process)

    environ = {ENGINE_ENV: "poller"}
    assert prefer_poller(environ) is False and environ == {ENGINE_ENV: "poller"}


def fresh_python(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in (EXPERIMENTS_ENV, ENGINE_ENV)}
    return subprocess.run([sys.executable, "-c", code], env={**base, "PYTHONPATH": str(REPO), **env},
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()


SHOW = "import os, sys; import ops.rpc; print(os.environ.get('GRPC_EXPERIMENTS', '-'), 'grpc' in sys.modules)"


def test_importing_ops_rpc_applies_the_choice_before_grpc_starts():
    # `ops.rpc` loads its modules (and so gRPC) at first use: the choice is in the
    # environment before anything of gRPC is imported
    assert fresh_python(SHOW, PSTRANSPILE_GRPC_ENGINE="poller") == f"{POLLER_EXPERIMENTS} False"
    assert fresh_python(SHOW) == "- False"
    assert fresh_python(SHOW, PSTRANSPILE_GRPC_ENGINE="event_engine") == "- False"
    assert fresh_python(SHOW, PSTRANSPILE_GRPC_ENGINE="poller", GRPC_EXPERIMENTS="-x") == "-x False"
    assert fresh_python(SHOW, PSTRANSPILE_GRPC_ENGINE="bogus") == "- False"  # launch and serve refuse it
    shown = "import os; import ops.rpc; from ops.rpc import server; print(os.environ.get('GRPC_EXPERIMENTS', '-'))"
    assert fresh_python(shown, PSTRANSPILE_GRPC_ENGINE="poller") == POLLER_EXPERIMENTS  # a pserver's import
    assert fresh_python("import grpc; " + SHOW, PSTRANSPILE_GRPC_ENGINE="poller") == "- True"  # too late here


def test_every_launched_process_gets_the_chosen_engine():
    role = Role(TRAINER, 0, 1, ("127.0.0.1:1",))
    assert process_env(role, base={ENGINE_ENV: "poller"})[EXPERIMENTS_ENV] == POLLER_EXPERIMENTS
    assert process_env(role, {ENGINE_ENV: "poller"}, base={})[EXPERIMENTS_ENV] == POLLER_EXPERIMENTS
    assert EXPERIMENTS_ENV not in process_env(role, base={})
    assert EXPERIMENTS_ENV not in process_env(role, base={ENGINE_ENV: "event_engine"})
    assert process_env(role, {EXPERIMENTS_ENV: "-mine"}, base={ENGINE_ENV: "poller"})[EXPERIMENTS_ENV] == "-mine"
    with pytest.raises(LaunchError, match="PSTRANSPILE_GRPC_ENGINE"):
        process_env(role, base={ENGINE_ENV: "nope"})


def test_a_sync_job_trains_to_the_same_bytes_on_either_engine(tmp_path):
    sys.path.insert(0, str(EXAMPLES))
    import seed_fc3

    main_pb, startup_pb = save(tmp_path / "programs", *seed_fc3.build())
    params = {}
    for engine in ("event_engine", "poller"):
        launch_training(tmp_path / engine, main_pb, startup_pb, pservers=2, env={ENGINE_ENV: engine})
        params[engine] = [trained_params(tmp_path / engine, trainer)[1] for trainer in (0, 1)]
    for trainer in (0, 1):
        poller, event_engine = params["poller"][trainer], params["event_engine"][trainer]
        assert poller.keys() == event_engine.keys() and poller
        for name, value in poller.items():
            assert np.array_equal(value, event_engine[name]), (trainer, name)
