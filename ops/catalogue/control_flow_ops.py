"""Comparisons, logic and `conditional_block` (what `piecewise_decay`'s `Switch` builds).

`conditional_block` runs its `sub_block` when `Cond` holds; Paddle differentiates it
through a grad sub-block, which the builder does not build (`GRAD_UNSUPPORTED`): an lr
schedule never needs it, and a conditional on the loss path is refused by name.
"""

from __future__ import annotations

from ops.catalogue import shapes
from ops.catalogue.opdef import GRAD_UNSUPPORTED, BlockAttr, Bool, Int, Strs, op

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
)
