"""Control kernels: `conditional_block` / `conditional_block_grad`, `while` / `while_grad`,
`select_input` / `select_output` (what `paddle.static.nn.cond`, `switch_case` and
`while_loop` build), the tensor arrays loops keep their steps in (`write_to_array`,
`read_from_array`, and `sum` of arrays), and the `feed` / `fetch` ops Paddle's executor
inserts.

Scopes follow Paddle 2.6's operators (conditional_block_op.cc, while_op.cc):
* `conditional_block` runs its sub-block in a new child scope, kept in its `Scope` output;
  `conditional_block_grad` runs the grad sub-block in that same scope (so it reads the
  forward branch's temporaries), then copies each `<Input>@GRAD` it finds from there
  (that scope or its parents) to the op's `Input@GRAD` names; when the branch did not run, those get zeros shaped like the
  inputs.
* `while` runs its body in a new step scope per iteration (kept in `StepScopes`); a loop
  var the body overwrites (an `X` that is neither a parameter nor read and written by one
  body op) is also bound in the step scope to its value at the start of that step, as
  Paddle's `@TMP_COPY` rename does, so the grad reads each step's own inputs.
  `while_grad` walks the step scopes last to first: binds the output grads
  (`original_output_grad`) in the step scope, runs the grad body there, then hands each
  loop var's grad on to the step before (`X@GRAD` that is also an output grad) and sums
  every other input's grad (a parameter's) over the steps.
"""

from __future__ import annotations

import numpy as np

from ops.kernels.context import KernelError, OpContext
from ops.kernels.registry import register
from ops.tensor import LoDTensor, SelectedRows
from transpiler.ir.types import EMPTY_VAR_NAME

# `while` refuses to run more steps than this (a loop whose condition never turns false).
MAX_WHILE_STEPS = 1_000_000
GRAD_SUFFIX = "@GRAD"


def _numel(value: object) -> int:
    if isinstance(value, (LoDTensor, SelectedRows, np.ndarray)):
        return int(np.prod(value.shape))
    return 0


def _condition_holds(ctx: OpContext) -> bool:
    """`Cond`'s single element is true (`is_scalar_condition`), or else every Cond tensor
    is non-empty (Paddle's rule)."""
    conds = ctx.values("Cond")
    if ctx.attr("is_scalar_condition", False):
        if len(conds) != 1:
            raise KernelError(f"{ctx.type} with a scalar condition needs one Cond, got {len(conds)}")
        return bool(ctx.scalar("Cond"))
    return all(_numel(c) != 0 for c in conds)


@register("conditional_block")
def conditional_block(ctx: OpContext) -> None:
    """Run `sub_block` when `Cond` holds (`_condition_holds`).
    The sub-block runs in a child scope; its writes to vars of enclosing blocks land in
    their scopes (see `Frame.write`)."""
    if not _condition_holds(ctx):
        return
    block_idx = int(ctx.attr("sub_block"))
    child = ctx.scope.new_scope()
    if ctx.has_output("Scope"):
        ctx.set_output("Scope", [child])
    ctx.run.run_block(block_idx, child, ctx.frame)


def _zeros_like(value: object) -> LoDTensor:
    if isinstance(value, LoDTensor):
        return LoDTensor(np.zeros_like(value.array), value.lod)
    if isinstance(value, np.ndarray):
        return LoDTensor(np.zeros_like(value))
    raise KernelError(f"cannot make a zero grad like a {type(value).__name__}")


@register("conditional_block_grad")
def conditional_block_grad(ctx: OpContext) -> None:
    """When `Cond` holds, run the grad `sub_block` in the scope the forward branch ran in
    (`Scope`) and copy each `<Input[i]>@GRAD` found there to `Input@GRAD[i]`; otherwise,
    and for an input whose grad the branch did not compute, `Input@GRAD[i]` is zeros
    shaped like `Input[i]` (a branch that did not run contributes nothing)."""
    inputs = ctx.op.input("Input")
    outside = ctx.op.output("Input@GRAD")
    if len(outside) != len(inputs):
        raise KernelError(f"conditional_block_grad has {len(inputs)} Input but {len(outside)} Input@GRAD")
    scope = None
    if _condition_holds(ctx):
        scopes = ctx.value("Scope")
        if not isinstance(scopes, list) or not scopes:
            raise KernelError("conditional_block_grad: the forward conditional_block left no scope (Scope is empty)")
        scope = scopes[0]
        ctx.run.run_block(int(ctx.attr("sub_block")), scope, ctx.frame)
    for name, grad_name in zip(inputs, outside, strict=True):
        if not grad_name or grad_name == EMPTY_VAR_NAME:
            continue
        # Looked up through the scope's parents, as Paddle's `FindVar`: a grad op of the
        # branch may have written a var of an enclosing block (a loop var's grad in a
        # `while` body: it lands in the step scope).
        inside = None if scope is None else scope.find_var(name + GRAD_SUFFIX)
        if inside is None:
            value = ctx.scope.find_var(name)
            if value is None:
                raise KernelError(f"conditional_block_grad: input {name!r} has no value to shape its zero grad")
            inside = _zeros_like(value)
        ctx.set_var(grad_name, inside)


