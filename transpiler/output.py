"""The files of a transpile result, written all or nothing.

Layout: `trainer.pb`, `trainer_startup.pb`, `pserver_<host>_<port>.pb`,
`pserver_<host>_<port>_startup.pb` per pserver, and `plan.json`. Files are written to a
temp dir beside the target and moved in only when all of them are written
(`transpiler.fileio.write_files`).

The bytes are Paddle's `ProgramDesc` wire format whatever the names; `form` picks them:
`pb` (the default, as above), `paddle` (Paddle 2.x's `.pdmodel` suffix: `trainer.pdmodel`,
...) or `fluid18` (Fluid 1.8's `save_inference_model` layout: a folder per program holding
`__model__`: `trainer/__model__`, ...). With `trainers` (every trainer's programs, by id)
the trainer files are `trainer_<id>.pb` and `trainer_<id>_startup.pb` (in each form).
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


FORMS = ("pb", "paddle", "fluid18")


def program_file_name(stem: str, form: str = "pb") -> str:
    """The file (relative to the output dir) a program named `stem` is written to in `form`."""
    if form == "pb":
        return f"{stem}.pb"
    if form == "paddle":
        return f"{stem}.pdmodel"
    if form == "fluid18":
        return f"{stem}/__model__"
    raise ValueError(f"unknown output form {form!r}; expected one of: {', '.join(FORMS)}")


def write_programs(
    out_dir: str | os.PathLike,
    trainer: Program,
    trainer_startup: Program,
    pservers: Mapping[str, tuple[Program, Program]],
    plan: Plan,
    *,
    form: str = "pb",
    trainers: Mapping[int, tuple[Program, Program]] | None = None,
) -> list[Path]:
    """Write every program and `plan.json` into `out_dir`; the paths written. With
    `trainers`, every trainer's programs as `trainer_<id>` instead of the one `trainer`."""
    stale = program_file_name("pserver_*", form)  # checks `form` first
    stems = {"trainer": trainer, "trainer_startup": trainer_startup} if trainers is None else {}
    for trainer_id, (main, startup) in sorted((trainers or {}).items()):
        stems[f"trainer_{trainer_id}"] = main
        stems[f"trainer_{trainer_id}_startup"] = startup
    for endpoint, (main, startup) in pservers.items():
        stem = pserver_file_stem(endpoint)
        stems[stem] = main
        stems[f"{stem}_startup"] = startup
    files = {program_file_name(stem, form): program.to_bytes() for stem, program in stems.items()}
    files["plan.json"] = plan.to_json_text().encode()
    return write_files(files, out_dir, stale=stale)  # an older run's other pservers
