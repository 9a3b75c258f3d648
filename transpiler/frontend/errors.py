"""The builder's error: misuse named by layer, with the shapes involved."""

from __future__ import annotations

from transpiler.errors import PsTranspilerError


class BuildError(PsTranspilerError):
    """A program the builder refuses to build: shapes that do not fit, a gradient asked
    of a non-float var, an unknown optimizer argument, ... The message starts with the
    layer (`fc_0: ...`, `append_backward: ...`, `SGD: ...`)."""

    def __init__(self, layer: str, message: str) -> None:
        self.layer = layer
        self.reason = message
        super().__init__(f"{layer}: {message}")
