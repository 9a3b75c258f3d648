"""Comparisons, logic and control flow: `conditional_block` (what `piecewise_decay`'s
`Switch`, `paddle.static.nn.cond` and `switch_case` build), `while` (`while_loop`),
`select_input` / `select_output` (how `cond` merges its branches and splits their grad).

`conditional_block` runs its `sub_block` when `Cond` holds. Paddle differentiates it and
`while` through grad sub-blocks (`conditional_block_grad`, `while_grad`, written here as
Paddle 2.6 registers them: programs Paddle built carry them, and the kernels run them);
our builder does not build them (`GRAD_UNSUPPORTED`): an lr schedule never needs it, and
a conditional on the loss path is refused by name.
"""

from __future__ import annotations

from ops.catalogue import shapes
from ops.catalogue.opdef import GRAD_UNSUPPORTED, BlockAttr, Bool, Int, Strs, op
from transpiler.ir.types import OpRole

_COMPARE_ATTRS = {"axis": Int(-1), "force_cpu": Bool(False)}

OPS = (
    *(op(name, "X Y", "Out", _COMPARE_ATTRS, infer=shapes.compare) for name in (
        "less_than", "less_equal", "greater_than", "greater_equal", "equal", "not_equal",
    )),
    *(op(name, "X Y", "Out", infer=shapes.logical) for name in ("logical_and", "logical_or", "logical_xor")),
    op("logical_not", "X", "Out", infer=shapes.logical),
    op(
        "conditional_block",
        "Cond* Input*",
        "Out* Scope",
        {"sub_block": BlockAttr(), "is_scalar_condition": Bool(False), "skip_eager_deletion_vars": Strs([])},
        grad=GRAD_UNSUPPORTED,
    ),
    op(
        "conditional_block_grad",
        "Cond* Input* Out* Out@GRAD* Scope",
        "Cond@GRAD*? Input@GRAD*",
        {"sub_block": BlockAttr(), "is_scalar_condition": Bool(False), "skip_eager_deletion_vars": Strs([])},
        role=OpRole.Backward,
    ),
    op(
        "while",
        "X* Condition",
        "Out* StepScopes",
        {"sub_block": BlockAttr(), "is_test": Bool(False), "skip_eager_deletion_vars": Strs([])},
        grad=GRAD_UNSUPPORTED,
    ),
    op(
        "while_grad",
        "X* Out* Out@GRAD* StepScopes",
        "X@GRAD*",
        {"sub_block": BlockAttr(), "is_test": Bool(False), "original_output_grad": Strs([]),
         "skip_eager_deletion_vars": Strs([])},
        role=OpRole.Backward,
    ),
    op("select_input", "X* Mask", "Out", grad=GRAD_UNSUPPORTED),
    op("write_to_array", "X I", "Out", grad=GRAD_UNSUPPORTED),
    op("read_from_array", "X I X_W?", "Out", grad=GRAD_UNSUPPORTED),
    op("select_output", "X Mask", "Out*", grad=GRAD_UNSUPPORTED),
)
