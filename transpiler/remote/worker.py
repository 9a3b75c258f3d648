"""One process of a `RemoteExecutor` job: `python -m transpiler.remote.worker`, started by
`launch` (as a child here or in a Ray actor) with Paddle's environment. It connects to the
driver (`PSTRANSPILE_REMOTE_DRIVER` = `host:port`, authenticated with
`PSTRANSPILE_REMOTE_KEY`), says who it is, and receives the job: the programs and the
`Session` options. A pserver then serves until every trainer completed; a trainer starts
its session and runs the driver's commands (`run` a step on its share of the batch or on
what the job's reader gives it, `pull` whole params, `close`) until `close`.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from multiprocessing.connection import Client
from typing import Any

DRIVER_ENV = "PSTRANSPILE_REMOTE_DRIVER"
KEY_ENV = "PSTRANSPILE_REMOTE_KEY"
CONNECT_TIMEOUT = 30.0


def _connect():
    address = os.environ.get(DRIVER_ENV, "")
    key = os.environ.get(KEY_ENV, "")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not key:
        raise SystemExit(f"remote worker: {DRIVER_ENV} (host:port) and {KEY_ENV} must be set by the RemoteExecutor")
    return Client((host.strip("[]"), int(port)), authkey=key.encode())


def _serve_commands(conn, session, role, reader) -> None:
    while True:
        command, *args = conn.recv()
        if command == "close":
            conn.send(("ok", None))
            return
        if command == "run":
            feed, fetches = args
            if feed is None:
                if reader is None:
                    raise ValueError("run(feed=None) needs the RemoteExecutor's reader to give each trainer its data")
                feed = reader(role.trainer_id, role.trainers, session.steps)
            values = session.run(feed, fetches)
            conn.send(("ok", values))
        elif command == "pull":
            (names,) = args
            conn.send(("ok", session.pull(names)))
        elif command == "steps":
            conn.send(("ok", session.steps))
        else:
            raise ValueError(f"unknown command {command!r}")


def main() -> int:
    from transpiler.ir import Program
    from transpiler.runtime.role import RESTORE_ENV, Role
    from transpiler.runtime.session import Session

    role = Role.from_env()
    if role.is_local:
        raise SystemExit("remote worker: no TRAINING_ROLE in the environment (it runs under the RemoteExecutor)")
    conn = _connect()
    who = ("trainer", role.trainer_id) if role.is_trainer else ("pserver", role.current_endpoint)
    conn.send(("hello", *who, os.getpid()))
    job: dict[str, Any] = pickle.loads(conn.recv_bytes())
    main_program, startup = Program.from_bytes(job["main"]), Program.from_bytes(job["startup"])
    options = dict(job["session"])
    if os.environ.get(RESTORE_ENV):  # `launch` restarted the job: from its newest checkpoint, not the first start's
        options.pop("restore", None)
        options.pop("init", None)
    session = Session(main_program, startup, role=role, **options)
    if role.is_pserver:
        conn.close()
        session.serve()
        return 0
    try:
        with session:
            session.start()
            conn.send(("ready", None))
            reader = pickle.loads(job["reader"]) if job.get("reader") else None
            _serve_commands(conn, session, role, reader)
    except (EOFError, ConnectionError):
        print(f"remote worker {role.name}: the driver went away", file=sys.stderr)
        return 1
    except BaseException as exc:
        text = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        try:
            conn.send(("error", text, traceback.format_exc()))
        except (OSError, EOFError):
            pass
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
