"""Pass: a global-norm gradient clip computed exactly across the pservers (`clip_mode="exact"`).

keep_clip_on_trainer took the clip out of the program (`Bundle.norm_groups`, one per
group): the trainers send unclipped grads. Each pserver gets one more optimize block, run
first in every sync round (`optimize_blocks[0]`), which, group after group,

1. averages the trainers' grads of the group's blocks placed here (the `sum` / `scale` the
   param blocks started with move here),
2. sums their squares: `squared_l2_norm` per grad block, `sum` into the partial
   `<group>@PARTIAL` (a `fill_constant` 0 on a pserver holding none of them),
3. `pserver_allreduce_sum`: sends the partial to every other pserver and adds all of them,
   in pserver order (the same bits on every pserver), into `<group>@SQUARED`
   (`ops/rpc/reduce.py`: authenticated like every RPC; a peer that does not answer fails
   the step with its name, within the RPC timeout),
4. scales its grad blocks as Paddle's ClipGradByGlobalNorm does: `sqrt`, `clip_norm /
   max(clip_norm, norm)`, `elementwise_mul` in place.

The param blocks then run L2 decay and the optimizer on the clipped average, as local
training does on the clipped grad. The names in the block are the group's
(`clip_global_norm_<i>@...`); the dump shows the whole reduction.

The same block serves a LARS or LAMB param cut into blocks (sync mode, with only
element-wise ops ahead of its optimizer: slice_vars cuts it then): the pservers holding its
blocks average their grad blocks, run those ops here (L2 decay's `scale` + `sum`), compute [|p block|^2, |g block|^2] (LARS: `squared_l2_norm`s, `concat`)
or [|p block|^2, |r block|^2] (LAMB: `lamb_squared_norms`, r its update direction) of what
the optimizer reads, and sum them among themselves (`pserver_allreduce_sum` over those pservers,
`<param>@LARS_NORMS` / `@LAMB_NORMS`); each block's optimizer reads the sums through its
`SquaredNorms` input, so its local lr / trust ratio is the whole param's. And a sliced param
whose `clip_by_norm` runs on the pservers (`clip_mode="exact"`): its holders sum |g block|^2
of the averaged grad, `clip_by_norm` reads the sum (`SquaredNorm`).
"""

from __future__ import annotations

from itertools import takewhile

from ops.catalogue import make_op
from transpiler.config import TranspileOptions
from transpiler.errors import TranspileError
from transpiler.ir import Block, Op, OpRole, VarKind
from transpiler.passes.bundle import Bundle, NormGroup, PserverPrograms
from transpiler.passes.contract import Pass

ALLREDUCE_OP = "pserver_allreduce_sum"


def group_prefix(index: int) -> str:
    return f"clip_global_norm_{index}"


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    normed = [param for param in bundle.plan.params
              if param.optimizer in NORM_OPTIMIZERS and param.sliced] if options.sync_mode else []
    chains = {chain.param: chain for chain in bundle.analysis.chains}
    clipped = [param for param in bundle.plan.params  # clip_by_norm on the pserver (clip_mode="exact")
               if param.sliced and param.param in chains
               and any(op.type == "clip_by_norm" for op in chains[param.param].ops)]
    if not bundle.norm_groups and not normed and not clipped:
        return bundle
    if not options.sync_mode:  # make_options refuses it first; a pipeline run by hand might not
        raise TranspileError("a global-norm clip on the pservers needs sync mode")
    placed_on = bundle.plan.by_endpoint()
    endpoints = list(options.endpoints)
    origin = bundle.origin.global_block()
    for endpoint, progs in bundle.pservers.items():
        reduce = progs.main.create_block(progs.optimize_parent)
        progs.optimize_blocks.insert(0, reduce.idx)
        block_of = dict(progs.grad_to_block)
        for index, group in enumerate(bundle.norm_groups):
            in_group = {param for param, _ in group.grads}
            merged = [param.grad_block_name(var_block.index) for param, var_block in placed_on.get(endpoint, [])
                      if param.param in in_group]
            dtype = origin.find_var(group.grads[0][1]).dtype
            for name in merged:
                _move_average(progs.main.block(block_of[name]), reduce, name)
            _reduce_ops(progs, reduce, group_prefix(index), group, merged, dtype, endpoints, endpoint)
        for param in clipped:
            here = [vb for plan_param, vb in placed_on.get(endpoint, []) if plan_param is param]
            if here:
                _clip_norm(progs, reduce, param, here, block_of, origin.find_var(param.param).dtype, endpoint)
        for param in normed:
            here = [vb for plan_param, vb in placed_on.get(endpoint, []) if plan_param is param]
            if here:
                _param_norms(progs, reduce, param, here, block_of, origin.find_var(param.param).dtype, endpoint)
    return bundle


