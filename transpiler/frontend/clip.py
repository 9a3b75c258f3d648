"""Gradient clipping, as Fluid 1.8's `fluid.clip` builds it: by value (`clip`), by norm
(`clip_by_norm`) and by global norm (`square` → `reduce_sum` per grad, `sum` → `sqrt`,
`fill_constant` → `elementwise_max` → `elementwise_div`, `elementwise_mul` per grad).

The ops carry the Optimize role and `op_role_var = [param, clipped grad]`, and they are
built in Fluid's name scopes, which is how the transpiler knows them (it keeps them on
the trainer): an optimizer's `grad_clip=` builds in `/gradient_clip/`;
`set_gradient_clip` (or `ParamAttr(gradient_clip=...)`) in `/gradient_clip_@CLIP/` (the
global norm's per-grad part) and `/graident_clip_@CLIP/` (sic, Fluid's spelling).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transpiler.frontend.errors import BuildError
from transpiler.frontend.framework import Parameter, Program, Variable, default_main_program, name_scope
from transpiler.ir.types import OP_NAMESCOPE_ATTR, OP_ROLE_VAR_ATTR, VarKind

# Fluid 1.8's scopes (clip.py): `_static_clip`, and `append_gradient_clip_ops`' two loops.
GRAD_CLIP_SCOPE = "gradient_clip"
SET_CLIP_CONTEXT_SCOPE = "gradient_clip_@CLIP"
SET_CLIP_OPS_SCOPE = "graident_clip_@CLIP"


class GradientClipBase:
    """A clip of the grads `need_clip(param)` selects (all by default)."""

    def __init__(self, need_clip: Callable[[Parameter], bool] | None = None) -> None:
        if need_clip is not None and not callable(need_clip):
            raise BuildError(type(self).__name__, f"need_clip must be a function of the param, got {need_clip!r}")
        self._need_clip = need_clip

    def _selected(self, param: Parameter) -> bool:
        return self._need_clip is None or bool(self._need_clip(param))

    def __call__(self, params_grads: Sequence[tuple[Parameter, Variable | None]]) -> list[tuple[Parameter, Variable | None]]:
        """`optimizer(grad_clip=self)`: Fluid's `_static_clip`, in `/gradient_clip/`."""
        with name_scope(GRAD_CLIP_SCOPE):
            return self._clip_each(params_grads, self._clip)

    def _clip_each(self, params_grads, clip_one: Callable[[Parameter, Variable], Variable]):
        """Each selected grad through `clip_one(param, grad)` under its role vars, the others
        as they are (grads that are None dropped, as Fluid does)."""
        out: list[tuple[Parameter, Variable | None]] = []
        renamed: dict[str, str] = {}
        for param, grad in params_grads:
            if grad is None:
                continue
            if not self._selected(param):
                out.append((param, grad))
                continue
            with param.program._optimized_guard([param, grad]):
                new_grad = clip_one(param, grad)
            renamed[param.name] = new_grad.name
            out.append((param, new_grad))
        _correct_clip_op_role_var(out, renamed)
        return out

    def _clip(self, param: Parameter, grad: Variable) -> Variable:
        raise NotImplementedError

    # set_gradient_clip's two steps (Fluid's `_process_context` / `_create_operators`)
    def _process_context(self, context: dict, param: Parameter, grad: Variable) -> None:
        pass

    def _create_operators(self, context: dict, param: Parameter, grad: Variable) -> Variable:
        return self._clip(param, grad)


class GradientClipByValue(GradientClipBase):
    """Clip every element of a grad to `[min, max]`."""

    def __init__(self, max: float, min: float | None = None, need_clip: Callable[[Parameter], bool] | None = None) -> None:  # noqa: A002
        super().__init__(need_clip)
        if min is None:
            if max <= 0:
                raise BuildError("GradientClipByValue", f"max must be positive when min is omitted, got {max}")
            min = -max
        if min > max:
            raise BuildError("GradientClipByValue", f"min {min} is greater than max {max}")
        self.max = float(max)
        self.min = float(min)

    def _clip(self, param: Parameter, grad: Variable) -> Variable:
        from transpiler.frontend import layers

        return layers.clip(grad, min=self.min, max=self.max)

    def __repr__(self) -> str:
        return f"Gradient Clip By Value, min = {self.min:f}, max={self.max:f}"


class GradientClipByNorm(GradientClipBase):
    """Scale each grad down to an L2 norm of at most `clip_norm` (`clip_by_norm`)."""

    def __init__(self, clip_norm: float, need_clip: Callable[[Parameter], bool] | None = None) -> None:
        super().__init__(need_clip)
        if not clip_norm > 0:
            raise BuildError("GradientClipByNorm", f"clip_norm must be positive, got {clip_norm}")
        self.clip_norm = float(clip_norm)

    def _clip(self, param: Parameter, grad: Variable) -> Variable:
        from transpiler.frontend import layers

        return layers.clip_by_norm(grad, max_norm=self.clip_norm)

    def __repr__(self) -> str:
        return f"Gradient Clip By Norm, clip_norm={self.clip_norm:f}"


