"""The transpiler's passes, one module each, each `run(bundle, options) -> bundle`.

`PIPELINE` is the order they run in; `run_pipeline` runs them, optionally verifying every
program after each pass and writing text dumps after each pass for debugging (one folder
per pass, `NN_<pass>/`, holding the whole bundle's state: see `_dump`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transpiler.config import TranspileOptions
from transpiler.passes import (
    find_optimize,
    lower_async_lr_decay,
    pserver_program,
    pserver_startup,
    slice_vars,
    trainer_program,
    trainer_startup,
)
from transpiler.passes.bundle import Bundle

Pass = Callable[[Bundle, TranspileOptions], Bundle]

PIPELINE: tuple[tuple[str, Pass], ...] = (
    ("lower_async_lr_decay", lower_async_lr_decay.run),
    ("find_optimize", find_optimize.run),
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
    """The whole state after a pass, so `diff -r` of two pass folders shows what the pass
    did: the bundle's copies of the user's programs (`origin.txt`, `origin_startup.txt`;
    the async lr-decay pass rewrites them), what find_optimize found (`analysis.txt`),
    the plan once there is one, and every program built so far."""
    from transpiler.ir.printer import dump
    from transpiler.output import write_files

    files = {"origin.txt": dump(bundle.origin), "origin_startup.txt": dump(bundle.origin_startup)}
    if bundle.analysis is not None:
        files["analysis.txt"] = bundle.analysis.to_text()
    if bundle.plan is not None:
        files["plan.json"] = bundle.plan.to_json_text()
    for label, program in bundle.programs():
        files[f"{_file_label(label)}.txt"] = dump(program)
    write_files({name: text.encode() for name, text in files.items()}, directory, replace_dir=True)


def _file_label(label: str) -> str:
    return label.replace(":", "_").replace(".", "_")
