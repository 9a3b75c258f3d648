"""Who this process is in a training job, read from the environment.

Paddle's conventions, which `pstranspile launch` sets and any scheduler can:

| variable | meaning |
|---|---|
| `TRAINING_ROLE` | `PSERVER` or `TRAINER` (unset: local training, no pservers) |
| `PADDLE_PSERVER_ENDPOINTS` | every pserver, `host:port,host:port` |
| `PADDLE_PSERVERS_IP_PORT_LIST` | the same list, as Paddle 2.x's role makers and paddle-operator spell it (either may be set; both must agree) |
| `PADDLE_TRAINERS_NUM` | how many trainers |
| `PADDLE_TRAINER_ID` | this trainer's id, `0 .. PADDLE_TRAINERS_NUM-1` (trainers) |
| `PADDLE_CURRENT_ENDPOINT` | this pserver's endpoint (pservers; else `POD_IP:PADDLE_PORT`; both given: they must agree) |

and of ours: `PSTRANSPILE_SYNC_MODE` (`1` sync, the default; `0` async),
`PSTRANSPILE_RPC_TIMEOUT` (seconds a pserver waits for a silent trainer; default 120), and
the checkpoint options `Session` falls back on: `PSTRANSPILE_CHECKPOINT_DIR`,
`PSTRANSPILE_CHECKPOINT_EVERY` and `PSTRANSPILE_RESTORE` (what `launch --checkpoint-dir`
and its restarts set).
Who may call a pserver (`PSTRANSPILE_JOB_TOKEN`, TLS) is `ops.rpc.auth`'s, read where the
channels and servers are made.

    role = Role.from_env()
    if role.is_pserver: ...            # serve
    feed = role.shard(batch)           # a trainer's share of a global batch
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ops.rpc.service import DEFAULT_TIMEOUT, TIMEOUT_ENV, default_timeout
from transpiler.config import split_endpoint_list
from transpiler.errors import PsTranspilerError

ROLE_ENV = "TRAINING_ROLE"
ENDPOINTS_ENV = "PADDLE_PSERVER_ENDPOINTS"
PADDLE_ENDPOINTS_ENV = "PADDLE_PSERVERS_IP_PORT_LIST"  # Paddle 2.x's spelling (PaddleCloudRoleMaker, paddle-operator)
TRAINERS_ENV = "PADDLE_TRAINERS_NUM"
TRAINER_ID_ENV = "PADDLE_TRAINER_ID"
CURRENT_ENDPOINT_ENV = "PADDLE_CURRENT_ENDPOINT"
SYNC_MODE_ENV = "PSTRANSPILE_SYNC_MODE"
# Checkpoint options a launcher gives every process (`Session` falls back on them): where the
# pservers checkpoint, how often trainer 0 asks, and — set on a restart — where to restore from.
CHECKPOINT_DIR_ENV = "PSTRANSPILE_CHECKPOINT_DIR"
CHECKPOINT_EVERY_ENV = "PSTRANSPILE_CHECKPOINT_EVERY"
RESTORE_ENV = "PSTRANSPILE_RESTORE"
# The partitioner every process transpiles with (`transpiler.partition`; `launch --partitioner`).
PARTITIONER_ENV = "PSTRANSPILE_PARTITIONER"
RESTORE_IF_ANY_ENV = "PSTRANSPILE_RESTORE_IF_ANY"  # a launcher's restart: a {pserver} template with no checkpoint yet starts from scratch

LOCAL, TRAINER, PSERVER = "local", "trainer", "pserver"


class RoleError(PsTranspilerError):
    """The environment describes no consistent role (a missing or malformed variable)."""


@dataclass(frozen=True)
class Role:
    """This process's part: `kind` is `local`, `trainer` or `pserver`."""

    kind: str = LOCAL
    trainer_id: int = 0
    trainers: int = 1
    endpoints: tuple[str, ...] = ()
    current_endpoint: str | None = None
    sync_mode: bool = True
    rpc_timeout: float = DEFAULT_TIMEOUT

    @classmethod
    def local(cls) -> Role:
        return cls()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Role:
        """The role the environment describes; local training when `TRAINING_ROLE` is unset."""
        env = os.environ if env is None else env
        sync_mode = _flag(env, SYNC_MODE_ENV, True)
        try:
            timeout = default_timeout(env)
        except ValueError as exc:
            raise RoleError(str(exc)) from None
        kind = env.get(ROLE_ENV, "").strip().upper()
        if not kind:
            return cls(sync_mode=sync_mode, rpc_timeout=timeout)
        if kind not in ("TRAINER", "PSERVER"):
            raise RoleError(f"{ROLE_ENV}={env.get(ROLE_ENV)!r}: expected TRAINER or PSERVER")
        endpoints = _endpoints(env)
        trainers = _int(env, TRAINERS_ENV)
        if trainers < 1:
            raise RoleError(f"{TRAINERS_ENV} must be >= 1, got {trainers}")
        if kind == "TRAINER":
            trainer_id = _int(env, TRAINER_ID_ENV)
            if not 0 <= trainer_id < trainers:
                raise RoleError(f"{TRAINER_ID_ENV}={trainer_id} is out of range for {TRAINERS_ENV}={trainers}")
            return cls(TRAINER, trainer_id, trainers, endpoints, None, sync_mode, timeout)
        current = env.get(CURRENT_ENDPOINT_ENV, "").strip()
        pod = ""
        if env.get("POD_IP", "").strip() and env.get("PADDLE_PORT", "").strip():
            pod = f"{env['POD_IP'].strip()}:{env['PADDLE_PORT'].strip()}"
        if current and pod and current != pod:
            raise RoleError(f"{CURRENT_ENDPOINT_ENV}={current} and POD_IP:PADDLE_PORT={pod} disagree: "
                            "give one, or the same endpoint in both")
        current = current or pod
        if not current:
            raise RoleError(f"a pserver needs {CURRENT_ENDPOINT_ENV} (or POD_IP and PADDLE_PORT)")
        if current not in endpoints:
            raise RoleError(f"{CURRENT_ENDPOINT_ENV}={current} is not one of the pserver endpoints "
                            f"({', '.join(endpoints)})")
        return cls(PSERVER, 0, trainers, endpoints, current, sync_mode, timeout)

    @property
    def is_local(self) -> bool:
        return self.kind == LOCAL

    @property
    def is_trainer(self) -> bool:
        return self.kind == TRAINER

    @property
    def is_pserver(self) -> bool:
        return self.kind == PSERVER

    @property
    def is_distributed(self) -> bool:
        return self.kind != LOCAL

    @property
    def name(self) -> str:
        """`trainer 1`, `pserver 127.0.0.1:6174`, `local`."""
        if self.is_trainer:
            return f"trainer {self.trainer_id}"
        if self.is_pserver:
            return f"pserver {self.current_endpoint}"
        return LOCAL

    def shard(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """This trainer's contiguous share of every array in `batch` (rows
        `[i*n/N, (i+1)*n/N)`); the whole batch when local. In sync mode the trainers'
        shares together are the batch local training would see."""
        if not self.is_trainer or self.trainers == 1:
            return dict(batch)
        out = {}
        for name, value in batch.items():
            rows = len(value)
            lo = rows * self.trainer_id // self.trainers
            hi = rows * (self.trainer_id + 1) // self.trainers
            out[name] = value[lo:hi]
        return out

    def env(self) -> dict[str, str]:
        """The environment variables that describe this role (what `launch` sets)."""
        if self.is_local:
            return {SYNC_MODE_ENV: "1" if self.sync_mode else "0", TIMEOUT_ENV: f"{self.rpc_timeout:g}"}
        out = {
            ROLE_ENV: "TRAINER" if self.is_trainer else "PSERVER",
            ENDPOINTS_ENV: ",".join(self.endpoints),
            PADDLE_ENDPOINTS_ENV: ",".join(self.endpoints),
            TRAINERS_ENV: str(self.trainers),
            SYNC_MODE_ENV: "1" if self.sync_mode else "0",
            TIMEOUT_ENV: f"{self.rpc_timeout:g}",
        }
        if self.is_trainer:
            out[TRAINER_ID_ENV] = str(self.trainer_id)
        else:
            assert self.current_endpoint is not None
            host, _, port = self.current_endpoint.rpartition(":")
            out.update({CURRENT_ENDPOINT_ENV: self.current_endpoint, "POD_IP": host, "PADDLE_PORT": port})
        return out


def _endpoints(env: Mapping[str, str]) -> tuple[str, ...]:
    """The pserver list from `PADDLE_PSERVER_ENDPOINTS` and/or Paddle 2.x's
    `PADDLE_PSERVERS_IP_PORT_LIST`: either one, or both naming the same endpoints in the same
    order (the order places the blocks); anything else is a RoleError naming both."""
    given = {}
    for key in (ENDPOINTS_ENV, PADDLE_ENDPOINTS_ENV):
        text = env.get(key, "").strip()
        if text:
            try:
                given[key] = split_endpoint_list(text)
            except PsTranspilerError as exc:  # an empty entry: `a:1,,b:2`, or a stray comma
                raise RoleError(f"{key}: {exc}") from None
    if not given:
        raise RoleError(f"{ROLE_ENV}={env.get(ROLE_ENV)} needs {ENDPOINTS_ENV} (or {PADDLE_ENDPOINTS_ENV})")
    values = list(given.values())
    if len(values) == 2 and values[0] != values[1]:
        raise RoleError(f"{ENDPOINTS_ENV}={','.join(values[0])} and {PADDLE_ENDPOINTS_ENV}={','.join(values[1])} "
                        "disagree: give one, or the same list in both")
    return tuple(values[0])


def _required(env: Mapping[str, str], key: str) -> str:
    value = env.get(key, "").strip()
    if not value:
        raise RoleError(f"{ROLE_ENV}={env.get(ROLE_ENV)} needs {key}")
    return value


def _int(env: Mapping[str, str], key: str) -> int:
    text = _required(env, key)
    try:
        return int(text)
    except ValueError:
        raise RoleError(f"{key}={text!r} is not an integer") from None


def _flag(env: Mapping[str, str], key: str, default: bool) -> bool:
    text = env.get(key, "").strip().lower()
    if not text:
        return default
    if text in ("1", "true", "yes", "sync"):
        return True
    if text in ("0", "false", "no", "async"):
        return False
    raise RoleError(f"{key}={env.get(key)!r}: expected 1 (sync) or 0 (async)")
