"""Pass: drop the trainer's global vars that only the optimize and lr-decay ops used.

It runs after the sends and recvs are in place, since they may use such a var (the async
lr-decay counter a trainer sends is read only by the lr ops that left).
"""

from __future__ import annotations

from transpiler.config import TranspileOptions
from transpiler.passes.bundle import Bundle
from transpiler.passes.contract import Pass


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    analysis, trainer = bundle.analysis, bundle.trainer
    moved = (*analysis.optimize_ops, *analysis.lr_ops)
    touched = {name for op in moved for name in (*op.input_names, *op.output_names)}
    used = set().union(*(block.names_used() for block in trainer.blocks))
    block = trainer.global_block()
    for name in sorted(touched - used):
        if block.has_var(name):
            block.remove_var(name)
    return bundle


PASS = Pass("drop_unused_vars", run, requires=("analysis", "trainer"), produces=("trainer",))
