"""Pass: the trainer starts as a copy of the original without its optimize and lr-decay ops.

Those ops run on the pservers. The sub-blocks only they reached (lr decay's
`conditional_block` bodies) go too: Paddle leaves them behind as orphan blocks that
nothing can run. The vars only they used go at the end of the trainer passes
(drop_unused_vars), once the sends and recvs that may still use them are in place.

The copy's map from original ops to trainer ops (`bundle.trainer_ops`) is how the
trainer passes that follow find the ops the analysis names.
"""

from __future__ import annotations

from dataclasses import replace

from transpiler.config import TranspileOptions
from transpiler.ir import Op, Program
from transpiler.passes.bundle import Bundle
from transpiler.passes.contract import Pass


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    analysis = bundle.analysis
    trainer, copies = bundle.origin.clone_with_map()
    moved = [copies.op(op) for op in (*analysis.optimize_ops, *analysis.lr_ops)]
    orphan_blocks = _sub_blocks_of(trainer, moved)
    trainer.global_block().remove_ops(moved)
    if orphan_blocks:  # reachability walks every op: only worth it when the moved ops had sub-blocks
        trainer.drop_blocks(sorted(orphan_blocks - set(trainer.reachable_blocks())))
    return replace(bundle, trainer=trainer, trainer_ops=copies)


def _sub_blocks_of(program: Program, ops: list[Op]) -> set[int]:
    """Blocks reachable through `ops` (the lr ops' conditional bodies)."""
    found: set[int] = set()
    stack = [i for op in ops for i in op.sub_block_indices()]
    while stack:
        idx = stack.pop()
        if idx in found or not 0 < idx < program.num_blocks:
            continue
        found.add(idx)
        for op in program.block(idx).ops:
            stack.extend(op.sub_block_indices())
    return found


PASS = Pass("drop_optimize", run, requires=("analysis",), produces=("trainer", "trainer_ops"))
