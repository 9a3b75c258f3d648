"""Lowering: gradient-clip ops stay on the trainer, which sends the clipped grad.

Fluid 1.7+'s `DistributeTranspiler._get_optimize_pass` re-tags every Optimize op whose
`op_namescope` contains `@CLIP` as Backward (pserver mode), so it stays on the trainer:
each trainer clips its own grad, sends the clipped grad, and the pserver block has no
clip. That is also the only place a global-norm clip can be computed: it reads every
grad, and no pserver holds them all.

Which scopes are clips (`CLIP_NAME_SCOPES`): Paddle's rule, `@CLIP`, matches only what
Fluid 1.8's `set_gradient_clip` (`append_gradient_clip_ops`) emits, `/gradient_clip_@CLIP/`
and `/graident_clip_@CLIP/` (sic). An optimizer's `grad_clip=` (Fluid 1.8's `_static_clip`,
Paddle 2.x's `ClipGradBy*`) builds its ops in `/gradient_clip/`, which Paddle's rule
misses: Fluid 1.8.5 then drops them from the trainer yet sends the clipped grad they
wrote (a var no trainer op computes), and Paddle 2.6 clips on the pservers, a global norm
from one pserver's grads. Paddle's own `_correct_clip_op_role_var` knows clip ops by
`gradient_clip` in the scope; so do we, and both kinds stay on the trainer.

With `clip_mode="exact"` (sync mode; `transpiler.config.CLIP_MODES`) a per-param clip,
`clip` (ClipGradByValue, GradientClipByValue) or `clip_by_norm` (ClipGradByNorm,
GradientClipByNorm), keeps its Optimize role instead: it moves with its param's optimizer
to the pserver, which runs it on the averaged grad, as local training does (for a sliced
param the pservers holding it sum its squared norm: pserver_norm_reduce.py). A global-norm clip
(ClipGradByGlobalNorm, GradientClipByGlobalNorm) is taken out of the program and recorded
as a `NormGroup`: the trainers send unclipped grads, and each pserver computes its
grads' partial sum of squares, exchanges it with the other pservers and scales its grads
by the exact global norm (transpiler/passes/pserver_norm_reduce.py).

It runs before the analysis and rewrites the bundle's private copy of the original (the
user's program keeps its roles), so find_optimize's data flow sees the clip ops as
trainer ops: the grad the optimize ops read that a trainer op writes is the clipped one.
"""

from __future__ import annotations

from transpiler.config import TranspileOptions
from transpiler.errors import TranspileError
from transpiler.ir import Op, OpRole
from transpiler.ir.types import OP_NAMESCOPE_ATTR, OP_ROLE_ATTR, OP_ROLE_VAR_ATTR
from dataclasses import replace

from transpiler.passes.bundle import Bundle, NormGroup
from transpiler.passes.contract import Pass

# Substrings of `op_namescope` that mark a gradient-clip op (see the module docstring).
CLIP_NAME_SCOPES = ("@CLIP", "gradient_clip")


def is_clip_op(op: Op) -> bool:
    """An optimize op built by a gradient clip."""
    if not op.has_role(OpRole.Optimize):  # the cheap test first: most ops are not
        return False
    scope = op.attr(OP_NAMESCOPE_ATTR, "") or ""
    return any(mark in scope for mark in CLIP_NAME_SCOPES)


# Clip ops that read one grad and write its clipped value: exact on the pserver.
PER_PARAM_CLIPS = ("clip", "clip_by_norm")


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    clips = [op for op in bundle.origin.global_block().ops if is_clip_op(op)]
    if not clips:
        return bundle
    if options.clip_mode == "exact":  # the per-param ones keep their Optimize role: they go with their params
        global_norm = [op for op in clips if op.type not in PER_PARAM_CLIPS]
        if not global_norm:
            return bundle
        bundle = bundle.own_origins()
        block = bundle.origin.global_block()
        group = _take_global_norm(block, [op for op in block.ops if is_clip_op(op) and op.type not in PER_PARAM_CLIPS])
        return replace(bundle, norm_groups=(group,))
    bundle = bundle.own_origins()
    for op in bundle.origin.global_block().ops:
        if is_clip_op(op):
            op.set_attr(OP_ROLE_ATTR, int(OpRole.Backward))  # as Paddle: the op stays, its role_var too
    return bundle


def _take_global_norm(block, ops: list[Op]) -> NormGroup:
    """Remove a global-norm clip's ops from `block` and describe them: the `elementwise_mul`s
    scaling each grad by one factor, and the `fill_constant` holding `clip_norm`. Readers of
    a clipped grad written to a new var (Fluid 1.8) read the grad itself afterwards."""
    muls = [op for op in ops if op.type == "elementwise_mul"]
    factors = {op.input("Y")[0] for op in muls}
    fills = [op for op in ops if op.type == "fill_constant"]
    if not muls or len(factors) != 1 or len(fills) != 1:
        first = ops[0]
        raise TranspileError(
            f"clip_mode='exact': the global-norm clip at op {first.index} ({first.type}) is not one group "
            f"scaling grads by one factor ({len(factors)} factors, {len(fills)} clip norms); use clip_mode='trainer'"
        )
    text = str(fills[0].attr("str_value", "") or "")
    clip_norm = float(text) if text else float(fills[0].attr("value", 0.0))
    grads, renames = [], {}
    for op in muls:
        grad, out = op.input("X")[0], op.output("Out")[0]
        grads.append((op.role_vars[0] if op.role_vars else grad, grad))
        if out != grad:
            renames[out] = grad
    block.remove_ops(ops)
    if renames:
        for op in block.ops:
            for slot in list(op.inputs):
                names = op.input(slot)
                if any(n in renames for n in names):
                    op.set_input(slot, [renames.get(n, n) for n in names])
            role_vars = op.role_vars
            if any(n in renames for n in role_vars):
                op.set_attr(OP_ROLE_VAR_ATTR, [renames.get(n, n) for n in role_vars])
    return NormGroup(clip_norm=clip_norm, grads=tuple(grads))


PASS = Pass("keep_clip_on_trainer", run, requires=("origin",), produces=("origin",))
