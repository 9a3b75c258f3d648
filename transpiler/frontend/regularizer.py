"""Weight decay as ops before the optimizer op: `scale(param) → decay`, `sum(grad, decay) → grad`.

Both ops are built under the optimizer guard of their (param, grad), so they carry
`op_role = Optimize` and `op_role_var = [param, grad]`, which is how the transpiler
knows to move them to the pserver with the optimizer op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transpiler.frontend.errors import BuildError
from transpiler.frontend.framework import Parameter, Variable, append_op, create_var
from transpiler.ir import Block, VarKind


class WeightDecayRegularizer:
    def __call__(self, param: Parameter, grad: Variable, block: Block) -> Variable:
        raise NotImplementedError


class L2DecayRegularizer(WeightDecayRegularizer):
    """Adds `coeff * param` to the gradient."""

    def __init__(self, regularization_coeff: float = 0.0) -> None:
        if isinstance(regularization_coeff, bool) or not isinstance(regularization_coeff, (int, float)):
            raise BuildError("L2Decay", f"regularization_coeff must be a number, got {regularization_coeff!r}")
        self._regularization_coeff = float(regularization_coeff)

    def __call__(self, param: Parameter, grad: Variable, block: Block) -> Variable:
        if grad.type == VarKind.SELECTED_ROWS:
            raise BuildError(
                "L2Decay", f"{param.name!r} has a sparse (SelectedRows) gradient; the builder regularises dense grads only"
            )
        decay = create_var(block, shape=param.shape, dtype=param.dtype, lod_level=param.lod_level, layer="L2Decay")
        append_op(block, "scale", {"X": [param]}, {"Out": [decay]}, {"scale": self._regularization_coeff}, layer="L2Decay")
        return decay

    def __repr__(self) -> str:
        return f"L2Decay, regularization_coeff={self._regularization_coeff}"


L2Decay = L2DecayRegularizer


def append_regularization_ops(
    params_grads: Sequence[tuple[Parameter, Variable | None]], regularization: Any = None
) -> list[tuple[Parameter, Variable | None]]:
    """Regularise each grad by its param's regularizer, else by `regularization`."""
    if regularization is not None and not isinstance(regularization, WeightDecayRegularizer):
        raise BuildError("regularization", f"expected a regularizer such as L2Decay(1e-4), got {regularization!r}")
    out = []
    for param, grad in params_grads:
        rule = getattr(param, "regularizer", None) or regularization
        if grad is None or rule is None:
            out.append((param, grad))
            continue
        if not isinstance(rule, WeightDecayRegularizer):
            raise BuildError("regularization", f"{param.name!r} has regularizer {rule!r}, which is not a regularizer")
        program = param.program
        with program._optimized_guard([param, grad]):
            term = rule(param, grad, grad.block)
            append_op(grad.block, "sum", {"X": [grad, term]}, {"Out": [grad]}, layer="regularization")
        out.append((param, grad))
    return out
