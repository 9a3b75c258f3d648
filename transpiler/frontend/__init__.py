"""The program builder: write training programs the way Fluid 1.x users did.

    from transpiler.frontend import layers, optimizer, Program, program_guard, ParamAttr

    main, startup = Program(), Program()
    with program_guard(main, startup):
        x = layers.data(name="x", shape=[1000], dtype="float32")
        y = layers.data(name="y", shape=[1], dtype="float32")
        pred = layers.fc(input=layers.fc(input=x, size=10), size=1)
        loss = layers.mean(layers.square_error_cost(input=pred, label=y))
        optimizer.SGD(learning_rate=0.1).minimize(loss)
    main.save("main.pb"); startup.save("startup.pb")

`Program` is an IR `transpiler.ir.Program`, so what this builds goes straight to the
transpiler, serde, the verifier and the printer. Op types, slot names, var names,
attr types, roles and startup programs are those Fluid 1.8.5 builds.
"""

from transpiler.frontend import (
    clip,
    initializer,
    layers,
    learning_rate_scheduler,
    optimizer,
    regularizer,
    unique_name,
)
from transpiler.frontend.backward import append_backward
from transpiler.frontend.errors import BuildError
from transpiler.frontend.framework import (
    FLUID_VERSION,
    Parameter,
    Program,
    Variable,
    default_main_program,
    default_startup_program,
    device_guard,
    name_scope,
    program_guard,
)
from transpiler.frontend.layers import fluid_data as data
from transpiler.frontend.param_attr import ParamAttr

__all__ = [
    "FLUID_VERSION",
    "BuildError",
    "ParamAttr",
    "Parameter",
    "Program",
    "Variable",
    "append_backward",
    "clip",
    "data",
    "default_main_program",
    "default_startup_program",
    "device_guard",
    "initializer",
    "layers",
    "learning_rate_scheduler",
    "name_scope",
    "optimizer",
    "program_guard",
    "regularizer",
    "unique_name",
]
