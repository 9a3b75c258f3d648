"""The transpiler's passes, one module each, each declaring a `PASS` (`contract.Pass`):
its name, the bundle fields it requires and produces, and `run(bundle, options) -> bundle`.

`PIPELINE` is the order they run in: lowerings, the analysis, the plan, the trainer's
main program, its startup, the pservers' main programs, their startups. `run_pipeline`
runs them, checking each pass's contract, optionally verifying every program after each
pass and writing text dumps after each pass for debugging (one folder per pass,
`NN_<pass>/`, holding the whole bundle's state: see `_dump`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from transpiler.config import TranspileOptions
from transpiler.fileio import write_files
from transpiler.ir.printer import dump
from transpiler.passes import (
    distribute_lookups,
    drop_optimize,
    drop_unused_vars,
    find_optimize,
    insert_recvs,
    insert_sends,
    keep_clip_on_trainer,
    lower_async_lr_decay,
    pserver_lr_decay,
    pserver_norm_reduce,
    pserver_optimize_blocks,
    pserver_serve,
    pserver_startup,
    pserver_table_blocks,
    slice_vars,
    trainer_startup,
)
from transpiler.passes.bundle import Bundle
from transpiler.passes.checks import verify_bundle
from transpiler.passes.contract import Pass, PipelineError, check_produces, check_requires

__all__ = ["PIPELINE", "Pass", "PipelineError", "run_pipeline"]

PIPELINE: tuple[Pass, ...] = (
    lower_async_lr_decay.PASS,
    keep_clip_on_trainer.PASS,
    find_optimize.PASS,
    slice_vars.PASS,
    drop_optimize.PASS,
    distribute_lookups.PASS,
    insert_sends.PASS,
    insert_recvs.PASS,
    drop_unused_vars.PASS,
    trainer_startup.PASS,
    pserver_lr_decay.PASS,
    pserver_optimize_blocks.PASS,
    pserver_norm_reduce.PASS,
    pserver_table_blocks.PASS,
    pserver_serve.PASS,
    pserver_startup.PASS,
)


def run_pipeline(
    bundle: Bundle,
    options: TranspileOptions,
    *,
    verify: bool = False,
    dump_dir: str | Path | None = None,
    progress: Callable[[str, float], None] | None = None,
    passes: Sequence[Pass] = PIPELINE,
) -> Bundle:
    """Run `passes` (the whole pipeline unless told otherwise) on `bundle`;
    `progress(pass_name, seconds)` is called after each pass."""
    for number, step in enumerate(passes, start=1):
        check_requires(step, bundle)
        started = time.perf_counter()
        bundle = step.run(bundle, options)
        check_produces(step, bundle)
        if progress is not None:
            progress(step.name, time.perf_counter() - started)
        if verify:
            verify_bundle(bundle, after=step.name)
        if dump_dir is not None:
            _dump(bundle, Path(dump_dir) / f"{number:02d}_{step.name}")
    if not verify:
        verify_bundle(bundle, after="the last pass")
    return bundle


def _dump(bundle: Bundle, directory: Path) -> None:
    """The whole state after a pass, so `diff -r` of two pass folders shows what the pass
    did: the bundle's copies of the user's programs (`origin.txt`, `origin_startup.txt`;
    the async lr-decay lowering rewrites them), what find_optimize found (`analysis.txt`),
    the plan once there is one, and every program built so far."""
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
