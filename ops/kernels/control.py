"""Control kernels: `conditional_block` (runs its `sub_block` in a child scope) and the
`feed` / `fetch` ops Paddle's executor inserts."""

from __future__ import annotations

import numpy as np

from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register
from ops.tensor import LoDTensor, SelectedRows


def _numel(value: object) -> int:
    if isinstance(value, (LoDTensor, SelectedRows, np.ndarray)):
        return int(np.prod(value.shape))
    return 0


@register("conditional_block")
def conditional_block(ctx: OpContext) -> None:
    """Run `sub_block` when `Cond` holds: its single element is true
    (`is_scalar_condition`), or else every Cond tensor is non-empty (Paddle's rule).
    The sub-block runs in a child scope; its writes to vars of enclosing blocks land in
    their scopes (see `Frame.write`)."""
    conds = ctx.values("Cond")
    if ctx.attr("is_scalar_condition"):
        if len(conds) != 1:
            raise KernelError(f"conditional_block with a scalar condition needs one Cond, got {len(conds)}")
        run = bool(ctx.scalar("Cond"))
    else:
        run = all(_numel(c) != 0 for c in conds)
    if not run:
        return
    block_idx = int(ctx.attr("sub_block"))
    child = ctx.scope.new_scope()
    if ctx.has_output("Scope"):
        ctx.set_output("Scope", [child])
    ctx.run.run_block(block_idx, child, ctx.frame)


FEED_HOLDER = "feed"
FETCH_HOLDER = "fetch"


@register("feed", defaults={"col": 0})
def feed(ctx: OpContext) -> None:
    """Copy column `col` of the feed holder (a list the executor fills) to Out; when
    the executor already bound Out by name, there is nothing to do."""
    holder = ctx.optional_value("X")
    col = int(ctx.attr("col"))
    if isinstance(holder, list) and col < len(holder) and holder[col] is not None:
        ctx.set_output("Out", holder[col])
        return
    name = ctx.output_names("Out")[0]
    if ctx.scope.find_var(name) is None:
        raise KernelError(f"feed: nothing was fed for {name!r} (column {col})")


@register("fetch", defaults={"col": 0})
def fetch(ctx: OpContext) -> None:
    """Put X in column `col` of the fetch holder list."""
    value = ctx.value("X")
    name = ctx.output_names("Out")[0] if ctx.has_output("Out") else FETCH_HOLDER
    holder = ctx.scope.find_var(name)
    if not isinstance(holder, list):
        holder = []
    holder = list(holder)
    col = int(ctx.attr("col"))
    holder.extend([None] * (col + 1 - len(holder)))
    holder[col] = value
    ctx.frame.write(name, holder)

