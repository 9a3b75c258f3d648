"""`as_float64` widens every float32 var and dtype attr, and leaves the original alone."""

from __future__ import annotations

from transpiler.frontend import layers, optimizer, program_guard, unique_name
from transpiler.frontend import Program as FluidProgram
from transpiler.ir import DType
from transpiler.ir.precision import DTYPE_ATTRS, as_float64


def test_every_float32_var_and_dtype_attr_becomes_float64():
    main, startup = FluidProgram(), FluidProgram()
    with unique_name.guard(), program_guard(main, startup):
        x = layers.data(name="x", shape=[4], dtype="float32")
        loss = layers.mean(layers.fc(input=x, size=3, act="relu"))
        optimizer.Adam(learning_rate=0.01).minimize(loss)
    for program in (main, startup):
        before = program.to_bytes()
        wide = as_float64(program)
        assert program.to_bytes() == before, "the original program changed"
        f32 = int(DType.FP32)
        assert not [v.name for b in wide.blocks for v in b.vars.values() if v.dtype == DType.FP32]
        assert not [op.type for b in wide.blocks for op in b.ops for a in DTYPE_ATTRS if op.attr(a, None) == f32]
        widened = [v.name for b in program.blocks for v in b.vars.values() if v.dtype == DType.FP32]
        assert widened and all(wide.global_block().find_var(n).dtype == DType.FP64 for n in widened
                               if program.global_block().has_var(n))
