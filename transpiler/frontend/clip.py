"""Gradient clipping by value: a `clip` op on the grad before regularisation and the
optimizer op, with `op_role_var = [param, clipped grad]`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transpiler.frontend.errors import BuildError
from transpiler.frontend.framework import Parameter, Program, Variable, default_main_program


class GradientClipBase:
    def __call__(self, params_grads: Sequence[tuple[Parameter, Variable | None]]) -> list[tuple[Parameter, Variable | None]]:
        raise NotImplementedError


class GradientClipByValue(GradientClipBase):
    """Clip every gradient (or those `need_clip(param)` selects) to `[min, max]`."""

    def __init__(self, max: float, min: float | None = None, need_clip: Callable[[Parameter], bool] | None = None) -> None:  # noqa: A002
        if min is None:
            if max <= 0:
                raise BuildError("GradientClipByValue", f"max must be positive when min is omitted, got {max}")
            min = -max
        if min > max:
            raise BuildError("GradientClipByValue", f"min {min} is greater than max {max}")
        self.max = float(max)
        self.min = float(min)
        self._need_clip = need_clip

    def clip_one(self, param: Parameter, grad: Variable) -> Variable:
        from transpiler.frontend import layers

        with param.program._optimized_guard([param, grad]):
            op_count = len(grad.block)
            new_grad = layers.clip(grad, min=self.min, max=self.max)
            # Fluid's _correct_clip_op_role_var: the clip op names the clipped grad.
            clip_op = grad.block.ops[op_count]
            clip_op.set_attr("op_role_var", [param.name, new_grad.name])
        return new_grad

    def __call__(self, params_grads):
        out = []
        for param, grad in params_grads:
            if grad is None or (self._need_clip is not None and not self._need_clip(param)):
                out.append((param, grad))
                continue
            out.append((param, self.clip_one(param, grad)))
        return out

    def __repr__(self) -> str:
        return f"Gradient Clip By Value, min = {self.min:f}, max={self.max:f}"


def set_gradient_clip(clip: GradientClipBase, param_list: Sequence[Any] | None = None, program: Program | None = None) -> None:
    """Attach `clip` to the given parameters (all of the program's by default)."""
    if not isinstance(clip, GradientClipByValue):
        raise BuildError("set_gradient_clip", f"only GradientClipByValue is supported, got {type(clip).__name__}")
    program = program or default_main_program()
    names = None if param_list is None else {p.name if isinstance(p, Variable) else str(p) for p in param_list}
    for param in program.all_parameters():
        if names is None or param.name in names:
            param.gradient_clip_attr = clip


def append_gradient_clip_ops(params_grads):
    """Clip each grad whose parameter carries a clip (`ParamAttr(gradient_clip=...)` or
    `set_gradient_clip`). Fluid 1.8 applied the last parameter's clip to all of them
    and skipped everything when the first had none; this clips exactly those that ask."""
    out = []
    for param, grad in params_grads:
        clip = getattr(param, "gradient_clip_attr", None)
        if grad is None or clip is None:
            out.append((param, grad))
            continue
        if not isinstance(clip, GradientClipByValue):
            raise BuildError("gradient_clip", f"{param.name!r}: only GradientClipByValue is supported, got {clip!r}")
        out.append((param, clip.clip_one(param, grad)))
    return out
