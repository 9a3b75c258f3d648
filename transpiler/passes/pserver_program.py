"""Pass: one main program per pserver.

Block 0 holds the vars and one `listen_and_serv`. Then:

* an lr-decay block (a child of block 0) with copies of the lr ops, whose sub-blocks
  (`conditional_block` bodies) are copied recursively as new blocks;
* one optimize block per param block placed here: in sync mode with several trainers
  `sum` of the trainers' grads → `scale` by 1/trainers; then the param's other optimize
  ops (L2 decay, clip) and its optimizer op, rewritten onto the block: the param and
  grad become the block vars, accumulators shaped like the param (`OPTIMIZER_SLOTS`)
  and param-shaped temporaries are cut to the block's shape;
* an empty block when nothing is placed here, so `optimize_blocks` is never empty.

Optimize blocks are children of the lr-decay block when there is one (Paddle makes them
children of the lr block's *last sub-block*, an artefact of how it counted blocks; what
matters to the runtime is that the lr block runs first, which `lr_decay_block_id` says).
`grad_to_block_id` lists blocks in block order (Paddle's order depends on the hash seed).
When one pserver holds two blocks of a param (possible with `HashName`), its state vars
get a `.block<i>` suffix so the blocks do not share moments.
"""

from __future__ import annotations

from dataclasses import replace

from ops.catalogue.optimizers import OptimizerSlots, optimizer_slots
from transpiler.config import TranspileOptions
from transpiler.ir import AttrType, Block, DType, Op, OpRole, Program, VarKind
from transpiler.ir.types import EMPTY_VAR_NAME, OP_ROLE_VAR_ATTR
from transpiler.naming import LOOKUP_TABLE_PATH, block_name, encode_pairs
from transpiler.passes.bundle import Bundle, ParamChain, PserverPrograms
from ops.catalogue import make_op
from transpiler.plan import ParamPlan, VarBlock


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    assert bundle.plan is not None and bundle.analysis is not None, "run the earlier passes first"
    pservers = {ep: _PserverBuilder(bundle, options, ep).build() for ep in options.endpoints}
    return replace(bundle, pservers=pservers)


