"""Pass: find what leaves the trainer, then freeze the analysed original.

* Optimize ops: `op_role` has the Optimize bit (and not LRSched), or the op has `Param`,
  `Grad` and `LearningRate` slots (programs built without roles). Each is tied to a
  parameter by the first entry of its `op_role_var` (or its `Param` slot).
* Optimizer ops: optimize ops with those three slots; their type must be in
  `OPTIMIZER_SLOTS`, else `UnknownOpError`. One per parameter.
* The grad a trainer sends for a param: the one var the param's optimize ops read that an
  op staying on the trainer writes (what backward wrote, or the trainer's gradient clip
  made of it, before any L2 decay: found by data flow, not by trusting `op_role_var`);
  the last op the trainer keeps that writes it is where the `send` goes.
* LR ops: `op_role` has the LRSched bit; they move to an lr-decay block on each pserver.
* Embedding tables: the `lookup_table` ops on a param with `is_sparse` / `is_distributed`.
  A sparse table's grad is SELECTED_ROWS; with `remote_prefetch` its rows are fetched
  from its blocks rather than the table received; an `is_distributed` table (at most
  one) lives only on the pservers, sharded by `id % #pservers`, and is updated there by
  its own optimizer op, alone (`_split_off_distributed_table` says what it refuses).

The analysis holds the original's ops, so the original is frozen afterwards: an edit of
it would move or change what the analysis points at (unless it is the caller's program,
lent by `transpile()`, which no pass edits: see `Bundle`).
"""

from __future__ import annotations

from dataclasses import replace

from ops.catalogue.optimizer_ops import optimizer_slots
from transpiler.config import TranspileOptions
from transpiler.errors import TranspileError
from transpiler.ir import Block, Op, OpRole, VarKind
from transpiler.ir.types import OP_NAMESCOPE_ATTR
from transpiler.passes.bundle import Analysis, Bundle, ParamChain, TableLookups
from transpiler.passes.contract import Pass
from transpiler.passes.keep_clip_on_trainer import CLIP_NAME_SCOPES
from transpiler.passes.lr_ops import counter_increment, is_lr_op

LOOKUP_TABLE_OPS = ("lookup_table", "lookup_table_v2")


def is_optimizer_op(op: Op) -> bool:
    return bool(op.input("Param")) and bool(op.input("Grad")) and bool(op.input("LearningRate"))


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    block = bundle.origin.global_block()
    lr_ops: list[Op] = []
    optimize: list[Op] = []
    tied: dict[str, list[Op]] = {}
    optimizers: dict[str, Op] = {}
    for op in block.ops:
        if is_lr_op(op):
            lr_ops.append(op)
            continue
        if not (op.has_role(OpRole.Optimize) or is_optimizer_op(op)):
            continue
        optimize.append(op)
        param = _tied_param(op)
        tied.setdefault(param, []).append(op)
        if is_optimizer_op(op):
            optimizer_slots(op.type)  # UnknownOpError for an optimizer we cannot distribute
            if param in optimizers:
                raise TranspileError(
                    f"param {param!r} is updated by two optimizer ops (ops {optimizers[param].index} and {op.index})"
                )
            optimizers[param] = op
    if not optimizers:
        raise TranspileError(
            "the program has no optimizer ops (sgd, adam, ...): call optimizer.minimize(loss) before transpiling"
        )
    for param, chain_ops in tied.items():
        if param not in optimizers:
            op = chain_ops[0]
            raise TranspileError(f"optimize op {op.index} ({op.type}) is tied to {param!r}, which no optimizer updates")

    moved = {*optimize, *lr_ops}
    tables = _find_tables(block, set(optimizers))
    kept_writers = _kept_writers(block, moved, {name for op in optimize for name in op.input_names})
    chains = []
    kept_before: list[Op | None] | None = None
    for param, optimizer in optimizers.items():  # in program order: the dict was filled walking the ops
        chain_ops = tied[param]
        grad = _sent_grad(chain_ops, param, kept_writers)
        _check_param_and_grad(block, param, grad)
        producer = _last_kept_writer(grad, kept_writers)
        if _is_trainer_clip(producer):
            kept_before = kept_before if kept_before is not None else _last_kept_before(block, moved)
            producer = _paddle18_clip_anchor(block, grad, producer, moved, kept_before)
        sparse = block.find_var(grad).kind == VarKind.SELECTED_ROWS
        if sparse and not optimizer_slots(optimizer.type).sparse_grad:
            raise TranspileError(f"{optimizer.type} cannot apply the sparse grad {grad!r} of {param!r}")
        chains.append(ParamChain(param=param, grad=grad, optimizer=optimizer, ops=chain_ops, grad_producer=producer,
                                 sparse=sparse))

    distributed = _split_off_distributed_table(chains, tables, bundle.origin_startup.global_block())
    counter, update = _lr_counter(block, lr_ops, bundle.lowered_lr_counter)
    analysis = Analysis(
        chains=chains, optimize_ops=optimize, lr_ops=lr_ops, lr_counter=counter, lr_counter_update=update,
        tables=tables, distributed_table=distributed, program=bundle.origin,
    )
    if not bundle.lent:  # a lent program is the caller's: freezing it would change it
        bundle.origin.freeze()
        bundle.origin_startup.freeze()
    return replace(bundle, analysis=analysis)


