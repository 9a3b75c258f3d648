"""`Role.from_env`: Paddle's environment conventions, local by default, clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from transpiler.runtime.role import PSERVER, TRAINER, Role, RoleError

EPS = "127.0.0.1:6170,127.0.0.1:6171"


def test_no_environment_means_local_training():
    role = Role.from_env({})
    assert role.is_local and not role.is_distributed and role.name == "local"
    assert role.sync_mode and role.rpc_timeout == 120.0 and role.trainers == 1


def test_a_trainer():
    role = Role.from_env({"TRAINING_ROLE": "TRAINER", "PADDLE_PSERVER_ENDPOINTS": EPS, "PADDLE_TRAINERS_NUM": "2",
                          "PADDLE_TRAINER_ID": "1", "PSTRANSPILE_SYNC_MODE": "0", "PSTRANSPILE_RPC_TIMEOUT": "7.5"})
    assert role.is_trainer and role.kind == TRAINER and role.trainer_id == 1 and role.trainers == 2
    assert role.endpoints == ("127.0.0.1:6170", "127.0.0.1:6171") and not role.sync_mode and role.rpc_timeout == 7.5
    assert role.name == "trainer 1"


def test_a_pserver_by_current_endpoint_or_pod_ip_and_port():
    base = {"TRAINING_ROLE": "pserver", "PADDLE_PSERVER_ENDPOINTS": EPS, "PADDLE_TRAINERS_NUM": "2"}
    role = Role.from_env({**base, "PADDLE_CURRENT_ENDPOINT": "127.0.0.1:6171"})
    assert role.is_pserver and role.kind == PSERVER and role.current_endpoint == "127.0.0.1:6171"
    assert Role.from_env({**base, "POD_IP": "127.0.0.1", "PADDLE_PORT": "6170"}).current_endpoint == "127.0.0.1:6170"


def test_whitespace_around_endpoints_is_accepted():
    role = Role.from_env({"TRAINING_ROLE": "TRAINER", "PADDLE_PSERVER_ENDPOINTS": " 127.0.0.1:6170 , 127.0.0.1:6171",
                          "PADDLE_TRAINERS_NUM": "1", "PADDLE_TRAINER_ID": "0"})
    assert role.endpoints == ("127.0.0.1:6170", "127.0.0.1:6171")


def test_env_round_trips():
    for role in (Role(TRAINER, 1, 3, ("h:1", "h:2"), None, False, 9.0), Role(PSERVER, 0, 3, ("h:1", "h:2"), "h:2")):
        assert Role.from_env(role.env()) == role
    assert Role.from_env(Role(sync_mode=False).env()) == Role(sync_mode=False)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"TRAINING_ROLE": "WORKER"}, "expected TRAINER or PSERVER"),
        ({"TRAINING_ROLE": "TRAINER"}, "needs PADDLE_PSERVER_ENDPOINTS"),
        ({"TRAINING_ROLE": "TRAINER", "PADDLE_PSERVER_ENDPOINTS": EPS}, "needs PADDLE_TRAINERS_NUM"),
        ({"TRAINING_ROLE": "TRAINER", "PADDLE_PSERVER_ENDPOINTS": EPS, "PADDLE_TRAINERS_NUM": "two"}, "not an integer"),
        ({"TRAINING_ROLE": "TRAINER", "PADDLE_PSERVER_ENDPOINTS": EPS, "PADDLE_TRAINERS_NUM": "2",
          "PADDLE_TRAINER_ID": "2"}, "PADDLE_TRAINER_ID=2 is out of range"),
        ({"TRAINING_ROLE": "PSERVER", "PADDLE_PSERVER_ENDPOINTS": EPS, "PADDLE_TRAINERS_NUM": "2"},
         "needs PADDLE_CURRENT_ENDPOINT"),
        ({"TRAINING_ROLE": "PSERVER", "PADDLE_PSERVER_ENDPOINTS": EPS, "PADDLE_TRAINERS_NUM": "2",
          "PADDLE_CURRENT_ENDPOINT": "127.0.0.1:9"}, "is not one of"),
        ({"TRAINING_ROLE": "TRAINER", "PADDLE_PSERVER_ENDPOINTS": "127.0.0.1:6170,,127.0.0.1:6171",
          "PADDLE_TRAINERS_NUM": "2", "PADDLE_TRAINER_ID": "0"},
         "PADDLE_PSERVER_ENDPOINTS: malformed pserver endpoint list '127.0.0.1:6170,,127.0.0.1:6171': entry 2 of 3"),
        ({"TRAINING_ROLE": "PSERVER", "PADDLE_PSERVER_ENDPOINTS": "127.0.0.1:6170,", "PADDLE_TRAINERS_NUM": "2",
          "PADDLE_CURRENT_ENDPOINT": "127.0.0.1:6170"}, "entry 2 of 2 is empty"),
        ({"TRAINING_ROLE": "TRAINER", "PADDLE_PSERVER_ENDPOINTS": ",127.0.0.1:6170", "PADDLE_TRAINERS_NUM": "1",
          "PADDLE_TRAINER_ID": "0"}, "entry 1 of 2 is empty"),
        ({"PSTRANSPILE_SYNC_MODE": "maybe"}, "expected 1"),
        ({"PSTRANSPILE_RPC_TIMEOUT": "-1"}, "must be positive"),
    ],
)
def test_inconsistent_environments_are_role_errors(env, match):
    with pytest.raises(RoleError, match=match):
        Role.from_env(env)


def test_shard_gives_each_trainer_its_contiguous_share():
    batch = {"x": np.arange(10).reshape(5, 2), "y": np.arange(5)}
    parts = [Role(TRAINER, i, 2, ("h:1",)).shard(batch) for i in range(2)]
    assert parts[0]["y"].tolist() == [0, 1] and parts[1]["y"].tolist() == [2, 3, 4]
    assert np.array_equal(np.concatenate([p["x"] for p in parts]), batch["x"])
    assert Role().shard(batch)["y"].tolist() == [0, 1, 2, 3, 4]


# Paddle 2.x's spelling of the pserver list (PaddleCloudRoleMaker, paddle-operator).
PADDLE_TRAINER = {"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINERS_NUM": "2", "PADDLE_TRAINER_ID": "1"}


def test_paddle_pservers_ip_port_list_alone_names_the_pservers():
    role = Role.from_env({**PADDLE_TRAINER, "PADDLE_PSERVERS_IP_PORT_LIST": EPS})
    assert role.endpoints == ("127.0.0.1:6170", "127.0.0.1:6171") and role.trainer_id == 1
    pserver = Role.from_env({"TRAINING_ROLE": "PSERVER", "PADDLE_PSERVERS_IP_PORT_LIST": EPS, "PADDLE_TRAINERS_NUM": "2",
                             "POD_IP": "127.0.0.1", "PADDLE_PORT": "6171"})
    assert pserver.is_pserver and pserver.current_endpoint == "127.0.0.1:6171"


def test_both_spellings_agreeing_are_accepted_whitespace_aside():
    role = Role.from_env({**PADDLE_TRAINER, "PADDLE_PSERVER_ENDPOINTS": EPS,
                          "PADDLE_PSERVERS_IP_PORT_LIST": " 127.0.0.1:6170, 127.0.0.1:6171 "})
    assert role.endpoints == ("127.0.0.1:6170", "127.0.0.1:6171")


@pytest.mark.parametrize("other", ["127.0.0.1:6171,127.0.0.1:6170", "127.0.0.1:6170", "127.0.0.1:6170,127.0.0.1:9"])
def test_conflicting_spellings_are_a_role_error_naming_both(other):
    with pytest.raises(RoleError, match="PADDLE_PSERVER_ENDPOINTS=.* and PADDLE_PSERVERS_IP_PORT_LIST=.* disagree"):
        Role.from_env({**PADDLE_TRAINER, "PADDLE_PSERVER_ENDPOINTS": EPS, "PADDLE_PSERVERS_IP_PORT_LIST": other})


def test_a_malformed_paddle_list_is_named():
    with pytest.raises(RoleError, match="PADDLE_PSERVERS_IP_PORT_LIST: malformed"):
        Role.from_env({**PADDLE_TRAINER, "PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:6170,,x:1"})


def test_no_list_names_both_spellings():
    with pytest.raises(RoleError, match="needs PADDLE_PSERVER_ENDPOINTS \\(or PADDLE_PSERVERS_IP_PORT_LIST\\)"):
        Role.from_env(PADDLE_TRAINER)


def test_current_endpoint_and_pod_ip_port_must_agree():
    base = {"TRAINING_ROLE": "PSERVER", "PADDLE_PSERVER_ENDPOINTS": EPS, "PADDLE_TRAINERS_NUM": "2"}
    with pytest.raises(RoleError, match="PADDLE_CURRENT_ENDPOINT=127.0.0.1:6170 and POD_IP:PADDLE_PORT=127.0.0.1:6171"):
        Role.from_env({**base, "PADDLE_CURRENT_ENDPOINT": "127.0.0.1:6170", "POD_IP": "127.0.0.1", "PADDLE_PORT": "6171"})
    same = Role.from_env({**base, "PADDLE_CURRENT_ENDPOINT": "127.0.0.1:6170", "POD_IP": "127.0.0.1",
                          "PADDLE_PORT": "6170"})
    assert same.current_endpoint == "127.0.0.1:6170"


def test_env_exports_both_spellings_and_a_paddle_only_reader_agrees():
    role = Role("trainer", 1, 2, ("127.0.0.1:6170", "127.0.0.1:6171"))
    env = role.env()
    assert env["PADDLE_PSERVER_ENDPOINTS"] == env["PADDLE_PSERVERS_IP_PORT_LIST"] == EPS
    paddle_only = {k: v for k, v in env.items() if k != "PADDLE_PSERVER_ENDPOINTS"}
    assert Role.from_env(paddle_only) == role
