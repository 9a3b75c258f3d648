"""The transpiler's passes, one module each, each `run(bundle, options) -> bundle`.

`PIPELINE` is the order they run in; `run_pipeline` runs them, optionally verifying every
program after each pass and writing text dumps after each pass for debugging.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transpiler.config import TranspileOptions
from transpiler.passes import (
    async_lr_decay,
    find_optimize,
    pserver_program,
    pserver_startup,
    slice_vars,
    trainer_program,
    trainer_startup,
)
from transpiler.passes.bundle import Bundle

Pass = Callable[[Bundle, TranspileOptions], Bundle]

PIPELINE: tuple[tuple[str, Pass], ...] = (
    ("find_optimize", find_optimize.run),
    ("async_lr_decay", async_lr_decay.run),
    ("slice_vars", slice_vars.run),
    ("trainer_program", trainer_program.run),
    ("trainer_startup", trainer_startup.run),
    ("pserver_program", pserver_program.run),
    ("pserver_startup", pserver_startup.run),
)


def run_pipeline(
    bundle: Bundle,
    options: TranspileOptions,
    *,
    verify: bool = False,
    dump_dir: str | Path | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> Bundle:
    """`progress(pass_name, seconds)` is called after each pass."""
    import time

    from transpiler.passes.checks import verify_bundle

    for number, (name, run) in enumerate(PIPELINE, start=1):
        started = time.perf_counter()
        bundle = run(bundle, options)
        if progress is not None:
            progress(name, time.perf_counter() - started)
        if verify:
            verify_bundle(bundle, after=name)
        if dump_dir is not None:
            _dump(bundle, Path(dump_dir) / f"{number:02d}_{name}")
    if not verify:
        verify_bundle(bundle, after="the last pass")
    return bundle


def _dump(bundle: Bundle, directory: Path) -> None:
    from transpiler.ir.printer import dump

    directory.mkdir(parents=True, exist_ok=True)
    for label, program in bundle.programs():
        (directory / f"{_file_label(label)}.txt").write_text(dump(program))
    if bundle.plan is not None:
        (directory / "plan.json").write_text(bundle.plan.to_json_text())


def _file_label(label: str) -> str:
    return label.replace(":", "_").replace(".", "_")
