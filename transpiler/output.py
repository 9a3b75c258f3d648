"""The files of a transpile result, written all or nothing.

Layout: `trainer.pb`, `trainer_startup.pb`, `pserver_<host>_<port>.pb`,
`pserver_<host>_<port>_startup.pb` per pserver, and `plan.json`. Files are written to a
temp dir beside the target and moved in only when all of them are written
(`transpiler.fileio.write_files`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from transpiler.fileio import write_files
from transpiler.ir import Program
from transpiler.plan import Plan


def pserver_file_stem(endpoint: str) -> str:
    """`127.0.0.1:6174` -> `pserver_127.0.0.1_6174`; `[::1]:6174` -> `pserver___1_6174`."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]").replace(":", "_")
    return f"pserver_{host}_{port}"


def write_programs(
    out_dir: str | os.PathLike,
    trainer: Program,
    trainer_startup: Program,
    pservers: Mapping[str, tuple[Program, Program]],
    plan: Plan,
) -> list[Path]:
    """Write every program and `plan.json` into `out_dir`; the paths written."""
    files = {
        "trainer.pb": trainer.to_bytes(),
        "trainer_startup.pb": trainer_startup.to_bytes(),
    }
    for endpoint, (main, startup) in pservers.items():
        stem = pserver_file_stem(endpoint)
        files[f"{stem}.pb"] = main.to_bytes()
        files[f"{stem}_startup.pb"] = startup.to_bytes()
    files["plan.json"] = plan.to_json_text().encode()
    return write_files(files, out_dir, stale="pserver_*.pb")  # an older run's other pservers
