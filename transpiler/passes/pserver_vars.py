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
    return PserverVars(progs, origin).declare(origin_name, name, shape, persistable, index)


class PserverVars:
    """`declare` for one pserver, with the blocks it looks in fetched once: a pass
    declares thousands of vars (every block of every param, once per trainer for the
    grads), and finding the two global blocks again for each was a fifth of its work."""

    __slots__ = ("_globals", "_origin", "_instances")

    def __init__(self, progs: PserverPrograms, origin: Program) -> None:
        self._globals = progs.main.global_block()
        self._origin = origin.global_block()
        self._instances = progs.instances

    def declare(self, origin_name: str, name: str | None = None, shape: Iterable[int] | None = None,
                persistable: bool | None = None, index: int = 0) -> str:
        """See the module's `declare`."""
        name = name or origin_name
        globals_ = self._globals
        if not globals_.has_var(name):
            source = self._origin.find_var(origin_name)
            if source is None:
                return name  # an undeclared var; the verifier names it
            var = source.copy(name)
            if shape is not None:
                var.shape = tuple(shape)
            if persistable is not None:
                var.persistable = persistable
            globals_.add_var(var)
        instances = self._instances.get(origin_name)
        if instances is None:
            self._instances[origin_name] = {(name, index): None}
        else:
            instances[(name, index)] = None
        return name
