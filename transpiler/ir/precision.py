"""Change the float precision a program computes in."""

from __future__ import annotations

from transpiler.ir.program import Program
from transpiler.ir.types import DType

# The op attrs that name a dtype (fill_constant / uniform_random / gaussian_random: `dtype`;
# cast: `in_dtype`, `out_dtype`).
DTYPE_ATTRS = ("dtype", "in_dtype", "out_dtype")


def as_float64(program: Program) -> Program:
    """A copy of `program` computing in float64: every FP32 var and dtype attr widened.

    Float64 runs let a test compare two computations element by element: float32
    rounding differences from adding the same numbers in another order vanish.
    """
    program = program.clone()
    for block in program.blocks:
        for var in block.vars.values():
            if var.dtype == DType.FP32:
                var.dtype = DType.FP64
        for op in block.ops:
            for attr in DTYPE_ATTRS:
                if op.attr(attr, None) == int(DType.FP32):
                    op.set_attr(attr, int(DType.FP64))
    return program
