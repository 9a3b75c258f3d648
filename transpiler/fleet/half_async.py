"""Half-async for `fleet` (`StrategyFactory.create_half_async_strategy()`), built from the
sync transpile's programs, with no pserver protocol of its own.

Fluid's half-async trainers send their grads without averaging them with each other's and
meet at a barrier once per step, so that every trainer receives the same params. Here the
trainers run the sync trainer program (send, barrier, receive), and each pserver optimize
block, instead of `sum` → `scale 1/N` → the rest once (sync: one step on the mean grad),
runs the rest once per trainer on that trainer's grad, in trainer order — as if the grads
had arrived in that order and each had been applied on arrival. "The rest" is the
optimizer, preceded by what the transpiler put on the pserver before it: element-wise
regularization (L2 / L1 decay: `scale` of the param, `sign`, `sum` into the grad) and
per-param clipping (`clip`, `clip_by_norm`), each rerun on the param as the previous
trainer's step left it. The same holds for SelectedRows grads (`is_sparse` embeddings:
each trainer's rows get their own step) and for the distributed lookup table's optimize
block (its `sum` → `scale` → `sgd` over the table shard). With SGD, N trainers at learning
rate `lr` thus equal sync training at `N * lr`; with one trainer, half-async is sync
training.

Refused (`NotImplementedError`): anything that needs all trainers' grads at once — global
norm clipping and LARS norms (`squared_l2_norm` → `pserver_allreduce_sum` across blocks),
ops outside the element-wise set above.
"""

from __future__ import annotations

from transpiler.ir import Program

# Ops the transpiler puts between `scale 1/N` and the optimizer that act on one grad and
# its own param, so that they can run once per trainer's grad.
ELEMENTWISE = frozenset({"scale", "sum", "sign", "clip", "elementwise_add", "elementwise_sub", "elementwise_mul",
                         "clip_by_norm"})
# Inputs that carry a norm summed over every pserver's slices of all trainers' grads.
CROSS_BLOCK_INPUTS = ("SquaredNorm", "SquaredNorms")


def _refuse(block, ops, why: str):
    raise NotImplementedError(
        f"HalfAsyncStrategy: pserver optimize block {block.idx} is {[op.type for op in ops]}: {why}; "
        "half-async supports sum → scale → [element-wise regularization / per-param clipping] → optimizer")


def _per_trainer_ops(block, ops, merged: str):
    """The ops after `sum` → `scale` as (type, inputs, outputs, attrs), checked to act on one
    trainer's grad alone."""
    rest = ops[2:]
    optimizers = [op for op in rest if "Grad" in op.inputs and op.output("ParamOut")]
    if not optimizers:
        _refuse(block, ops, "no optimizer op after the averaging")
    for op in rest:
        if op in optimizers:
            continue
        if op.type not in ELEMENTWISE:
            _refuse(block, ops, f"`{op.type}` is not an element-wise op on one grad")
    for op in rest:
        for slot in CROSS_BLOCK_INPUTS:
            if op.inputs.get(slot):
                _refuse(block, ops, f"`{op.type}` reads {slot}, a norm over all trainers' grads")
    return [(op.type, dict(op.inputs), dict(op.outputs), op.attr_values()) for op in rest]


def _renamed(slots: dict, old: str, new: str) -> dict:
    return {slot: [new if name == old else name for name in names] for slot, names in slots.items()}


def pserver_program(main: Program) -> Program:
    """Rewrite the sync pserver `main`'s optimize blocks in place (see the module docstring);
    `NotImplementedError` for a block that needs all trainers' grads at once."""
    (serve,) = [op for op in main.global_block().ops if op.type == "listen_and_serv"]
    blocks = serve.blocks_attr("optimize_blocks")
    for block in blocks:  # check every block before rewriting any
        ops = list(block.ops)
        if any(op.type == "pserver_allreduce_sum" for op in ops):
            _refuse(block, ops, "`pserver_allreduce_sum` sums a norm over all trainers' grads")
    for block in blocks:
        ops = list(block.ops)
        if not ops or ops[0].type != "sum":
            continue  # one trainer: nothing is averaged
        merged = ops[0].output("Out")[0]
        per_trainer = list(ops[0].input("X"))
        if len(ops) < 3 or ops[1].type != "scale" or ops[1].input("X") != (merged,) or ops[1].output("Out") != (
                merged,):
            _refuse(block, ops, "not `sum` → `scale` over the trainers' grads")
        rest = _per_trainer_ops(block, ops, merged)
        block.remove_ops(ops[1:])  # the `sum` stays: the pserver reads from it which grads each trainer sends
        for grad in per_trainer:
            for op_type, inputs, outputs, attrs in rest:
                block.add_op(op_type, _renamed(inputs, merged, grad), _renamed(outputs, merged, grad), attrs)
    return main
