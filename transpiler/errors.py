"""The project's exception types.

Every error the library raises on bad input or misuse is a `PsTranspilerError`, so
callers (and the CLI, which turns them into one line and exit code 2) can tell our
diagnostics from bugs.
"""

from __future__ import annotations


class PsTranspilerError(Exception):
    """Base of every error this project raises on purpose."""


class ProgramFormatError(PsTranspilerError):
    """Bytes that are not a well-formed `ProgramDesc` (truncated, garbage, wrong message)."""


class IRError(PsTranspilerError):
    """Misuse of the IR API: an unknown var or block, an attr of the wrong type, ..."""


class UnknownOpError(PsTranspilerError):
    """An op a pass, the builder or the executor must understand is not in the catalogue."""


class TranspileError(PsTranspilerError):
    """A program or configuration the transpiler cannot distribute (no optimizer ops,
    duplicate endpoints, a trainer id out of range, an unsupported mode, ...)."""


class VerifyError(PsTranspilerError):
    """A program that decodes but breaks an IR invariant (see `transpiler.ir.verifier`).

    `program`, `block` and `op_index` locate the fault (`None` where they do not apply),
    `op_type` names the op, and the message shows the dump lines around it.
    """

    def __init__(
        self,
        message: str,
        *,
        program: str = "program",
        block: int | None = None,
        op_index: int | None = None,
        op_type: str | None = None,
        context: str = "",
    ) -> None:
        self.program = program
        self.block = block
        self.op_index = op_index
        self.op_type = op_type
        self.reason = message
        self.context = context
        where = [program]
        if block is not None:
            where.append(f"block {block}")
        if op_index is not None:
            where.append(f"op {op_index}" + (f" ({op_type})" if op_type else ""))
        full = f"{', '.join(where)}: {message}"
        if context:
            full += "\n" + context
        super().__init__(full)

    @property
    def headline(self) -> str:
        """The first line of the message, for one-line CLI errors."""
        return str(self).splitlines()[0]
