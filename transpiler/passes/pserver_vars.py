"""Declaring a pserver's block-0 vars, shared by the passes that fill its blocks: each
declaration is recorded in `PserverPrograms.instances`, which is what pserver_startup
initialises."""

from __future__ import annotations

from collections.abc import Iterable

from transpiler.ir import Program
from transpiler.passes.bundle import PserverPrograms


def declare(progs: PserverPrograms, origin: Program, origin_name: str, name: str | None = None,
            shape: Iterable[int] | None = None, *, persistable: bool | None = None, index: int = 0) -> str:
    """Declare (once) the pserver var `name` standing for block `index` of original var
    `origin_name`, copied from the original's declaration (shape and persistable replaced
    when given); return its name."""
    name = name or origin_name
    globals_ = progs.main.global_block()
    if not globals_.has_var(name):
        source = origin.global_block().find_var(origin_name)
        if source is None:
            return name  # an undeclared var; the verifier names it
        var = source.copy(name)
        if shape is not None:
            var.shape = tuple(shape)
        if persistable is not None:
            var.persistable = persistable
        globals_.add_var(var)
    progs.instances.setdefault(origin_name, {})[(name, index)] = None
    return name
