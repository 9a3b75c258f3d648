"""Learning-rate decay as ops, as Fluid 1.8 builds it (what the transpiler must carry to
the pservers as an lr-decay block).

Each schedule runs under `_lr_schedule_guard`, so its ops get `op_role = LRSched`, and
starts from the global step `@LR_DECAY_COUNTER@` (int64 `[1]`, persistable, set to -1
on the CPU at startup, bumped by an `increment` at the head of the main block), cast
to float32. `exponential_decay(1.0, 2100, 0.1, staircase=True)` thus builds
`increment, cast, scale, floor, fill_constant, elementwise_pow, scale`.
"""

from __future__ import annotations

from collections.abc import Sequence

from transpiler.frontend.errors import BuildError
from transpiler.frontend.framework import Variable, default_main_program

LR_DECAY_COUNTER = "@LR_DECAY_COUNTER@"


def _decay_step_counter(begin: int = 0) -> Variable:
    from transpiler.frontend import layers

    global_step = layers.autoincreased_step_counter(counter_name=LR_DECAY_COUNTER, begin=begin, step=1)
    return layers.cast(global_step, "float32")


def _check_positive(name: str, **values: float) -> None:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise BuildError(name, f"{key} must be a positive number, got {value!r}")


def exponential_decay(learning_rate: float, decay_steps: int, decay_rate: float, staircase: bool = False) -> Variable:
    """`lr * decay_rate ^ (step / decay_steps)` (the exponent floored with `staircase`)."""
    _check_positive("exponential_decay", learning_rate=learning_rate, decay_steps=decay_steps, decay_rate=decay_rate)
    from transpiler.frontend import layers

    with default_main_program()._lr_schedule_guard():
        div_res = _decay_step_counter() / decay_steps
        if staircase:
            div_res = layers.floor(div_res)
        return learning_rate * (decay_rate**div_res)


def natural_exp_decay(learning_rate: float, decay_steps: int, decay_rate: float, staircase: bool = False) -> Variable:
    """`lr * exp(-decay_rate * step / decay_steps)`."""
    _check_positive("natural_exp_decay", learning_rate=learning_rate, decay_steps=decay_steps, decay_rate=decay_rate)
    from transpiler.frontend import layers

    with default_main_program()._lr_schedule_guard():
        div_res = _decay_step_counter() / decay_steps
        if staircase:
            div_res = layers.floor(div_res)
        return learning_rate * layers.exp(-1 * decay_rate * div_res)


def inverse_time_decay(learning_rate: float, decay_steps: int, decay_rate: float, staircase: bool = False) -> Variable:
    """`lr / (1 + decay_rate * step / decay_steps)`."""
    _check_positive("inverse_time_decay", learning_rate=learning_rate, decay_steps=decay_steps, decay_rate=decay_rate)
    from transpiler.frontend import layers

    with default_main_program()._lr_schedule_guard():
        div_res = _decay_step_counter() / decay_steps
        if staircase:
            div_res = layers.floor(div_res)
        return learning_rate / (1 + decay_rate * div_res)


def piecewise_decay(boundaries: Sequence[float], values: Sequence[float]) -> Variable:
    """`values[i]` while `step < boundaries[i]`, else the last value: a persistable
    `learning_rate` var assigned in one `conditional_block` sub-block per case."""
    if len(values) - len(boundaries) != 1:
        raise BuildError("piecewise_decay", f"len(values) - len(boundaries) must be 1, got {len(values)} and {len(boundaries)}")
    from transpiler.frontend import layers

    with default_main_program()._lr_schedule_guard():
        global_step = _decay_step_counter()
        lr = layers.create_global_var(shape=[1], value=0.0, dtype="float32", persistable=True, name="learning_rate")
        with layers.Switch() as switch:
            for boundary, value in zip(boundaries, values[:-1], strict=True):
                boundary_var = layers.fill_constant([1], "float32", float(boundary), force_cpu=True)
                value_var = layers.fill_constant([1], "float32", float(value))
                with switch.case(global_step < boundary_var):
                    layers.assign(value_var, lr)
            last = layers.fill_constant([1], "float32", float(values[-1]))
            with switch.default():
                layers.assign(last, lr)
        return lr
