"""Pass: one startup program per pserver.

It declares the pserver's vars and keeps, in the original startup's order, the
initializers of the vars this pserver holds: an initializer of a cut param (or of state
cut like it) is copied once per block with its `shape` attr set to the block's shape.
A fixed non-zero `seed` is offset by the block index, so the blocks of one param do not
start as copies of each other.

A startup op that writes several params at once is cut into what it does to each
(`PER_PARAM`): `coalesce_tensor` (an RNN's weights packed into one buffer) copies each
input to itself (`copy_data`), so the params keep what their own initializers wrote and
the op is dropped, or sets them to a constant (`set_constant`), a `fill_constant` per
param block. Its fused buffer is nobody's param to place: it stays on the trainer. Paddle 1.8's `get_startup_program` sets those shapes with
`op._set_attr` on the trainer's own startup ops (`distribute_transpiler.py`); here the
original is never touched.
"""

from __future__ import annotations

from dataclasses import replace

from ops.catalogue import make_op
from transpiler.config import TranspileOptions
from transpiler.errors import TranspileError
from transpiler.ir import Attr, Op, OpRole, Program
from transpiler.ir.attrs import sound_on_its_own
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
    shared = _Shared(bundle.origin_startup)
    pservers = {}
    for endpoint, progs in bundle.pservers.items():
        startup = _startup_for(initializers, writers, progs.main, progs.instances, shared)
        pservers[endpoint] = replace(progs, startup=startup)
    return replace(bundle, pservers=pservers)


class _Shared:
    """What the pservers' startups have in common, worked out at the first that needs it:
    per initializer of one var, its output slot and the var's whole shape; and the typed
    `shape` / `seed` attrs of the blocks (immutable, so every op setting the same value
    shares one, with whether it is sound on its own)."""

    def __init__(self, origin_startup: Program) -> None:
        self.origin_vars = origin_startup.global_block()
        self.outputs: dict[int, tuple[str, tuple[int, ...] | None]] = {}
        self.attrs: dict[tuple, tuple[Attr, bool]] = {}

    def output(self, position: int, op: Op, origin_name: str) -> tuple[str, tuple[int, ...] | None]:
        found = self.outputs.get(position)
        if found is None:
            origin_var = self.origin_vars.find_var(origin_name)
            whole = tuple(origin_var.shape) if origin_var is not None and origin_var.shape is not None else None
            slot = next(slot for slot, args in op.outputs.items() if origin_name in args)
            found = self.outputs[position] = (slot, whole)
        return found

    def attr(self, op: Op, name: str, value) -> tuple[Attr, bool]:
        """`value` typed as `clone(attrs=...)` types it (the type the attr has), and whether it is sound."""
        attr_type = op.attr_type(name)
        key = (name, attr_type, value)
        found = self.attrs.get(key)
        if found is None:
            attr = Attr.of(list(value) if isinstance(value, tuple) else value, attr_type)
            found = self.attrs[key] = (attr, sound_on_its_own(name, attr))
        return found


def _startup_for(initializers: list[tuple[Op, list[str]]], writers: dict[str, list[int]], main: Program,
                 instances: dict[str, dict[tuple[str, int], None]], shared: _Shared) -> Program:
    startup = Program.empty()
    startup.version = main.version
    startup.op_version_map = None if main.op_version_map is None else dict(main.op_version_map)
    block = startup.global_block()
    block.add_vars([var.copy() for var in main.global_block().vars.values()])
    positions = sorted({position for name in instances for position in writers.get(name, ())})  # original order
    ops: list[Op] = []  # added at once (`Block.add_ops`): hundreds of initializers per pserver
    for position in positions:
        op, outputs = initializers[position]
        targets = [name for out in outputs for name in instances.get(out, ())]
        if not targets:
            continue
        if len(outputs) != 1:
            if all(list(instances.get(out, ())) == [(out, 0)] for out in outputs):
                ops.append(op.clone())
                continue
            cut = PER_PARAM.get(op.type)
            if cut is None:
                raise TranspileError(
                    f"startup op {op.type!r} writes several vars {outputs}; cannot place it per block "
                    f"(ops cut per param: {', '.join(PER_PARAM)})"
                )
            ops.extend(cut(op, targets, block))
            continue
        (origin_name,) = outputs
        slot, whole = shared.output(position, op, origin_name)
        for target, index in targets:
            ops.append(_initializer_for(op, origin_name, slot, whole, block.var(target), index, shared))
    block.add_ops(ops)
    return startup


def _coalesce_tensor_per_param(op: Op, targets: list[tuple[str, int]], block) -> list[Op]:
    """`coalesce_tensor` for the param blocks `targets` of this pserver: nothing with
    `copy_data` (each param keeps its value), else a `fill_constant` of `constant` (or 0:
    Paddle leaves the memory uninitialised, zeros are one of its values) per block."""
    if op.attr("copy_data", False) and not op.attr("set_constant", False):
        return []
    value = float(op.attr("constant", 0.0)) if op.attr("set_constant", False) else 0.0
    fills = []
    for target, _ in targets:
        var = block.var(target)
        if var.shape is None or var.dtype is None:
            raise TranspileError(f"cannot initialise {target!r} apart from its coalesce_tensor: no shape or dtype")
        fills.append(make_op("fill_constant", {}, {"Out": [target]},
                             {"shape": [int(d) for d in var.shape], "dtype": int(var.dtype), "value": value},
                             role=OpRole.Forward))
    return fills


# Startup ops that write several params, and how each is cut into per-param-block ops.
PER_PARAM = {"coalesce_tensor": _coalesce_tensor_per_param}


def _initializer_for(op: Op, origin_name: str, slot: str, whole: tuple[int, ...] | None, target, index: int,
                     shared: _Shared) -> Op:
    """The initializer `op` of `origin_name` (in output `slot`, whole shape `whole`) made to
    write block `index`, `target`: `clone(outputs=..., attrs=...)` with the values typed
    here (`Op._derived`)."""
    args = op.output(slot)
    name = target.name
    outputs = {slot: (name,) if len(args) == 1 else tuple([name if a == origin_name else a for a in args])}
    if target.shape is None or whole is None or tuple(target.shape) == whole:
        return op._derived(outputs=outputs)
    if op.type not in SHAPED_INITIALIZERS or not op.has_attr("shape"):
        raise TranspileError(
            f"cannot initialise block {name!r} of {origin_name!r}: its initializer {op.type!r} "
            f"has no shape attr to cut (known: {', '.join(SHAPED_INITIALIZERS)})"
        )
    shape, sound = shared.attr(op, "shape", tuple(target.shape))
    changed = {"shape": shape}
    seed = op.attr("seed", 0)
    if seed:
        changed["seed"], seed_sound = shared.attr(op, "seed", seed + index)
        sound = sound and seed_sound
    return op._derived(outputs=outputs, attrs=changed, sound=sound)


PASS = Pass("pserver_startup", run, requires=("origin_startup", "pservers"), produces=("pservers.startup",))