def _tied_param(op: Op) -> str:
    role_vars = op.role_vars
    if role_vars:
        return role_vars[0]
    if op.input("Param"):
        return op.input("Param")[0]
    raise TranspileError(
        f"optimize op {op.index} ({op.type}) names no parameter (empty op_role_var, no Param slot); "
        "ops that act on several parameters at once (e.g. global-norm clipping) cannot be placed on pservers"
    )


def _kept_writers(block: Block, moved: set[Op], names: set[str]) -> dict[str, list[Op]]:
    """The ops the trainer keeps that write each of `names` (those written by one), in op
    order: one pass over the ops, rather than the block's reader / writer index, which
    nothing else of the analysis needs."""
    found: dict[str, list[Op]] = {}
    for op in block.ops:
        if op in moved:
            continue
        for name in op.output_names:
            if name in names:
                found.setdefault(name, []).append(op)
    return found


def _sent_grad(chain: list[Op], param: str, kept_writers: dict[str, list[Op]]) -> str:
    """The one var the chain reads that the trainer computes."""
    found: list[str] = []
    for op in chain:
        for name in op.input_names:
            if name != param and name not in found and name in kept_writers:
                found.append(name)
    if len(found) == 1:
        return found[0]
    first = chain[0]
    if not found:
        raise TranspileError(
            f"the optimize ops of {param!r} ({', '.join(op.type for op in chain)}) read no var the trainer computes; "
            "was append_backward run?"
        )
    raise TranspileError(
        f"the optimize ops of {param!r} read several vars the trainer computes ({', '.join(found)}), starting at "
        f"op {first.index} ({first.type}); ops that mix several grads (e.g. global-norm clipping) cannot move to pservers"
    )


def _check_param_and_grad(block: Block, param: str, grad: str) -> None:
    for name, what in ((param, "param"), (grad, "grad")):
        var = block.find_var(name)
        if var is None:
            raise TranspileError(f"{what} {name!r} is not declared in the global block")
        if what == "param" and var.kind != VarKind.LOD_TENSOR:
            raise TranspileError(f"param {name!r} is {var.kind.name}, not a LOD_TENSOR")
        if var.shape is None or any(d < 0 for d in var.shape):
            raise TranspileError(f"{what} {name!r} has no static shape ({var.shape}); parameters must")


def _is_trainer_clip(op: Op) -> bool:
    """A gradient-clip op the trainer keeps (keep_clip_on_trainer re-tagged it Backward)."""
    if not op.has_role(OpRole.Backward):
        return False
    scope = op.attr(OP_NAMESCOPE_ATTR, "") or ""
    return any(mark in scope for mark in CLIP_NAME_SCOPES)


def _last_kept_before(block: Block, moved: set[Op]) -> list[Op | None]:
    """Per op position, the last op before it that the trainer keeps (one pass)."""
    out: list[Op | None] = []
    last = None
    for op in block.ops:
        out.append(last)
        if op not in moved:
            last = op
    return out


def _paddle18_clip_anchor(block: Block, grad: str, producer: Op, moved: set[Op], kept_before: list[Op | None]) -> Op:
    """Where Paddle 1.8 sends a grad a trainer clip wrote: after the grad's last writer in
    the whole program (`find_op_by_output_arg(reverse=True)`), an optimize op that then
    leaves the trainer (L2 decay's `sum` into the clipped grad) included; so the send sits
    after the last op the trainer keeps before that writer, after every clip op, as
    Paddle's trainer program has it. Without such a writer, after the clip itself."""
    last = block.writers(grad)[-1]
    if last not in moved:
        return producer
    return kept_before[last.index] or producer


def _last_kept_writer(grad: str, kept_writers: dict[str, list[Op]]) -> Op:
    kept = kept_writers.get(grad)
    if not kept:
        raise TranspileError(f"no op the trainer keeps writes grad {grad!r}; was append_backward run?")
    return kept[-1]