def _clip_norm(progs: PserverPrograms, reduce: Block, param, here, block_of: dict[str, int], dtype,
               endpoint: str) -> None:
    """A sliced param clipped by its norm on the pservers: they sum |g block|^2 of the
    averaged grad among the holders, and each block's `clip_by_norm` reads the sum."""
    main = progs.main.global_block()
    holders = list(dict.fromkeys(param.endpoints))

    def var(name: str) -> str:
        if not main.has_var(name):
            main.create_var(name, VarKind.LOD_TENSOR, dtype=dtype, shape=(1,))
        return name

    squares, clips = [], []
    for vb in here:
        grad = param.grad_block_name(vb.index)
        block = progs.main.block(block_of[grad])
        _move_average(block, reduce, grad)
        clip = next(op for op in block.ops if op.type == "clip_by_norm")
        clips.append(clip)
        squares.append(var(f"{grad}@CLIP_SQUARE"))
        reduce.add_op(make_op("squared_l2_norm", {"X": list(clip.input("X"))}, {"Out": [squares[-1]]},
                              role=OpRole.Optimize))
    partial, total = squares[0], var(f"{param.grad}@CLIP_SQUARED")
    if len(squares) > 1:
        partial = var(f"{param.grad}@CLIP_SQUARE@{endpoint}")
        reduce.add_op(make_op("sum", {"X": squares}, {"Out": [partial]}, role=OpRole.Optimize))
    reduce.add_op(make_op(ALLREDUCE_OP, {"X": [partial]}, {"Out": [total]}, {"endpoints": holders, "endpoint": endpoint},
                          role=OpRole.Optimize))
    for clip in clips:
        clip.set_input("SquaredNorm", [total])


NORM_OPTIMIZERS = ("lars_momentum", "lamb")  # their update reads the whole param's norms


def _param_norms(progs: PserverPrograms, reduce: Block, param, here, block_of: dict[str, int], dtype,
                 endpoint: str) -> None:
    """A sliced LARS / LAMB param: the pservers holding its blocks sum [|p|^2, |g|^2]
    (LARS) or [|p|^2, |r|^2] (LAMB, `lamb_squared_norms`: r its update direction) of them,
    after averaging the grads, and each block's optimizer reads the sums (`SquaredNorms`)."""
    main = progs.main.global_block()
    holders = list(dict.fromkeys(param.endpoints))  # in block order: every holder sums alike

    def var(name: str, shape=(1,)) -> str:
        if not main.has_var(name):
            main.create_var(name, VarKind.LOD_TENSOR, dtype=dtype, shape=shape)
        return name

    def add(op_type: str, inputs: dict, outputs: dict, attrs: dict | None = None) -> None:
        reduce.add_op(make_op(op_type, inputs, outputs, attrs or {}, role=OpRole.Optimize))

    prefix = f"{param.param}@{'LARS' if param.optimizer == 'lars_momentum' else 'LAMB'}_NORMS"
    partials, optimizers = [], []
    for vb in here:
        grad = param.grad_block_name(vb.index)
        block = progs.main.block(block_of[grad])
        _move_average(block, reduce, grad)
        optimizer = next(op for op in block.ops if op.type == param.optimizer)
        # L2 decay ahead of the optimizer (element-wise, slice_vars' ELEMENTWISE_BEFORE_NORM):
        # run here first, so the norms are of the grad it reads
        ahead = list(takewhile(lambda op: op is not optimizer, block.ops))
        for op in ahead:
            block.remove_op(op)
        reduce.add_ops(ahead)
        optimizers.append(optimizer)
        partials.append(var(f"{prefix}@{vb.name}", (2,)))
        if param.optimizer == "lamb":
            slots = ("Param", "Grad", "Moment1", "Moment2", "Beta1Pow", "Beta2Pow")
            attrs = {name: optimizer.attr(name) for name in ("weight_decay", "beta1", "beta2", "epsilon")}
            add("lamb_squared_norms", {slot: list(optimizer.input(slot)) for slot in slots}, {"Out": [partials[-1]]},
                attrs)
        else:
            p_square, g_square = var(f"{vb.name}@SQUARE"), var(f"{grad}@SQUARE")
            add("squared_l2_norm", {"X": [vb.name]}, {"Out": [p_square]})
            add("squared_l2_norm", {"X": list(optimizer.input("Grad"))}, {"Out": [g_square]})
            add("concat", {"X": [p_square, g_square]}, {"Out": [partials[-1]]}, {"axis": 0})
    partial, total = partials[0], var(prefix, (2,))
    if len(partials) > 1:  # two blocks of it here (hash placement): added first
        partial = var(f"{prefix}@PARTIAL", (2,))
        add("sum", {"X": partials}, {"Out": [partial]})
    add(ALLREDUCE_OP, {"X": [partial]}, {"Out": [total]}, {"endpoints": holders, "endpoint": endpoint})
    for optimizer in optimizers:
        optimizer.set_input("SquaredNorms", [total])