@register("select_input")
def select_input(ctx: OpContext) -> None:
    """Out = X[Mask] (Mask: one int32 element), what `cond` uses to merge its branches."""
    mask = int(ctx.scalar("Mask"))
    names = ctx.input_names("X")
    if not 0 <= mask < len(names):
        raise KernelError(f"select_input: Mask {mask} is not an index of its {len(names)} inputs")
    ctx.set_output("Out", ctx.value("X", mask))


@register("select_output")
def select_output(ctx: OpContext) -> None:
    """Out[Mask] = X; the other outputs are left alone (their branch did not run)."""
    mask = int(ctx.scalar("Mask"))
    names = ctx.output_names("Out")
    if not 0 <= mask < len(names):
        raise KernelError(f"select_output: Mask {mask} is not an index of its {len(names)} outputs")
    ctx.set_output("Out", ctx.value("X"), i=mask)


def _copied_loop_vars(ctx: OpContext) -> tuple[str, ...]:
    """The `X` vars whose value at the start of each step the step scope keeps: Paddle's
    `no_copy_var_names` are the global block's parameters and the names one body op both
    reads and writes; the rest are copied (worked out once per prepared block)."""
    names = ctx.memo.get("copied")
    if names is None:
        program = ctx.run.program
        body = program.block(int(ctx.attr("sub_block")))
        no_copy = {n for n, v in program.global_block().vars.items() if v.is_parameter}
        for op in body.ops:
            no_copy.update(set(op.input_names).intersection(op.output_names))
        names = ctx.memo["copied"] = tuple(dict.fromkeys(n for n in ctx.input_names("X") if n not in no_copy))
    return names


@register("while")
def while_(ctx: OpContext) -> None:
    """Run `sub_block` while `Condition` (one bool, re-read after each step) holds, each
    step in a new child scope (`StepScopes`, for `while_grad`); see the module docstring."""
    block_idx = int(ctx.attr("sub_block"))
    copied = () if ctx.attr("is_test") else _copied_loop_vars(ctx)
    steps = []
    while bool(ctx.scalar("Condition")):
        if len(steps) >= MAX_WHILE_STEPS:
            raise KernelError(f"while: the condition still holds after {MAX_WHILE_STEPS} steps")
        step = ctx.scope.new_scope()
        if not ctx.attr("is_test"):
            steps.append(step)
        starts = [(name, ctx.scope.find_var(name)) for name in copied]
        ctx.run.run_block(block_idx, step, ctx.frame)
        for name, value in starts:  # values are replaced, never mutated: no copy needed
            if isinstance(value, LoDTensor) and not step.has_var(name, local=True):
                step.set_var(name, value)
    ctx.set_output("StepScopes", steps)


def _zero_grad_of(value: object) -> object:
    if isinstance(value, (LoDTensor, np.ndarray)):
        return _zeros_like(value)
    if isinstance(value, list):
        return []
    return None


def _add(a: LoDTensor, b: object) -> LoDTensor:
    if not isinstance(b, LoDTensor):
        raise KernelError(f"while_grad sums dense grads only, got {type(b).__name__}")
    return LoDTensor(a.array + b.array, b.lod)