def _find_tables(block: Block, params: set[str]) -> dict[str, TableLookups]:
    """Every sparse or distributed embedding table, with the lookups that read it."""
    tables: dict[str, TableLookups] = {}
    for op in block.ops:
        if op.type not in LOOKUP_TABLE_OPS or not set(op.input("W")) & params:
            continue
        (table,) = op.input("W")
        flags = (bool(op.attr("is_distributed", False)), bool(op.attr("remote_prefetch", False)))
        if not (op.attr("is_sparse", False) or flags[0]):
            continue
        found = tables.get(table)
        if found is None:
            tables[table] = TableLookups(table, [op], op.type, *flags, int(op.attr("padding_idx", -1)))
        elif (found.distributed, found.remote_prefetch, found.op_type) != (*flags, op.type):
            raise TranspileError(
                f"the lookups of table {table!r} disagree (ops {found.lookups[0].index} and {op.index}): "
                "is_distributed, remote_prefetch and the op type must be the same for every lookup of a table"
            )
        else:
            found.lookups.append(op)
    for table, info in tables.items():
        if info.distributed or info.remote_prefetch:
            lookups = set(info.lookups)
            other = [op for op in block.readers(table) if op not in lookups and not op.type.endswith("_grad")
                     and not op.has_role(OpRole.Optimize)]
            if other:
                raise TranspileError(
                    f"table {table!r} is prefetched from the pservers, but op {other[0].index} ({other[0].type}) "
                    "reads the whole table"
                )
    distributed = [t for t in tables.values() if t.distributed]
    if len(distributed) > 1:
        raise TranspileError(
            f"only one distributed lookup table is supported; found {', '.join(t.table for t in distributed)}"
        )
    return tables


def _split_off_distributed_table(chains: list[ParamChain], tables: dict[str, TableLookups],
                                 startup: Block) -> ParamChain | None:
    """Take the distributed table's chain out of `chains`: it is placed by id, not sliced.

    Any optimizer with a sparse rule trains it on the pservers (Paddle swaps it for `sgd`),
    its param-shaped accumulators sharded with the table's rows. Refused: other optimize
    ops on its grad (L2 decay, clipping: they read or write every row of the table, which
    no pserver holds), and what would move rows no trainer has looked up yet (a shard does
    not hold them, local training would): momentum's built-in L2 decay, and an optimizer
    that updates every row (momentum, rmsprop, non-lazy adam) from non-zero state."""
    table = next((t for t in tables.values() if t.distributed), None)
    if table is None:
        return None
    chain = next(c for c in chains if c.param == table.table)
    if not chain.sparse:
        raise TranspileError(f"distributed table {table.table!r} needs is_sparse=True (its grad must be SELECTED_ROWS)")
    if len(chain.ops) != 1:
        kinds = ", ".join(f"{op.index}:{op.type}" for op in chain.ops if op is not chain.optimizer)
        raise TranspileError(
            f"distributed table {table.table!r} must be updated by its optimizer op alone "
            f"({chain.optimizer.type}); it also has optimize ops {kinds} (regularization or clipping of a "
            "table's grad is not supported)"
        )
    if chain.optimizer.attr("regularization_method", "") not in ("", None):
        method = chain.optimizer.attr("regularization_method")
        raise TranspileError(
            f"distributed table {table.table!r}: {chain.optimizer.type} with regularization_method={method!r} "
            "decays rows no trainer looked up; a sharded table cannot"
        )
    optimizer = chain.optimizer
    if optimizer.type == "adamw" and optimizer.attr("with_decay", False) and float(optimizer.attr("coeff", 0.01)):
        raise TranspileError(
            f"distributed table {table.table!r}: adamw with weight decay (with_decay, coeff="
            f"{float(optimizer.attr('coeff', 0.01)):g}) decays every row, also rows no trainer looked up, which a "
            "sharded table does not hold; exclude the table from decay (apply_decay_param_fun) to train it as Adam"
        )
    slots = optimizer_slots(chain.optimizer.type)
    if slots.updates_every_row(lambda name: chain.optimizer.attr(name, False)):
        for name in (name for slot in slots.sliced for name in chain.optimizer.input(slot)):
            start = _nonzero_start(startup, name)
            if start is not None:
                raise TranspileError(
                    f"distributed table {table.table!r}: {chain.optimizer.type} updates every row, and its "
                    f"accumulator {name!r} starts at {start}, so rows no trainer has looked up would move; "
                    "a sharded table only holds rows looked up (start it at 0)"
                )
    chains.remove(chain)
    return chain


def _nonzero_start(startup: Block, name: str) -> str | None:
    """How the startup program initialises `name`, when that is not all zeros."""
    for op in startup.writers(name):
        if op.type != "fill_constant":
            return f"a {op.type}"
        text = str(op.attr("str_value", ""))
        value = float(text) if text else float(op.attr("value", 0.0))
        if value != 0.0:
            return f"{value:g}"
    return None


def _lr_counter(block: Block, lr_ops: list[Op], lowered: str | None) -> tuple[str | None, Op | None]:
    """The global step and the lr op that updates it: the `increment` that adds to it in
    place, or, once the async lowering split it per trainer, the lr op that writes it."""
    if lowered is not None:
        lr = set(lr_ops)
        return lowered, next((op for op in block.writers(lowered) if op in lr), None)
    increment = counter_increment(lr_ops)
    return (None, None) if increment is None else (increment.input("X")[0], increment)


PASS = Pass("find_optimize", run, requires=("origin", "origin_startup"), produces=("analysis",))