class _PserverBuilder:
    def __init__(self, bundle: Bundle, options: TranspileOptions, endpoint: str) -> None:
        self.bundle = bundle
        self.options = options
        self.endpoint = endpoint
        self.plan = bundle.plan
        self.origin = bundle.origin
        self.program = Program.empty()
        self.program.version = bundle.origin.version
        if bundle.origin.op_version_map is not None:
            self.program.op_version_map = dict(bundle.origin.op_version_map)
        self.globals = self.program.global_block()
        self.instances: dict[str, list[tuple[str, int]]] = {}

    def build(self) -> PserverPrograms:
        chains = {chain.param: chain for chain in self.bundle.analysis.chains}
        optimize_blocks: list[int] = []
        lr_block = self._lr_decay_block()
        if lr_block is not None:
            optimize_blocks.append(lr_block.idx)
        parent = lr_block.idx if lr_block is not None else 0
        recv_inputs: list[str] = []
        grad_to_block: list[tuple[str, int]] = []
        sparse_grad_to_param: list[tuple[str, str]] = []
        for param, var_block in self.plan.on(self.endpoint):
            block = self.program.create_block(parent)
            inputs = self._optimize_block(block, chains[param.param], param, var_block)
            recv_inputs.extend(inputs)
            optimize_blocks.append(block.idx)
            merged = param.grad_block_name(var_block.index)
            grad_to_block.append((merged, block.idx))
            if param.sparse:
                sparse_grad_to_param.append((merged, var_block.name))
        table_attrs = {}
        if self.plan.table is not None:
            table_attrs = self._table_blocks(parent, optimize_blocks, grad_to_block)
        if not optimize_blocks:
            optimize_blocks.append(self.program.create_block(0).idx)

        options = self.options
        self.globals.add_op(
            make_op(
                "listen_and_serv",
                {"X": recv_inputs},
                {},
                {
                    "endpoint": self.endpoint,
                    "pserver_id": options.endpoints.index(self.endpoint),
                    "Fanin": options.trainers,
                    "sync_mode": options.sync_mode,
                    "distributed_mode": int(options.distributed_mode),
                    "optimize_blocks": optimize_blocks,
                    "grad_to_block_id": encode_pairs(grad_to_block),
                    "sparse_grad_to_param": encode_pairs(sparse_grad_to_param),
                    "lr_decay_block_id": lr_block.idx if lr_block is not None else -1,
                    **table_attrs,
                },
                role=OpRole.RPC,
            ),
            index=0,
        )
        return PserverPrograms(main=self.program, instances=self.instances)

    # -- the distributed table
    def _table_blocks(self, parent: int, optimize_blocks: list[int], grad_to_block: list[tuple[str, int]]) -> dict:
        """This pserver's shard of the distributed table: its update block (a child of
        `parent`), then a prefetch block and a checkpoint block (children of the update
        block). Returns the `listen_and_serv` attrs that name them."""
        table, plan = self.plan.table, self.plan
        shard = list(table.endpoints).index(self.endpoint)
        chain = self.bundle.analysis.distributed_table
        table_var = self.declare(table.table, table.table, table.shard_shape, persistable=True, index=shard)
        self.globals.var(table_var).kind = VarKind.SELECTED_ROWS
        block = self.program.create_block(parent)
        if plan.per_trainer_grads:
            merged = self.declare(table.grad, table.grad, persistable=True)
            received = [table.shard_grad_name(shard, k) for k in range(plan.trainers)]
            for name in received:
                self.declare(table.grad, name, persistable=False)
            block.add_op(make_op("sum", {"X": received}, {"Out": [merged]}, role=OpRole.Optimize,
                                 role_vars=(table.table, merged)))
            # Paddle sums the trainers' table grads without averaging them (PR #13277 was never
            # merged), so a table learnt `trainers` times faster than local training; scale as
            # for every other param.
            block.add_op(make_op("scale", {"X": [merged]}, {"Out": [merged]}, {"scale": 1.0 / plan.trainers},
                                 role=OpRole.Optimize, role_vars=(table.table, merged)))
        else:
            merged = self.declare(table.grad, table.shard_grad_name(shard, None), persistable=True)
        sgd = chain.optimizer.clone()
        known = {table.grad: merged, table.table: table_var}
        for slot, args in sgd.inputs.items():
            sgd.set_input(slot, [known[a] if a in known else self.declare(a) for a in args])
        block.add_op(sgd)
        optimize_blocks.append(block.idx)
        grad_to_block.append((merged, block.idx))

        # The ids a trainer asks for and the rows it gets back (not state: nothing initialises them).
        prefetch_in, prefetch_out = table.prefetch_in(shard), table.prefetch_out(shard)
        for name, dtype, shape in ((prefetch_in, DType.INT64, (-1, 1)),
                                   (prefetch_out, table.dtype, (-1, *table.shape[1:]))):
            if not self.globals.has_var(name):
                self.globals.create_var(name, VarKind.LOD_TENSOR, dtype, shape)
        prefetch = self.program.create_block(block.idx)
        prefetch.add_op(make_op("lookup_sparse_table", {"Ids": [prefetch_in], "W": [table.table]},
                                {"Out": [prefetch_out]}, {"padding_idx": table.padding_idx}, role=OpRole.RPC))
        if not self.globals.has_var(LOOKUP_TABLE_PATH):
            self.globals.create_var(LOOKUP_TABLE_PATH, VarKind.RAW, persistable=True)
        checkpoint = self.program.create_block(block.idx)
        checkpoint.add_op(make_op("save", {"X": [table.table]}, {}, {"file_path": "none"}, role=OpRole.RPC))
        return {
            "prefetch_var_name_to_block_id": encode_pairs([(prefetch_in, prefetch.idx)]),
            "checkpint_block_id": checkpoint.idx,  # sic: Paddle's attr name
        }

    # -- vars
    def declare(
        self, origin_name: str, name: str | None = None, shape=None, *, persistable: bool | None = None, index: int = 0
    ) -> str:
        """Declare (once) the pserver var `name` standing for block `index` of original var `origin_name`."""
        name = name or origin_name
        if not self.globals.has_var(name):
            source = self.origin.global_block().find_var(origin_name)
            if source is None:
                return name  # an undeclared var; the verifier names it
            var = source.copy(name)
            if shape is not None:
                var.shape = tuple(shape)
            if persistable is not None:
                var.persistable = persistable
            self.globals.add_var(var)
        known = self.instances.setdefault(origin_name, [])
        if (name, index) not in known:
            known.append((name, index))
        return name

    # -- the lr-decay block
    def _lr_decay_block(self) -> Block | None:
        lr_ops = self.bundle.analysis.lr_ops
        if not lr_ops:
            return None
        block = self.program.create_block(0)
        for op in lr_ops:
            self._copy_op(op, self.origin.global_block(), block)
        return block

    def _copy_op(self, op: Op, source_block: Block, target: Block) -> None:
        """Copy `op` into `target`, declaring the globals it uses and copying its sub-blocks."""
        new = op.clone()
        for name in (*op.input_names, *op.output_names):
            if name == EMPTY_VAR_NAME or target.find_var(name) is not None:
                continue
            if source_block.has_var(name) and source_block.idx != 0:
                target.add_var(source_block.var(name).copy())
            else:
                self.declare(name)
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

    # -- optimize blocks
    def _optimize_block(self, block: Block, chain: ParamChain, param: ParamPlan, var_block: VarBlock) -> list[str]:
        """Fill one optimize block; return the grad vars `listen_and_serv` receives for it."""
        plan, index = self.plan, var_block.index
        merged = param.grad_block_name(index)
        self.declare(param.param, var_block.name, var_block.shape, persistable=True, index=index)
        self.declare(param.grad, merged, var_block.shape, persistable=True, index=index)
        mapping = {param.param: var_block.name, param.grad: merged}
        if plan.per_trainer_grads:
            received = [plan.trainer_grad_name(param, index, k) for k in range(plan.trainers)]
            for name in received:
                self.declare(param.grad, name, var_block.shape, persistable=False, index=index)
            block.add_op(make_op("sum", {"X": received}, {"Out": [merged]}, role=OpRole.Optimize,
                                 role_vars=(var_block.name, merged)))
            block.add_op(make_op("scale", {"X": [merged]}, {"Out": [merged]}, {"scale": 1.0 / plan.trainers},
                                 role=OpRole.Optimize, role_vars=(var_block.name, merged)))
        else:
            received = [merged]

        shared = len(param.blocks_on(self.endpoint)) > 1
        for op in chain.ops:
            slots = optimizer_slots(op.type) if op is chain.optimizer else None
            new = op.clone()
            for direction in ("inputs", "outputs"):
                for slot, args in getattr(op, direction).items():
                    mapped = [self._map_arg(arg, slot, slots, direction, param, var_block, shared, mapping)
                              for arg in args]
                    (new.set_input if direction == "inputs" else new.set_output)(slot, mapped)
            if new.role_vars:
                new.set_attr(OP_ROLE_VAR_ATTR, [mapping.get(name, name) for name in new.role_vars])
            block.add_op(new)
        return received

    def _map_arg(self, arg: str, slot: str, slots: OptimizerSlots | None, direction: str,
                 param: ParamPlan, var_block: VarBlock, shared: bool, mapping: dict[str, str]) -> str:
        if arg == EMPTY_VAR_NAME:
            return arg
        if arg in mapping:
            return mapping[arg]
        suffixed = block_name(arg, var_block.index) if shared else arg
        origin_var = self.origin.global_block().find_var(arg)
        if slots is not None:
            state_slot = slot if direction == "inputs" else _input_of_output(slots, slot)
            if state_slot in slots.sliced:
                mapping[arg] = self.declare(arg, suffixed, var_block.shape, index=var_block.index)
                return mapping[arg]
            if state_slot in slots.unsliced:
                mapping[arg] = self.declare(arg, suffixed, index=var_block.index)
                return mapping[arg]
        elif (
            param.sliced
            and origin_var is not None
            and not origin_var.persistable
            and origin_var.shape == param.shape
        ):
            # A param-shaped temporary of L2 decay or clipping: it lives block by block.
            mapping[arg] = self.declare(arg, suffixed, var_block.shape, index=var_block.index)
            return mapping[arg]
        return self.declare(arg)


def _input_of_output(slots: OptimizerSlots, output_slot: str) -> str | None:
    for input_slot, out in slots.outputs.items():
        if out == output_slot:
            return input_slot
    return None