@register("while_grad")
def while_grad(ctx: OpContext) -> None:
    """Back through the step scopes, last step first (see the module docstring)."""
    steps = ctx.value("StepScopes")
    if not isinstance(steps, list):
        raise KernelError(f"while_grad: StepScopes holds a {type(steps).__name__}, not the forward's step scopes")
    block_idx = int(ctx.attr("sub_block"))
    outside_og = ctx.op.input("Out@GRAD")
    inside_og = list(ctx.attr("original_output_grad", ()))
    xs, x_grads = ctx.op.input("X"), ctx.op.output("X@GRAD")
    if len(xs) != len(x_grads):
        raise KernelError(f"while_grad has {len(xs)} X but {len(x_grads)} X@GRAD")
    passed_on = set(outside_og)
    wanted = [(x, g) for x, g in zip(xs, x_grads, strict=True) if g and g != EMPTY_VAR_NAME]
    if not steps:  # the loop never ran: its outputs are its inputs
        for x, g in wanted:
            if g not in passed_on:
                ctx.set_var(g, _zeros_like(ctx.scope.find_var(x)))
        return
    for k, step in enumerate(reversed(steps)):
        for outside, inside in zip(outside_og, inside_og):
            if inside == EMPTY_VAR_NAME or not inside:
                continue
            if k == 0 and not _written_before(ctx, outside):
                # No op after the loop reads that output: its grad is zero. (The scope may
                # still hold the value the last run's while_grad left under that name.)
                value = _zero_grad_of(ctx.scope.find_var(outside[: -len(GRAD_SUFFIX)])
                                      if outside.endswith(GRAD_SUFFIX) else None)
            else:
                value = ctx.scope.find_var(outside)
            if value is not None:
                step.set_var(inside, value)
        # Writes go where Paddle's scopes put them: the grad body's own vars and the output
        # grads just bound land in the step scope (no enclosing frame claims them).
        ctx.run.run_block(block_idx, step, None)
        for x, g in wanted:
            inside = step.find_var(x + GRAD_SUFFIX)
            if inside is None:
                raise KernelError(f"while_grad: step {len(steps) - 1 - k} computed no {x + GRAD_SUFFIX!r}")
            if g in passed_on:
                ctx.set_var(g, inside)  # a loop var: the grad of this step's input, for the step before
            elif k == 0:
                ctx.set_var(g, _add(_zeros_like(inside), inside))
            else:
                ctx.set_var(g, _add(ctx.scope.find_var(g), inside))
    steps.clear()  # as Paddle: the step scopes die here


# ---------------------------------------------------------------- tensor arrays
# A LOD_TENSOR_ARRAY value is a Python list of LoDTensors, None where nothing was written.
# Like every value it is replaced, never mutated: `write_to_array` binds a new list.


def _index(ctx: OpContext) -> int:
    index = int(ctx.scalar("I"))
    if index < 0:
        raise KernelError(f"{ctx.type}: index {index} is negative")
    return index


def _written_before(ctx: OpContext, name: str) -> bool:
    """Whether an op before this one in its block writes `name` (memoised per op)."""
    key = ("written before", name)
    found = ctx.memo.get(key)
    if found is None:
        block, op = ctx.block, ctx.op
        position = block.index_of(op)
        found = ctx.memo[key] = any(block.index_of(w) < position for w in block.writers(name))
    return found


def _first_write_of_a_run(ctx: OpContext, name: str) -> bool:
    """This op starts the array `name` afresh: its block declares the array and nothing
    before it there writes it. (Paddle's executor drops a run's temporaries; our scope
    keeps them, so without this a run would extend the array the last run left.) In a
    loop body, which does not declare the array, the writes of every step add up."""
    return ctx.block.has_var(name) and not _written_before(ctx, name)


@register("write_to_array")
def write_to_array(ctx: OpContext) -> None:
    """Out[I] = X, the array growing as needed (Paddle's `array_write`)."""
    index = _index(ctx)
    (name,) = ctx.output_names("Out")
    old = None if _first_write_of_a_run(ctx, name) else ctx.scope.find_var(name)
    array = list(old) if isinstance(old, list) else []
    array.extend([None] * (index + 1 - len(array)))
    array[index] = ctx.value("X")
    ctx.set_output("Out", array)


@register("read_from_array")
def read_from_array(ctx: OpContext) -> None:
    """Out = X[I] (Paddle's `array_read`). As the grad of `write_to_array` (`X_W` given), an
    entry nothing wrote is the zero grad, shaped like the written tensor `X_W`."""
    index = _index(ctx)
    array = ctx.value("X")
    if not isinstance(array, list):
        raise KernelError(f"read_from_array: X holds a {type(array).__name__}, not a tensor array")
    entry = array[index] if index < len(array) else None
    if entry is None:
        if not ctx.has_input("X_W"):
            raise KernelError(f"read_from_array: nothing was written at index {index} (the array has {len(array)})")
        entry = _zeros_like(ctx.value("X_W"))
    ctx.set_output("Out", entry)


def sum_arrays(arrays: list[list]) -> list:
    """Element-wise sum of tensor arrays (what `sum` does with them): entries nothing wrote
    are skipped, as Paddle's `sum` skips uninitialised ones."""
    out: list = [None] * max(len(a) for a in arrays)
    for array in arrays:
        for i, entry in enumerate(array):
            if entry is None:
                continue
            out[i] = entry if out[i] is None else _add(out[i], entry)
    return out


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

