"""The program IR: `from transpiler.ir import Program`.

`Program` / `Block` / `Op` / `Var` (program.py), typed attrs (attrs.py), enums with
Paddle's wire numbers (types.py), protobuf bytes (serde.py, the only module that
imports the generated code), the dependency-graph view (graph.py), the verifier
(verifier.py), and the text dump, diff and DOT drawing built on them.
"""

from transpiler.errors import IRError, ProgramFormatError, VerifyError
from transpiler.ir.attrs import Attr
from transpiler.ir.program import Block, CloneMap, FrozenProgramError, Op, Program, Var
from transpiler.ir.types import AttrType, DType, OpRole, VarKind

__all__ = [
    "Attr",
    "AttrType",
    "Block",
    "CloneMap",
    "DType",
    "FrozenProgramError",
    "IRError",
    "Op",
    "OpRole",
    "Program",
    "ProgramFormatError",
    "Var",
    "VarKind",
    "VerifyError",
]
