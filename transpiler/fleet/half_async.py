"""Half-async for `fleet` (`StrategyFactory.create_half_async_strategy()`), built from the
sync transpile's programs, with no pserver protocol of its own.

Fluid's half-async trainers send their grads without averaging them with each other's and
meet at a barrier once per step, so that every trainer receives the same params. Here the
trainers run the sync trainer program (send, barrier, receive), and each pserver optimize
block, instead of `sum` → `scale 1/N` → the optimizer once (sync: one step on the mean
grad), runs the optimizer once per trainer on that trainer's grad, in trainer order — as if
the grads had arrived in that order and each had been applied on arrival. With SGD, N
trainers at learning rate `lr` thus equal sync training at `N * lr`; with one trainer,
half-async is sync training.
"""

from __future__ import annotations

from transpiler.ir import Program


def pserver_program(main: Program) -> Program:
    """Rewrite the sync pserver `main`'s optimize blocks in place (see the module docstring);
    `NotImplementedError` for a block that is not `sum` → `scale` → optimizer ops."""
    (serve,) = [op for op in main.global_block().ops if op.type == "listen_and_serv"]
    for block in serve.blocks_attr("optimize_blocks"):
        ops = list(block.ops)
        if not ops or ops[0].type != "sum":
            continue  # one trainer: nothing is averaged
        merged = ops[0].output("Out")[0]
        per_trainer = list(ops[0].input("X"))
        if len(ops) < 3 or ops[1].type != "scale" or ops[1].input("X") != (merged,) or not all(
                op.input("Grad") == (merged,) for op in ops[2:]):
            raise NotImplementedError(
                f"HalfAsyncStrategy: pserver optimize block {block.idx} is {[op.type for op in ops]}, not "
                "sum → scale → optimizer (sparse grads and pserver-side regularization are not supported)")
        optimizers = [(op.type, dict(op.inputs), dict(op.outputs), op.attr_values()) for op in ops[2:]]
        block.remove_ops(ops[1:])  # the `sum` stays: the pserver reads from it which grads each trainer sends
        for grad in per_trainer:
            for op_type, inputs, outputs, attrs in optimizers:
                block.add_op(op_type, {**inputs, "Grad": [grad]}, outputs, attrs)
    return main
