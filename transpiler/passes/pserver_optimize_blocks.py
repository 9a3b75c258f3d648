"""Pass: one optimize block per param block placed on each pserver.

In sync mode with several trainers: `sum` of the trainers' grads → `scale` by
1/trainers; then the param's other optimize ops (L2 decay, clip) and its optimizer op,
rewritten onto the block: the param and grad become the block vars, accumulators shaped
like the param (`OPTIMIZER_SLOTS`) and param-shaped temporaries are cut to the block's
shape. When one pserver holds two blocks of a param (possible with `HashName`), its
state vars get a `.block<i>` suffix so the blocks do not share moments.

Blocks are children of the lr-decay block when there is one; `grad_to_block_id` lists
them in block order (Paddle's order depends on the hash seed).
"""

from __future__ import annotations

from collections import Counter

from ops.catalogue import make_op
from ops.catalogue.optimizer_ops import OptimizerSlots, is_optimizer, optimizer_slots
from transpiler.config import TranspileOptions
from transpiler.ir import Attr, AttrType, Block, OpRole, Program, VarKind
from transpiler.ir.attrs import sound_on_its_own
from transpiler.ir.types import EMPTY_VAR_NAME, OP_ROLE_VAR_ATTR
from transpiler.naming import block_name
from transpiler.passes.bundle import Bundle, ParamChain, PserverPrograms
from transpiler.passes.contract import Pass
from transpiler.passes.pserver_vars import PserverVars
from transpiler.plan import ParamPlan, Plan, VarBlock


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    chains = {chain.param: chain for chain in bundle.analysis.chains}
    table = bundle.analysis.distributed_table
    if table is not None:
        chains[table.param] = table  # in plan.params when a partitioner cuts it (ParamPlan.distributed)
    placed_on = bundle.plan.by_endpoint()
    kinds: dict[tuple, str] = {}  # `_BlockFiller._map_arg`'s, the same on every pserver
    for endpoint, progs in bundle.pservers.items():
        filler = _BlockFiller(bundle.origin, bundle.plan, progs, kinds)
        placed = placed_on.get(endpoint, [])
        blocks_here = Counter(param.param for param, _ in placed)
        for param, var_block in placed:
            block = progs.main.create_block(progs.optimize_parent)
            shared = blocks_here[param.param] > 1
            merged = param.grad_block_name(var_block.index)
            progs.received.extend(filler.fill(block, chains[param.param], param, var_block, merged, shared))
            if param.distributed:
                _auto_grown(progs.main, block, var_block)
            progs.optimize_blocks.append(block.idx)
            progs.grad_to_block.append((merged, block.idx))
            if param.sparse:
                progs.sparse_grad_to_param.append((merged, var_block.name))
    return bundle


def _auto_grown(program: Program, block: Block, var_block: VarBlock) -> None:
    """A piece of the distributed table is an auto-grown table (SELECTED_ROWS, rows created
    on first touch, `ops.kernels.table_update` updates it), and so is each accumulator cut
    like it (Adam's moments: they follow the piece's rows); scalar state stays whole."""
    globals_ = program.global_block()
    globals_.var(var_block.name).kind = VarKind.SELECTED_ROWS
    for op in block.ops:
        slots = optimizer_slots(op.type) if is_optimizer(op.type) else None
        if slots is None:
            continue
        for slot in slots.sliced:
            for name in op.input(slot):
                if name != EMPTY_VAR_NAME:
                    globals_.var(name).kind = VarKind.SELECTED_ROWS


