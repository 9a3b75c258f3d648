"""Pass: one startup program per pserver.

It declares the pserver's vars and keeps, in the original startup's order, the
initializers of the vars this pserver holds: an initializer of a cut param (or of state
cut like it) is copied once per block with its `shape` attr set to the block's shape.
A fixed non-zero `seed` is offset by the block index, so the blocks of one param do not
start as copies of each other. Paddle 1.8's `get_startup_program` sets those shapes with
`op._set_attr` on the trainer's own startup ops (`distribute_transpiler.py`); here the
original is never touched.
"""

from __future__ import annotations

from dataclasses import replace

from transpiler.config import TranspileOptions
from transpiler.errors import TranspileError
from transpiler.ir import Op, Program
from transpiler.passes.bundle import Bundle
from transpiler.passes.contract import Pass

# Initializers whose output shape is their `shape` attr, so a block is made by changing it.
SHAPED_INITIALIZERS = ("fill_constant", "uniform_random", "gaussian_random", "truncated_gaussian_random")


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    # The original initializers, and which of them write each var: listed once for all
    # pservers, each of which then visits only the initializers of the vars it holds.
    initializers = [(op, op.output_names) for op in bundle.origin_startup.global_block().ops]
    writers: dict[str, list[int]] = {}
    for position, (_, outputs) in enumerate(initializers):
        for name in outputs:
            writers.setdefault(name, []).append(position)
    pservers = {}
    for endpoint, progs in bundle.pservers.items():
        startup = _startup_for(bundle, initializers, writers, progs.main, progs.instances)
        pservers[endpoint] = replace(progs, startup=startup)
    return replace(bundle, pservers=pservers)


def _startup_for(bundle: Bundle, initializers: list[tuple[Op, list[str]]], writers: dict[str, list[int]],
                 main: Program, instances: dict[str, dict[tuple[str, int], None]]) -> Program:
    startup = Program.empty()
    startup.version = main.version
    startup.op_version_map = None if main.op_version_map is None else dict(main.op_version_map)
    block = startup.global_block()
    block.add_vars(var.copy() for var in main.global_block().vars.values())
    positions = sorted({position for name in instances for position in writers.get(name, ())})  # original order
    for op, outputs in map(initializers.__getitem__, positions):
        targets = [name for out in outputs for name in instances.get(out, ())]
        if not targets:
            continue
        if len(outputs) != 1:
            if all(list(instances.get(out, ())) == [(out, 0)] for out in outputs):
                block.add_op(op.clone())
                continue
            raise TranspileError(f"startup op {op.type!r} writes several vars {outputs}; cannot place it per block")
        (origin_name,) = outputs
        origin_var = bundle.origin_startup.global_block().find_var(origin_name)
        for target, index in targets:
            block.add_op(_initializer_for(op, origin_name, origin_var, block.var(target), index))
    return startup


def _initializer_for(op: Op, origin_name: str, origin_var, target, index: int) -> Op:
    slot = next(slot for slot, args in op.outputs.items() if origin_name in args)
    outputs = {slot: [target.name if a == origin_name else a for a in op.output(slot)]}
    whole = tuple(origin_var.shape) if origin_var is not None and origin_var.shape is not None else None
    if target.shape is None or whole is None or tuple(target.shape) == whole:
        return op.clone(outputs=outputs)
    if op.type not in SHAPED_INITIALIZERS or not op.has_attr("shape"):
        raise TranspileError(
            f"cannot initialise block {target.name!r} of {origin_name!r}: its initializer {op.type!r} "
            f"has no shape attr to cut (known: {', '.join(SHAPED_INITIALIZERS)})"
        )
    attrs = {"shape": list(target.shape)}
    seed = op.attr("seed", 0)
    if seed:
        attrs["seed"] = seed + index
    return op.clone(outputs=outputs, attrs=attrs)


PASS = Pass("pserver_startup", run, requires=("origin_startup", "pservers"), produces=("pservers.startup",))
