"""`append_backward`: the grad ops of a loss, as Fluid 1.8's `backward.py` appends them.

1. the loss op becomes `op_role = Forward|Loss`; `fill_constant(1.0) → loss@GRAD` seeds
   the pass with `op_role = Backward|Loss`;
2. the ops on the path to the loss, walked in reverse, each give their grad op(s)
   through the catalogue's grad makers (an op the catalogue does not know raises
   `UnknownOpError` naming it); grads of `stop_gradient` vars and of outputs nothing
   downstream reads are not made (`X@GRAD=[]`);
3. a grad written by several ops is renamed per writer, `x@GRAD@RENAME@block0@0`, ...,
   and `sum`med into `x@GRAD` before its first reader (or at the end);
4. grad vars are declared with their forward var's dtype, shape and LoD level
   (SelectedRows where the grad op makes one: a sparse `lookup_table`'s table grad);
5. the last op writing each parameter's grad gets `op_role_var = [param, grad]`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ops import catalogue
from ops.catalogue import GRAD_UNSUPPORTED, GradContext
from ops.catalogue.grad import new_op
from transpiler.errors import UnknownOpError
from transpiler.frontend import unique_name
from transpiler.frontend.errors import BuildError
from transpiler.frontend.framework import (
    FLOAT_DTYPES,
    GRAD_SUFFIX,
    Parameter,
    Program,
    Variable,
    fmt_shape,
)
from transpiler.ir import Attr, AttrType, Block, DType, Op, OpRole, VarKind
from transpiler.ir.types import EMPTY_VAR_NAME, OP_ROLE_ATTR, OP_ROLE_VAR_ATTR

LAYER = "append_backward"


def grad_var_name(name: str) -> str:
    return name + GRAD_SUFFIX


def strip_grad_suffix(name: str) -> str:
    """`x@GRAD@RENAME@block0@1` → `x` (Fluid's `_strip_grad_suffix_`)."""
    pos = name.find(GRAD_SUFFIX)
    return name[:pos] if pos != -1 else name


def _raw_op(op_type: str, inputs: dict[str, list[str]], outputs: dict[str, list[str]], attrs: dict[str, Any]) -> Op:
    """An op as backward's `_create_op_desc_` makes it: only the attrs given, plus
    `op_role` Backward and `op_device` "" when absent."""
    entry = catalogue.require(op_type)
    values = {"op_role": int(OpRole.Backward), "op_device": "", **attrs}
    typed = {name: catalogue.typed_attr(entry, name, value) for name, value in values.items()}
    return new_op(op_type, inputs, outputs, typed)


def _set(op: Op, name: str, value: Any, attr_type: AttrType) -> None:
    op.set_attr(name, Attr.of(value, attr_type))


def _sorted_attrs(op: Op) -> Op:
    ordered = dict(sorted(op.attrs.items()))
    for name in list(op.attrs):
        op.remove_attr(name)
    for name, attr in ordered.items():
        op.set_attr(name, attr)
    return op


# ------------------------------------------------------------------ analysis


def _find_loss_op(block: Block, loss: Variable) -> Op:
    for op in reversed(block.ops):
        if op.output_names == [loss.name]:
            return op
    raise BuildError(LAYER, f"no op of block {block.idx} writes the loss {loss.name!r} as its only output")


def _stop_gradient_grads(program: Program, block: Block) -> set[str]:
    return {
        grad_var_name(name)
        for name in block.vars
        if (handle := program._variables.get((block.idx, name))) is not None and handle.stop_gradient
    }


def _find_op_path(ops: Sequence[Op], loss_name: str, no_grad: set[str]) -> list[Op]:
    """The ops whose outputs reach the loss, in forward order (Fluid's `_find_op_path_`)."""
    wanted = {loss_name}
    relevant = [False] * len(ops)
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        if not any(name in wanted for name in op.output_names):
            continue
        entry = catalogue.get(op.type)
        if entry is None:
            raise UnknownOpError(
                f"{LAYER}: op {i} ({op.type}) feeds the loss, but the op catalogue does not know "
                f"{op.type!r}, so its gradient cannot be built"
            )
        if not entry.differentiable:
            continue
        if entry.grad is GRAD_UNSUPPORTED:
            raise BuildError(LAYER, f"op {i} ({op.type}) feeds the loss; the builder cannot differentiate {op.type}")
        relevant[i] = True
        for name in op.input_names:
            if name not in no_grad:
                wanted.add(name)
    return [op for op, keep in zip(ops, relevant, strict=True) if keep]


def _find_no_grad_vars(program: Program, block: Block, op_path: Sequence[Op], loss_name: str, no_grad: set[str]) -> set[str]:
    """Outputs of path ops that nothing on the way to the loss reads (`XShape`, `MaxIndex`, ...)."""
    used = {loss_name}
    found: set[str] = set()
    for op in reversed(op_path):
        inputs = set(op.input_names)
        for out in op.output_names:
            handle = program._variables.get((block.idx, out))
            stop = handle.stop_gradient if handle is not None else False
            if out not in used and out not in inputs and not stop:
                found.add(out)
        for name in op.input_names:
            if name not in no_grad:
                used.add(name)
    return found


# ------------------------------------------------------------------ grad ops


def _grad_ops(op_path: Sequence[Op], no_grad: set[str]) -> tuple[list[Op], dict[str, str]]:
    grad_ops: list[Op] = []
    grad_to_var: dict[str, str] = {}
    for op in reversed(op_path):
        entry = catalogue.require(op.type)
        ctx = GradContext(op, no_grad)
        made = entry.grad(ctx)  # type: ignore[misc]
        if op.has_attr("op_device"):
            for grad_op in made:
                _set(grad_op, "op_device", op.attr("op_device"), AttrType.STRING)
        grad_ops.extend(made)
        grad_to_var.update(ctx.grad_to_var)
    return grad_ops, grad_to_var


def _rename_args(ops: Iterable[Op], old: str, new: str) -> None:
    for op in ops:
        op.rename_input(old, new)
        op.rename_output(old, new)


def _sum_op(inputs: list[str], out: str) -> Op:
    return _raw_op("sum", {"X": list(inputs)}, {"Out": [out]}, {"use_mkldnn": False})


def _addup_repetitive_outputs(ops: list[Op], block_idx: int) -> list[Op]:
    """Fluid's `_addup_repetitive_outputs_`: one writer per grad, via renames and `sum`."""
    pending: list[tuple[Op, int]] = []
    rename_count: dict[str, int] = {}
    renamed: dict[str, list[str]] = {}
    start_idx: dict[str, int] = {}

    def fresh(name: str) -> str:
        count = rename_count.get(name, 0)
        rename_count[name] = count + 1
        return f"{name}@RENAME@block{block_idx}@{count}"

    for idx, op in enumerate(ops):
        for name in op.input_names:
            if GRAD_SUFFIX not in name:
                continue
            if len(renamed.setdefault(name, [])) > 1:
                pending.append((_sum_op(renamed[name], name), idx))
                renamed[name] = [name]
        slot_names = list(op.outputs)
        for slot_idx, slot in enumerate(slot_names):
            args = list(op.output(slot))
            for arg_idx, name in enumerate(list(args)):
                if GRAD_SUFFIX not in name or name == EMPTY_VAR_NAME or name in op.input_names:
                    continue
                seen = renamed.setdefault(name, [])
                if not seen:
                    seen.append(name)
                    start_idx[name] = idx
                    continue
                if len(seen) == 1:
                    first = fresh(name)
                    seen[0] = first
                    _rename_args(ops[start_idx[name]:idx], name, first)
                    _rename_args((p for p, _ in pending), name, first)
                    for earlier in slot_names[:slot_idx]:
                        earlier_args = op.output(earlier)
                        if name in earlier_args:
                            op.set_output(earlier, [first if a == name else a for a in earlier_args])
                    args = [first if a == name else a for a in args[:arg_idx]] + args[arg_idx:]
                new = fresh(name)
                args[arg_idx] = new
                op.set_output(slot, args)
                seen.append(new)
    for name, inputs in renamed.items():
        if len(inputs) > 1:
            pending.append((_sum_op(inputs, name), len(ops)))
    for op, pos in reversed(pending):
        ops.insert(pos, op)
    return ops


def _remove_no_grad_branch(ops: list[Op], no_grad: set[str]) -> list[Op]:
    """Drop grad ops that make nothing wanted; zero-fill grads a kept op reads but nobody makes."""

    def all_in(names: list[str]) -> bool:
        return bool(names) and all(n in no_grad for n in names)

    kept = []
    for op in ops:
        outs = op.output_names
        if not outs or all_in(outs):
            continue
        if all_in([n for n in op.input_names if GRAD_SUFFIX in n]):
            no_grad.update(outs)
            continue
        kept.append(op)
    inserts = []
    for idx, op in enumerate(kept):
        for name in op.input_names:
            if GRAD_SUFFIX in name and name in no_grad:
                inserts.append((_raw_op("fill_zeros_like", {"X": [strip_grad_suffix(name)]}, {"Out": [name]}, {}), idx))
    for op, pos in reversed(inserts):
        kept.insert(pos, op)
    return kept


def _rename_existing_grads(block: Block, start: int, grad_to_var: dict[str, str]) -> None:
    """Fluid's `_rename_grad_`: a second backward pass must not overwrite the first's grads."""
    renames: dict[str, str] = {}
    for op in block.ops[start:]:
        for old, new in renames.items():
            op.rename_input(old, new)
        for name in op.output_names:
            if GRAD_SUFFIX in name and block.has_var(name):
                new = unique_name.generate(name)
                op.rename_output(name, new)
                renames[name] = new
    for old, new in renames.items():
        if old in grad_to_var:
            grad_to_var[new] = grad_to_var.pop(old)


def _grad_var_kinds(block: Block, op: Op) -> dict[str, VarKind]:
    entry = catalogue.get(op.type)
    if entry is None or entry.infer_var_kind is None:
        return {}

    def kind_of(name: str) -> VarKind | None:
        var = block.find_var(name)
        return var.kind if var is not None else None

    return dict(entry.infer_var_kind(op, kind_of))


def _append_backward_vars(program: Program, block: Block, start: int, grad_to_var: dict[str, str]) -> dict[str, str]:
    """Declare every new grad var (forward var's dtype, shape, LoD); returns var → its grad."""
    grad_of: dict[str, str] = {}
    for op in block.ops[start:]:
        kinds = _grad_var_kinds(block, op)
        for name in op.output_names:
            if name == EMPTY_VAR_NAME or block.find_var(name) is not None:
                continue
            fwd_name = strip_grad_suffix(name)
            fwd = block.find_var(fwd_name)
            if fwd is None or fwd.dtype is None:
                dtype, shape, lod = DType.FP32, (), 0
            else:
                if fwd.dtype not in FLOAT_DTYPES:
                    raise BuildError(
                        LAYER,
                        f"{op.type} would make {name!r}, the gradient of {fwd_name!r} ({fwd.dtype.short} "
                        f"{fmt_shape(fwd.shape)}): only float vars have gradients; mark {fwd_name!r} "
                        "stop_gradient or keep it off the path to the loss",
                    )
                dtype, shape, lod = fwd.dtype, tuple(fwd.shape or ()), fwd.lod_level
            block.create_var(name, kinds.get(name, VarKind.LOD_TENSOR), dtype, shape, lod_level=lod)
            program._wrap(block, name)
            if name in grad_to_var:
                grad_of[grad_to_var[name]] = name
    return grad_of


# ------------------------------------------------------------------ entry


def append_backward(
    loss: Variable,
    parameter_list: Sequence[Any] | None = None,
    no_grad_set: Iterable[Any] | None = None,
    callbacks: Any = None,
) -> list[tuple[Parameter, Variable]]:
    """Append the backward pass of `loss` to its program; return `(param, grad)` pairs
    for the trainable parameters (or `parameter_list`) that got a gradient."""
    if not isinstance(loss, Variable):
        raise BuildError(LAYER, f"the loss must be a Variable, got {type(loss).__name__}")
    program = loss.program
    if not isinstance(program, Program):
        raise BuildError(LAYER, "the loss must belong to a transpiler.frontend.Program")
    block = program.global_block()
    if loss.block.idx != 0 or program.current_block_idx != 0:
        raise BuildError(LAYER, "backward inside a control-flow block is not supported; build the loss in block 0")
    if loss.dtype not in FLOAT_DTYPES:
        raise BuildError(LAYER, f"the loss {loss.name!r} is {loss.dtype.short} {fmt_shape(loss.shape)}; only a float loss has a gradient")
    if callbacks:
        raise BuildError(LAYER, "callbacks (error clip) are not supported")
    program._appending_grad_times += 1

    loss_op = _find_loss_op(block, loss)
    _set(loss_op, OP_ROLE_ATTR, int(OpRole.Forward | OpRole.Loss), AttrType.INT)

    no_grad = _stop_gradient_grads(program, block)
    for item in no_grad_set or ():
        name = item.name if isinstance(item, Variable) else str(item)
        no_grad.add(grad_var_name(name))
    forward_no_grad = {strip_grad_suffix(n) for n in no_grad}
    forward_ops = list(block.ops)
    op_path = _find_op_path(forward_ops, loss.name, forward_no_grad)
    forward_no_grad |= _find_no_grad_vars(program, block, op_path, loss.name, forward_no_grad)
    no_grad |= {grad_var_name(n) for n in forward_no_grad}

    loss_grad = _raw_op(
        "fill_constant",
        {},
        {"Out": [grad_var_name(loss.name)]},
        {
            "shape": [1],
            "value": 1.0,
            "dtype": int(loss.dtype),
            "force_cpu": False,
            "op_role": int(OpRole.Backward | OpRole.Loss),
            "op_device": loss_op.attr("op_device", ""),
        },
    )
    grad_ops, grad_to_var = _grad_ops(op_path, no_grad)
    grad_ops = _addup_repetitive_outputs(grad_ops, block.idx)
    grad_ops = _remove_no_grad_branch(grad_ops, set(no_grad))

    start = len(block)
    block.add_op(_sorted_attrs(loss_grad))
    for op in grad_ops:
        _set(op, OP_ROLE_ATTR, int(OpRole.Backward), AttrType.INT)
        block.add_op(_sorted_attrs(op))
    _rename_existing_grads(block, start, grad_to_var)
    grad_of = _append_backward_vars(program, block, start, grad_to_var)

    if parameter_list is not None:
        names = [p.name if isinstance(p, Variable) else str(p) for p in parameter_list]
    else:
        names = [p.name for p in program.all_parameters() if p.trainable]
    pairs: list[tuple[Parameter, Variable]] = []
    for name in names:
        grad = grad_of.get(name)
        if grad is None:
            continue
        param = program.variable(name, block)
        pairs.append((param, program.variable(grad, block)))  # type: ignore[arg-type]
    for param, grad in pairs:
        writers = block.writers(grad.name)
        if not writers:
            raise BuildError(LAYER, f"no op writes {grad.name!r}")
        writer = writers[-1]
        role_vars = [param.name, grad.name, *writer.attr(OP_ROLE_VAR_ATTR, ())]
        _set(writer, OP_ROLE_VAR_ATTR, role_vars, AttrType.STRINGS)
        _sorted_attrs(writer)
    return pairs

