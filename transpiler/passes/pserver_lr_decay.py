"""Pass: start one main program per pserver, with its lr-decay block.

Each pserver's program starts empty (block 0 gets its vars as later passes declare them,
and `listen_and_serv` last, from pserver_serve). When the original computes its learning
rate, an lr-decay block (a child of block 0) gets copies of the lr ops, whose sub-blocks
(`conditional_block` bodies) are copied recursively as new blocks; it is the first
optimize block and `lr_decay_block_id`, so the pserver runs it before the param blocks.
"""

from __future__ import annotations

from dataclasses import replace

from transpiler.config import TranspileOptions
from transpiler.ir import AttrType, Block, Op, Program
from transpiler.ir.types import EMPTY_VAR_NAME
from transpiler.passes.bundle import Bundle, PserverPrograms
from transpiler.passes.contract import Pass
from transpiler.passes.pserver_vars import declare


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    pservers = {}
    for endpoint in options.endpoints:
        program = Program.empty()
        program.version = bundle.origin.version
        if bundle.origin.op_version_map is not None:
            program.op_version_map = dict(bundle.origin.op_version_map)
        progs = PserverPrograms(main=program)
        if bundle.analysis.lr_ops:
            _LrBlockCopier(bundle.origin, progs).copy(bundle.analysis.lr_ops)
        pservers[endpoint] = progs
    return replace(bundle, pservers=pservers)


class _LrBlockCopier:
    def __init__(self, origin: Program, progs: PserverPrograms) -> None:
        self.origin = origin
        self.progs = progs
        self.program = progs.main

    def copy(self, lr_ops: list[Op]) -> None:
        block = self.program.create_block(0)
        for op in lr_ops:
            self._copy_op(op, self.origin.global_block(), block)
        self.progs.lr_block = block.idx
        self.progs.optimize_blocks.append(block.idx)

    def _copy_op(self, op: Op, source_block: Block, target: Block) -> None:
        """Copy `op` into `target`, declaring the globals it uses and copying its sub-blocks."""
        new = op.clone()
        for name in (*op.input_names, *op.output_names):
            if name == EMPTY_VAR_NAME or target.find_var(name) is not None:
                continue
            if source_block.has_var(name) and source_block.idx != 0:
                target.add_var(source_block.var(name).copy())
            else:
                declare(self.progs, self.origin, name)
        for attr_name, attr in op.attrs.items():
            if attr.type == AttrType.BLOCK:
                new.set_attr(attr_name, self._copy_sub_block(attr.value, target))
            elif attr.type == AttrType.BLOCKS:
                new.set_attr(attr_name, [self._copy_sub_block(i, target) for i in attr.value])
        target.add_op(new)

    def _copy_sub_block(self, origin_idx: int, parent: Block) -> int:
        source = self.origin.block(origin_idx)
        copy = self.program.create_block(parent.idx)
        for var in source.vars.values():
            copy.add_var(var.copy())
        for op in source.ops:
            self._copy_op(op, source, copy)
        return copy.idx


PASS = Pass("pserver_lr_decay", run, requires=("origin", "analysis"), produces=("pservers",))
