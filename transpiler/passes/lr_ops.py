"""Which ops compute the learning rate, and which of them counts the global step: asked
by the async lr-decay lowering (before the analysis) and by find_optimize."""

from __future__ import annotations

from collections.abc import Iterable

from transpiler.ir import Op, OpRole


def is_lr_op(op: Op) -> bool:
    """Paddle tags the ops of `fluid.layers.*_decay` with the LRSched role (its `_get_lr_ops`
    takes LRSched and LRSched|Optimize)."""
    return op.has_role(OpRole.LRSched)


def counter_increment(ops: Iterable[Op]) -> Op | None:
    """The first lr op that adds to its var in place: the `increment` of the global step
    (`@LR_DECAY_COUNTER@` for `fluid.layers.*_decay`)."""
    for op in ops:
        if op.type == "increment" and op.input("X") and op.input("X") == op.output("Out"):
            return op
    return None