def _move_average(block: Block, reduce: Block, grad: str) -> None:
    """The `sum` / `scale` that open a param block and write `grad`: moved into `reduce`."""
    moved: list[Op] = []
    for op in block.ops:
        if op.type in ("sum", "scale") and grad in op.output_names:
            moved.append(op)
        else:
            break
    for op in moved:
        block.remove_op(op)
    reduce.add_ops(moved)


def _reduce_ops(progs: PserverPrograms, reduce: Block, prefix: str, group: NormGroup, grads: list[str], dtype,
                endpoints: list[str], endpoint: str) -> None:
    main = progs.main.global_block()

    def var(suffix: str) -> str:
        name = f"{prefix}@{suffix}"
        if not main.has_var(name):
            main.create_var(name, VarKind.LOD_TENSOR, dtype=dtype, shape=(1,))
        return name

    def add(op_type: str, inputs: dict, outputs: dict, attrs: dict | None = None) -> None:
        reduce.add_op(make_op(op_type, inputs, outputs, attrs or {}, role=OpRole.Optimize))

    squares = []
    for i, grad in enumerate(grads):
        squares.append(var(f"SQUARE{i}"))
        add("squared_l2_norm", {"X": [grad]}, {"Out": [squares[-1]]})
    partial = var("PARTIAL")
    if squares:
        add("sum", {"X": squares}, {"Out": [partial]})
    else:
        add("fill_constant", {}, {"Out": [partial]}, {"shape": [1], "dtype": int(dtype), "value": 0.0})
    total = var("SQUARED")
    add(ALLREDUCE_OP, {"X": [partial]}, {"Out": [total]}, {"endpoints": endpoints, "endpoint": endpoint})
    if not grads:
        return
    norm, clip, bound, factor = var("NORM"), var("CLIP_NORM"), var("MAX"), var("FACTOR")
    add("sqrt", {"X": [total]}, {"Out": [norm]})
    add("fill_constant", {}, {"Out": [clip]},
        {"shape": [1], "dtype": int(dtype), "value": group.clip_norm, "str_value": repr(group.clip_norm)})
    add("elementwise_max", {"X": [clip], "Y": [norm]}, {"Out": [bound]})
    add("elementwise_div", {"X": [clip], "Y": [bound]}, {"Out": [factor]})
    for grad in grads:
        add("elementwise_mul", {"X": [grad], "Y": [factor]}, {"Out": [grad]})


PASS = Pass("pserver_norm_reduce", run, requires=("plan", "pservers"), produces=("pservers",))
