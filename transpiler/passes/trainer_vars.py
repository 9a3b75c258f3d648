"""Helpers the trainer's main and startup passes share: which params a trainer receives,
the vars it receives them into, the `recv` attrs and the `concat` that joins the blocks."""

from __future__ import annotations

from ops.catalogue import make_op
from transpiler.config import TranspileOptions
from transpiler.ir import Op, OpRole, Program
from transpiler.plan import ParamPlan, Plan


def received_params(plan: Plan) -> list[ParamPlan]:
    """Params the trainer receives whole; prefetched tables are read row by row instead."""
    return [param for param in plan.params if not param.remote_prefetch]


def concat_op(param: ParamPlan) -> Op:
    return make_op("concat", {"X": [b.name for b in param.blocks]}, {"Out": [param.param]}, {"axis": 0}, role=OpRole.Dist)


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