class _BlockFiller:
    def __init__(self, origin: Program, plan: Plan, progs: PserverPrograms, kinds: dict[tuple, str]) -> None:
        self.origin = origin
        self.plan = plan
        self.progs = progs
        self.vars = PserverVars(progs, origin)
        self.kinds = kinds
        self.per_trainer_grads = plan.per_trainer_grads
        self.plain: set[str] = set()  # the plain vars declared here (`_map_arg`)
        # The `sum` and `scale` that start every block in sync mode differ only in their vars:
        # built (and checked against the catalogue) once, copied with the block's vars.
        self.sum = make_op("sum", {"X": []}, {"Out": []}, role=OpRole.Optimize)
        self.scale = make_op("scale", {"X": []}, {"Out": []}, {"scale": 1.0 / plan.trainers}, role=OpRole.Optimize)

    def fill(self, block: Block, chain: ParamChain, param: ParamPlan, var_block: VarBlock, merged: str,
             shared: bool) -> list[str]:
        """Fill one optimize block; return the grad vars `listen_and_serv` receives for it.
        `merged`: the block's grad; `shared`: another block of the param is on this pserver too."""
        plan, index, shape = self.plan, var_block.index, var_block.shape
        declare = self.vars.declare
        declare(param.param, var_block.name, shape, True, index)
        declare(param.grad, merged, shape, True, index)
        mapping = {param.param: var_block.name, param.grad: merged}
        # The block's ops share their one-name slot tuples and their op_role_var (immutable):
        # fewer objects to build, and for the GC to scan once the transpile ends.
        singles = {merged: (merged,), var_block.name: (var_block.name,)}
        # `clone(inputs=...)` with the values typed here (`Op._derived`), one block at a time.
        # A STRINGS op_role_var is sound on its own.
        role_vars = {OP_ROLE_VAR_ATTR: Attr(AttrType.STRINGS, (var_block.name, merged))}
        ops = []
        if self.per_trainer_grads:
            received = plan.trainer_grad_names(param, index)
            for name in received:
                declare(param.grad, name, shape, False, index)
            out = {"Out": singles[merged]}
            ops.append(self.sum._derived({"X": tuple(received)}, out, role_vars, sound=True))
            ops.append(self.scale._derived({"X": singles[merged]}, out, role_vars, sound=True))
        else:
            received = [merged]

        for op in chain.ops:
            slots = optimizer_slots(op.type) if op is chain.optimizer else None
            inputs = self._mapped(op.inputs, "inputs", slots, param, var_block, shared, mapping, singles)
            outputs = self._mapped(op.outputs, "outputs", slots, param, var_block, shared, mapping, singles)
            names = op.role_vars
            if names:  # typed as `clone(attrs=...)` types it: the type the attr has
                names = tuple([mapping.get(name, name) for name in names])
                attr_type = op.attr_type(OP_ROLE_VAR_ATTR)
                if attr_type is AttrType.STRINGS and names == role_vars[OP_ROLE_VAR_ATTR].value:
                    ops.append(op._derived(inputs, outputs, role_vars, sound=True))
                    continue
                attr = Attr.of(list(names), attr_type)
                ops.append(op._derived(inputs, outputs, {OP_ROLE_VAR_ATTR: attr},
                                       sound=sound_on_its_own(OP_ROLE_VAR_ATTR, attr)))
            else:
                ops.append(op._derived(inputs, outputs))
        block.add_ops(ops)
        return received

    def _mapped(self, op_slots, direction: str, slots: OptimizerSlots | None, param: ParamPlan, var_block: VarBlock,
                shared: bool, mapping: dict[str, str], singles: dict[str, tuple[str]]) -> dict[str, tuple[str, ...]]:
        """The slots whose args change on the block, mapped (`_map_arg` for every arg: it
        declares them); a plain loop, as a block's few slots made comprehensions cost more
        than their work, and an unchanged slot keeps its tuple (a one-name slot, the block's
        tuple for that name, `singles`)."""
        changed = {}
        map_arg = self._map_arg
        for slot, args in op_slots.items():
            if len(args) == 1:
                arg = args[0]
                new = mapping[arg] if arg in mapping else map_arg(arg, slot, slots, direction, param, var_block,
                                                                 shared, mapping)
                if new != arg:
                    single = singles.get(new)
                    if single is None:
                        single = singles[new] = (new,)
                    changed[slot] = single
                continue
            mapped = tuple([mapping[arg] if arg in mapping else
                            map_arg(arg, slot, slots, direction, param, var_block, shared, mapping) for arg in args])
            if mapped != args:
                changed[slot] = mapped
        return changed

    def _map_arg(self, arg: str, slot: str, slots: OptimizerSlots | None, direction: str,
                 param: ParamPlan, var_block: VarBlock, shared: bool, mapping: dict[str, str]) -> str:
        if arg == EMPTY_VAR_NAME:
            return arg
        if arg in mapping:
            return mapping[arg]
        # What the arg is (a state cut like the param, a whole state, a param-shaped temporary,
        # or a plain var) depends on the names and the param's shape only: settled once.
        key = (arg, slot, direction, id(slots), param.sliced and param.shape)
        kind = self.kinds.get(key)
        if kind is None:
            kind = self.kinds[key] = self._kind(arg, slot, slots, direction, param)
        if kind is _PLAIN:
            if arg not in self.plain:  # declaring a plain var again changes nothing: once per pserver
                self.vars.declare(arg)
                self.plain.add(arg)
            return arg
        suffixed = block_name(arg, var_block.index) if shared else arg
        mapping[arg] = self.vars.declare(arg, suffixed, var_block.shape if kind is _CUT else None, None,
                                         var_block.index)
        return mapping[arg]

    def _kind(self, arg: str, slot: str, slots: OptimizerSlots | None, direction: str, param: ParamPlan) -> str:
        if slots is not None:
            state_slot = slot if direction == "inputs" else _input_of_output(slots, slot)
            if state_slot in slots.sliced:
                return _CUT
            return _WHOLE if state_slot in slots.unsliced else _PLAIN
        origin_var = self.origin.global_block().find_var(arg)
        if param.sliced and origin_var is not None and not origin_var.persistable and origin_var.shape == param.shape:
            return _CUT  # a param-shaped temporary of L2 decay or clipping: it lives block by block
        return _PLAIN


# How `_map_arg` maps an arg onto a block: declared with the block's shape, declared whole
# (each under a `.block<i>` name when the pserver holds two blocks of the param), or as it is.
_CUT, _WHOLE, _PLAIN = "cut", "whole", "plain"


def _input_of_output(slots: OptimizerSlots, output_slot: str) -> str | None:
    for input_slot, out in slots.outputs.items():
        if out == output_slot:
            return input_slot
    return None


PASS = Pass("pserver_optimize_blocks", run, requires=("origin", "analysis", "plan", "pservers"), produces=("pservers",))