class GradientClipByGlobalNorm(GradientClipBase):
    """Scale all selected grads by `clip_norm / max(clip_norm, global_norm)`, the global
    norm being the L2 norm of all of them together. It reads every grad: only a trainer
    can compute it (the transpiler keeps it there)."""

    def __init__(self, clip_norm: float, group_name: str = "default_group",
                 need_clip: Callable[[Parameter], bool] | None = None) -> None:
        super().__init__(need_clip)
        if not clip_norm > 0:
            raise BuildError("GradientClipByGlobalNorm", f"clip_norm must be positive, got {clip_norm}")
        if not isinstance(group_name, str):
            raise BuildError("GradientClipByGlobalNorm", f"group_name must be a string, got {group_name!r}")
        self.clip_norm = float(clip_norm)
        self.group_name = group_name

    def __call__(self, params_grads):
        """Fluid 1.8's `_static_clip`: the squares' sums per grad, then the scale (under the
        last grad's role vars), then each grad times the scale."""
        from transpiler.frontend import layers

        squares: list[Variable] = []
        last = None
        with name_scope(GRAD_CLIP_SCOPE):
            for param, grad in params_grads:
                if grad is None or not self._selected(param):
                    continue
                last = (param, grad)
                with param.program._optimized_guard([param, grad]):
                    squares.append(self._sum_of_squares(param, grad))
            if last is None:
                return list(params_grads)
            with last[0].program._optimized_guard(list(last)):
                norm = layers.sqrt(layers.sums(squares))
                limit = layers.fill_constant(shape=[1], dtype=last[1].dtype, value=self.clip_norm)
                scale = layers.elementwise_div(limit, layers.elementwise_max(limit, norm))
            return self._clip_each(params_grads, lambda param, grad: layers.elementwise_mul(grad, scale))

    @staticmethod
    def _sum_of_squares(param: Parameter, grad: Variable) -> Variable:
        from transpiler.frontend import layers

        if grad.type != VarKind.LOD_TENSOR:
            raise BuildError("GradientClipByGlobalNorm", f"{param.name!r}: a sparse grad cannot be clipped here yet")
        return layers.reduce_sum(layers.square(grad))

    def _process_context(self, context: dict, param: Parameter, grad: Variable) -> None:
        from transpiler.frontend import layers

        group = context.setdefault(("global_norm", self.group_name), {"squares": [], "clip_norm": self.clip_norm})
        if group["clip_norm"] != self.clip_norm:
            raise BuildError("GradientClipByGlobalNorm",
                             f"the params of group {self.group_name!r} must share one clip_norm")
        if "limit" not in group:
            group["limit"] = layers.fill_constant(shape=[1], dtype=grad.dtype, value=self.clip_norm)
        group["squares"].append(self._sum_of_squares(param, grad))

    def _create_operators(self, context: dict, param: Parameter, grad: Variable) -> Variable:
        from transpiler.frontend import layers

        group = context[("global_norm", self.group_name)]
        if "scale" not in group:
            norm = layers.sqrt(layers.sums(group["squares"]))
            group["scale"] = layers.elementwise_div(group["limit"], layers.elementwise_max(group["limit"], norm))
        return layers.elementwise_mul(grad, group["scale"])

    def __repr__(self) -> str:
        return f"Gradient Clip By GlobalNorm, global_norm={self.clip_norm:f}"


def set_gradient_clip(clip: GradientClipBase, param_list: Sequence[Any] | None = None, program: Program | None = None) -> None:
    """Attach `clip` to the given parameters (all of the program's by default)."""
    if not isinstance(clip, GradientClipBase):
        raise BuildError("set_gradient_clip", f"clip must be a GradientClip* object, got {type(clip).__name__}")
    program = program or default_main_program()
    names = None if param_list is None else {p.name if isinstance(p, Variable) else str(p) for p in param_list}
    for param in program.all_parameters():
        if names is None or param.name in names:
            param.gradient_clip_attr = clip


def append_gradient_clip_ops(params_grads):
    """Clip each grad whose parameter carries a clip (`ParamAttr(gradient_clip=...)` or
    `set_gradient_clip`), in Fluid's `@CLIP` scopes: first every clip's per-grad context
    (a global norm's squares), then the clipping ops. Fluid 1.8 applied the last
    parameter's clip to all of them and skipped everything when the first had none; this
    clips exactly those that ask, each with its own clip."""
    wanted = [(p, g, getattr(p, "gradient_clip_attr", None)) for p, g in params_grads if g is not None]
    wanted = [(p, g, c) for p, g, c in wanted if c is not None]
    for _, _, clip in wanted:
        if not isinstance(clip, GradientClipBase):
            raise BuildError("gradient_clip", f"clip must be a GradientClip* object, got {clip!r}")
    if not wanted:
        return list(params_grads)
    context: dict = {}
    for param, grad, clip in wanted:
        with param.program._optimized_guard([param, grad]), name_scope(SET_CLIP_CONTEXT_SCOPE):
            clip._process_context(context, param, grad)
    clipped: dict[str, Variable] = {}
    for param, grad, clip in wanted:
        with param.program._optimized_guard([param, grad]), name_scope(SET_CLIP_OPS_SCOPE):
            clipped[param.name] = clip._create_operators(context, param, grad)
    out = [(p, clipped.get(p.name, g)) for p, g in params_grads]
    _correct_clip_op_role_var(out, {name: grad.name for name, grad in clipped.items()})
    return out


def _correct_clip_op_role_var(params_grads, renamed: dict[str, str]) -> None:
    """Fluid's: the clip ops in a `gradient_clip` scope name the clipped grad in their role vars."""
    if not renamed:
        return
    programs = {id(p.program): p.program for p, g in params_grads if g is not None}
    for program in programs.values():
        for op in program.global_block().ops:
            role_vars = op.attr(OP_ROLE_VAR_ATTR, None)
            if role_vars and GRAD_CLIP_SCOPE in (op.attr(OP_NAMESCOPE_ATTR, "") or "") and role_vars[0] in renamed:
                op.set_attr(OP_ROLE_VAR_ATTR, [role_vars[0], renamed[role_vars[0]]])
