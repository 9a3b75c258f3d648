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
as a `NormGroup` per group (per scale factor): the trainers send unclipped grads, and
each pserver computes its grads' partial sum of squares per group, exchanges it with the
other pservers and scales its grads by their group's exact norm
(transpiler/passes/pserver_norm_reduce.py).

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
        clips = [op for op in block.ops if is_clip_op(op) and op.type not in PER_PARAM_CLIPS]
        groups = _take_global_norms(block, clips)
        return replace(bundle, norm_groups=groups)
    bundle = bundle.own_origins()
    for op in bundle.origin.global_block().ops:
        if is_clip_op(op):
            op.set_attr(OP_ROLE_ATTR, int(OpRole.Backward))  # as Paddle: the op stays, its role_var too
    return bundle


def _take_global_norms(block, ops: list[Op]) -> tuple[NormGroup, ...]:
    """Remove the global-norm clips' ops from `block` and describe each group: the
    `elementwise_mul`s scaling grads by one factor, the grads whose squares that factor is
    computed from (they must be the grads it scales) and the `fill_constant` holding its
    `clip_norm`. Several groups (two optimizers' `grad_clip=`, Fluid's `group_name`) are
    told apart by their factor, in the order of their first `elementwise_mul`. Readers of a
    clipped grad written to a new var (Fluid 1.8) read the grad itself afterwards."""
    first = ops[0]

    def refuse(why: str) -> TranspileError:
        return TranspileError(f"clip_mode='exact': the global-norm clip at op {first.index} ({first.type}): {why}; "
                              f"use clip_mode='trainer'")

    muls = [op for op in ops if op.type == "elementwise_mul"]
    if not muls:
        raise refuse("no elementwise_mul scales a grad")
    writer = {name: op for op in ops if op.type != "elementwise_mul" for name in op.output_names}
    factors = list(dict.fromkeys(op.input("Y")[0] for op in muls))
    groups, claimed, scaled_anywhere = [], set(), set()
    for factor in factors:
        if factor not in writer:
            raise refuse(f"its factor {factor} is not computed by the clip")
        ancestors, stack = {}, [writer[factor]]
        while stack:  # the ops the factor is computed from, within the clip
            op = stack.pop()
            if id(op) in ancestors:
                continue
            ancestors[id(op)] = op
            stack.extend(writer[name] for name in op.input_names if name in writer)
        if claimed & ancestors.keys():
            raise refuse(f"the factors {', '.join(factors)} share ops")
        claimed |= ancestors.keys()
        fills = [op for op in ancestors.values() if op.type == "fill_constant"]
        if len(fills) != 1:
            raise refuse(f"the factor {factor} is computed from {len(fills)} clip norms (fill_constant), not 1")
        normed = {name for op in ancestors.values() for name in op.input_names if name not in writer}
        scaling = [op for op in muls if op.input("Y")[0] == factor]
        scaled = [op.input("X")[0] for op in scaling]
        if set(scaled) != normed or len(scaled) != len(normed) or scaled_anywhere & normed:
            raise refuse(f"the factor {factor} is the norm of {sorted(normed)} but scales {scaled}")
        scaled_anywhere |= normed
        text = str(fills[0].attr("str_value", "") or "")
        clip_norm = float(text) if text else float(fills[0].attr("value", 0.0))
        groups.append((clip_norm, scaling))
    dead = [op for op in ops if op.type != "elementwise_mul" and id(op) not in claimed]
    if dead:
        raise refuse(f"op {dead[0].index} ({dead[0].type}) feeds no group's scale")
    renames = {}
    norm_groups = []
    for clip_norm, scaling in groups:
        grads = []
        for op in scaling:
            grad, out = op.input("X")[0], op.output("Out")[0]
            grads.append((op.role_vars[0] if op.role_vars else grad, grad))
            if out != grad:
                renames[out] = grad
        norm_groups.append(NormGroup(clip_norm=clip_norm, grads=tuple(grads)))
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
    return tuple(norm_groups)


PASS = Pass("keep_clip_on_trainer", run, requires=("origin",), produces=("origin",))
