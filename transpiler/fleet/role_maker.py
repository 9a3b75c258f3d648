"""Fluid 1.8's role makers (`paddle.fluid.incubate.fleet.base.role_maker`), over our
`transpiler.runtime.role.Role`.

- `PaddleCloudRoleMaker()` reads Paddle's variables: `TRAINING_ROLE` (`TRAINER` or
  `PSERVER`), `PADDLE_PSERVERS_IP_PORT_LIST` (or our `PADDLE_PSERVER_ENDPOINTS`),
  `PADDLE_TRAINERS_NUM`, a trainer's `PADDLE_TRAINER_ID`, a pserver's `POD_IP` +
  `PADDLE_PORT` (or `PADDLE_CURRENT_ENDPOINT`). What `pstranspile launch` sets.
- `UserDefinedRoleMaker(current_id, role, worker_num, server_endpoints)` with Paddle's
  checks (`TypeError` / `ValueError`, as Fluid raises them).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from transpiler.runtime.role import ENDPOINTS_ENV, PSERVER, TRAINER
from transpiler.runtime.role import Role as RuntimeRole

PADDLE_IP_PORT_LIST_ENV = "PADDLE_PSERVERS_IP_PORT_LIST"


class Role:
    """Fluid's role constants."""

    WORKER = 1
    SERVER = 2
    XPU = 3


class RoleMakerBase:
    """What `fleet` asks a role maker; subclasses set `_role` (our runtime `Role`)."""

    def __init__(self) -> None:
        self._role: RuntimeRole | None = None
        self._role_is_generated = False

    def generate_role(self) -> None:
        raise NotImplementedError

    def _runtime_role(self) -> RuntimeRole:
        if not self._role_is_generated:
            self.generate_role()
        assert self._role is not None
        return self._role

    def is_worker(self) -> bool:
        return self._runtime_role().is_trainer

    def is_server(self) -> bool:
        return self._runtime_role().is_pserver

    def is_first_worker(self) -> bool:
        role = self._runtime_role()
        return role.is_trainer and role.trainer_id == 0

    def worker_num(self) -> int:
        return self._runtime_role().trainers

    def worker_index(self) -> int:
        return self._runtime_role().trainer_id

    def server_index(self) -> int:
        role = self._runtime_role()
        return role.endpoints.index(role.current_endpoint) if role.is_pserver else 0

    def get_pserver_endpoints(self) -> list[str]:
        return list(self._runtime_role().endpoints)

    def get_trainer_endpoints(self) -> list[str]:
        return []

    def to_string(self) -> str:
        role = self._runtime_role()
        return (f"role: {role.name}, worker_num: {role.trainers}, "
                f"server_endpoints: {','.join(role.endpoints)}")


def paddle_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment with Paddle's `PADDLE_PSERVERS_IP_PORT_LIST` also under our
    spelling, so `Role.from_env` reads either (ours wins when both are set)."""
    env = dict(os.environ if env is None else env)
    if not env.get(ENDPOINTS_ENV, "").strip() and env.get(PADDLE_IP_PORT_LIST_ENV, "").strip():
        env[ENDPOINTS_ENV] = env[PADDLE_IP_PORT_LIST_ENV]
    return env


class PaddleCloudRoleMaker(RoleMakerBase):
    """The role Paddle's environment variables describe (`generate_role` reads them)."""

    def __init__(self, is_collective: bool = False, env: Mapping[str, str] | None = None, **kwargs) -> None:
        super().__init__()
        if is_collective:
            raise NotImplementedError("PaddleCloudRoleMaker(is_collective=True): collective mode is not supported; "
                                      "this fleet is the parameter-server one")
        self._env = env

    def generate_role(self) -> None:
        if self._role_is_generated:
            return
        env = paddle_env(self._env)
        training_role = env.get("TRAINING_ROLE", "").strip().upper()
        if training_role not in ("TRAINER", "PSERVER"):
            raise ValueError("TRAINING_ROLE must be PSERVER or TRAINER")
        self._role = RuntimeRole.from_env(env)
        self._role_is_generated = True


class UserDefinedRoleMaker(RoleMakerBase):
    """A role given in code, checked as Fluid 1.8 checks it."""

    def __init__(self, current_id: int = 0, role: int = Role.WORKER, worker_num: int = 0,
                 server_endpoints: list[str] | None = None) -> None:
        super().__init__()
        if not isinstance(server_endpoints, list):
            raise TypeError("server_endpoints must be as string list")
        if len(server_endpoints) <= 0:
            raise ValueError("the length of server_endpoints list must be greater than 0")
        if len(server_endpoints) != len(set(server_endpoints)):
            raise ValueError("server_endpoints can't have duplicate elements")
        for endpoint in server_endpoints:
            if not isinstance(endpoint, str):
                raise TypeError("every element in server_endpoints list must be as string")
        if role not in (Role.WORKER, Role.SERVER):
            raise TypeError("role must be as Role")
        if isinstance(current_id, bool) or not isinstance(current_id, int):
            raise TypeError("current_id must be as int")
        if current_id < 0:
            raise ValueError("current_id must be greater than or equal to 0")
        if role == Role.SERVER and current_id >= len(server_endpoints):
            raise ValueError("if role is Role.SERVER, current_id must be less than or equal to len(server_endpoints) - 1")
        if isinstance(worker_num, bool) or not isinstance(worker_num, int):
            raise TypeError("worker_num must be as int")
        if worker_num <= 0:
            raise ValueError("worker_num must be greater than 0")
        if role == Role.WORKER and current_id >= worker_num:
            raise ValueError(f"current_id {current_id} must be less than worker_num {worker_num} for a worker")
        self._current_id, self._server_endpoints, self._worker_num = current_id, list(server_endpoints), worker_num
        self._kind = TRAINER if role == Role.WORKER else PSERVER

    def generate_role(self) -> None:
        if self._role_is_generated:
            return
        base = RuntimeRole.from_env(paddle_env({k: v for k, v in os.environ.items() if k != "TRAINING_ROLE"}))
        if self._kind == TRAINER:
            self._role = RuntimeRole(TRAINER, self._current_id, self._worker_num, tuple(self._server_endpoints), None,
                                     base.sync_mode, base.rpc_timeout)
        else:
            self._role = RuntimeRole(PSERVER, 0, self._worker_num, tuple(self._server_endpoints),
                                     self._server_endpoints[self._current_id], base.sync_mode, base.rpc_timeout)
        self._role_is_generated = True


__all__ = ["PaddleCloudRoleMaker", "Role", "RoleMakerBase", "UserDefinedRoleMaker"]
