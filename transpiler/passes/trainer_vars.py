"""Helpers the trainer's main and startup passes share: which params a trainer receives,
the vars it receives them into, the `recv` attrs and the `concat` that joins the blocks."""

from __future__ import annotations

import math

from ops.catalogue import make_op
from transpiler.config import TranspileOptions
from transpiler.ir import Op, OpRole, Program
from transpiler.naming import band_name, flat_name
from transpiler.plan import ParamPlan, Plan


def received_params(plan: Plan) -> list[ParamPlan]:
    """Params the trainer receives whole; prefetched tables are read row by row instead."""
    return [param for param in plan.params if not param.remote_prefetch]


def concat_op(param: ParamPlan) -> Op:
    return make_op("concat", {"X": [b.name for b in param.blocks]}, {"Out": [param.param]}, {"axis": 0}, role=OpRole.Dist)


def concat_ops(program: Program, param: ParamPlan) -> list[Op]:
    """The ops joining a cut param's received blocks: one `concat` (axis 0) of whole-row
    blocks, or for 2-D partitions a `concat` (axis 1) per row band of several column
    ranges (into `<param>.band<j>`, declared here) and then one of the bands (axis 0). A
    rank-3+ param is joined as its `[rows, cols]` matrix (`<param>.flat`), then `reshape2`d."""
    if not param.cuts_columns:
        return [concat_op(param)]
    block = program.global_block()
    whole = block.var(param.param)
    bands = param.bands()
    target, row_shape = param.param, tuple(whole.shape[1:])
    flat = len(param.shape) > 2
    if flat:
        target, row_shape = flat_name(param.param), (math.prod(param.shape[1:]),)
        for name, shape in ((target, (param.shape[0], *row_shape)), (f"{target}@XShape", (0, param.shape[0], *row_shape))):
            if not block.has_var(name):
                copy = whole.copy(name)
                copy.shape, copy.persistable, copy.is_parameter = shape, False, False
                block.add_var(copy)
    ops, band_vars = [], []
    for j, band in enumerate(bands):
        if len(band) == 1:
            band_vars.append(band[0].name)
            continue
        name = band_name(param.param, j) if len(bands) > 1 else target
        if len(bands) > 1 and not block.has_var(name):
            copy = whole.copy(name)
            copy.shape = (band[0].rows, *row_shape)
            copy.persistable = False
            copy.is_parameter = False
            block.add_var(copy)
        ops.append(make_op("concat", {"X": [b.name for b in band]}, {"Out": [name]}, {"axis": 1}, role=OpRole.Dist))
        band_vars.append(name)
    if len(bands) > 1:
        ops.append(make_op("concat", {"X": band_vars}, {"Out": [target]}, {"axis": 0}, role=OpRole.Dist))
    if flat:
        ops.append(make_op("reshape2", {"X": [target]}, {"Out": [param.param], "XShape": [f"{target}@XShape"]},
                           {"shape": list(param.shape)}, role=OpRole.Dist))
    return ops


def declare_param_blocks(program: Program, param: ParamPlan, *, persistable: bool = False) -> list[str]:
    """Declare the param's block vars (once) and return their names."""
    block = program.global_block()
    whole = block.var(param.param)
    for var_block in param.blocks:
        if param.sliced and not block.has_var(var_block.name):
            copy = whole.copy(var_block.name)
            copy.shape = var_block.shape
            copy.persistable = persistable
            copy.is_parameter = False
            block.add_var(copy)
    return [b.name for b in param.blocks]


def recv_outputs(program: Program, param: ParamPlan, options: TranspileOptions) -> list[str]:
    """The vars a `recv` of `param` writes: its blocks when cut, else the param itself
    (also when `recv` splits at run time)."""
    if options.runtime_split_send_recv or not param.sliced:
        return [param.param]
    return declare_param_blocks(program, param)


def recv_attrs(param: ParamPlan, options: TranspileOptions) -> dict:
    attrs = {"epmap": list(param.endpoints), "trainer_id": options.trainer_id}
    if options.runtime_split_send_recv:
        attrs["recv_varnames"] = [b.name for b in param.blocks]
    return attrs
