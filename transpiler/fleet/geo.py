"""GEO-SGD for `fleet` (`StrategyFactory.create_geo_strategy(update_frequency)`), built from
the async transpile's programs, with no pserver protocol of its own:

- **pserver**: our async pserver, whose optimize block per param block is
  `param += delta` (`elementwise_add`) instead of the optimizer: it adds the deltas the
  trainers send, as they arrive.
- **trainer**: trains locally with the whole original program (its own optimizer and
  accumulators). Every `update_frequency` steps it runs the *sync program*, which for each
  param `x` with snapshot `y` (the value at the last sync) does what Fluid 1.8's
  GeoCommunicator does for dense vars:

      delta = (x - y) / trainers;  y += delta;  send delta          (as the param's grad)
      z = recv param;              x = x + (z - y);  y = z

  With one trainer and `update_frequency=1` this is local training (the pserver's value
  is `y + (x - y)`, `x` up to rounding).

A sparse embedding table (`is_sparse=True`) and a distributed lookup table
(`is_distributed=True`) sync only the rows the trainer's lookups touched since the last
sync, as Fluid's GEO does: the delta goes as `SelectedRows` (the pserver adds them with an
`sgd` of learning rate -1; a distributed table's delta is split by id to its shards as the
async trainer splits its grad), and only those rows take the pservers' merged values. As
in Fluid 1.8's `GeoSgdTranspiler` (whose trainer program is the origin program and whose
lookups do not prefetch), the trainer holds the whole table and looks its rows up locally.

A learning-rate decay runs where Fluid's GEO runs it: in the trainer's own (origin)
program, each trainer stepping its own schedule; the pservers only add deltas, so their
lr-decay block is left alone and no trainer sends it its step counter.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ops.executor import Executor
from ops.rpc.fetch import pull
from ops.tensor import LoDTensor, SelectedRows
from transpiler.ir import Program, VarKind
from transpiler.ir.types import OpRole
from transpiler.runtime.session import Session

OLD, LOCAL, DIFF = "@GEO_OLD", "@GEO_LOCAL", "@GEO_DIFF"
NEG_ONE = "@GEO_NEG_ONE"  # the pservers' learning rate for adding a sparse delta with `sgd`
RPC_OPS = frozenset({"split_byref", "split_selected_rows", "split_ids", "send", "recv", "concat", "fetch_barrier",
                     "send_barrier"})
SPLIT_OPS = frozenset({"split_byref", "split_selected_rows", "split_ids"})


def sparse_tables(program: Program) -> dict[str, list[str]]:
    """Each embedding table of `program` synced by rows (`is_sparse` or `is_distributed`) →
    its lookups' id vars."""
    out: dict[str, list[str]] = {}
    for op in program.global_block().ops:
        if op.type in ("lookup_table", "lookup_table_v2") and (
                op.attr("is_sparse", False) or op.attr("is_distributed", False)):
            out.setdefault(op.input("W")[0], []).extend(op.input("Ids"))
    return out


def optimize_pairs(program: Program) -> list[tuple[str, str]]:
    """(param, grad) of every optimizer op of `program`, in op order."""
    pairs = []
    for op in program.global_block().ops:
        if op.input("Param") and op.input("Grad") and op.has_role(OpRole.Optimize):
            pairs.append((op.input("Param")[0], op.input("Grad")[0]))
    return pairs


def check_supported(session: Session) -> None:
    """GEO's trainer looks a distributed table up locally, so it must fit the trainer's
    memory as it does under Fluid's GEO; refused: a table no lookup reads by rows."""
    plan = session.result.plan.to_json()
    table = plan.get("table")
    if table and table["table"] not in sparse_tables(session.main):
        raise NotImplementedError(f"GeoStrategy: the distributed table {table['table']} is not read by a "
                                  "lookup_table op of the trainer program")


def pserver_program(main: Program, startup: Program) -> Program:
    """The async pserver `main` with each optimize block replaced by `param += grad`
    (`elementwise_add`; for a sparse grad `sgd` at learning rate -1, declared in both
    programs and set by `startup`)."""
    block0 = main.global_block()
    (serve,) = [op for op in block0.ops if op.type == "listen_and_serv"]
    lr_block = int(serve.attr("lr_decay_block_id", -1))
    for block in serve.blocks_attr("optimize_blocks"):
        if block.idx == lr_block:
            continue  # the trainers run their own decay (see the module docstring)
        optimizers = [op for op in block.ops if op.input("Param") and op.input("Grad")]
        if len(optimizers) != 1:
            raise NotImplementedError(f"GeoStrategy: pserver optimize block {block.idx} has {len(optimizers)} "
                                      "optimizer ops; expected one")
        param, grad = optimizers[0].input("Param")[0], optimizers[0].input("Grad")[0]
        block.clear_ops()
        grad_var = main.global_block().find_var(grad) or block.find_var(grad)
        role = {"op_role": int(OpRole.Optimize)}
        if grad_var is not None and grad_var.kind == VarKind.SELECTED_ROWS:
            like = block0.find_var(param)
            for program in (main, startup):
                if program.global_block().find_var(NEG_ONE) is None:
                    program.global_block().create_var(NEG_ONE, VarKind.LOD_TENSOR, dtype=like.dtype, shape=(1,),
                                                      persistable=True)
            if not any(NEG_ONE in op.output_names for op in startup.global_block().ops):
                startup.global_block().add_op("fill_constant", {}, {"Out": [NEG_ONE]},
                                              {"shape": [1], "value": -1.0, "dtype": int(like.dtype)})
            block.add_op("sgd", {"Param": [param], "Grad": [grad], "LearningRate": [NEG_ONE]}, {"ParamOut": [param]},
                         role)
        else:
            block.add_op("elementwise_add", {"X": [param], "Y": [grad]}, {"Out": [param]}, {"axis": -1, **role})
    return main


def _declare(block, name: str, like) -> None:
    if block.find_var(name) is None:
        block.create_var(name, like.kind, dtype=like.dtype, shape=like.shape, persistable=True)


def sync_program(trainer: Program, pairs: list[tuple[str, str]], trainers: int,
                 table_grads: tuple[str, ...] = ()) -> Program:
    """The async trainer program's RPC ops (split, send, recv, concat) for the grads of
    `pairs` and `table_grads` (not the lr-decay counter's send), wrapped in the GEO delta
    computation before and the merge after (see the module docstring)."""
    sync = trainer.clone()
    block = sync.global_block()
    rpc = OpRole.RPC | OpRole.Dist
    block.remove_ops([op for op in block.ops if not (op.role & rpc and op.type in RPC_OPS)])
    sent = {grad for _, grad in pairs} | set(table_grads)  # and what the split ops cut them into
    for op in block.ops:
        if op.type in SPLIT_OPS and set(op.input_names) & sent:
            sent.update(op.output_names)
    block.remove_ops([op for op in block.ops if op.type == "send" and not set(op.input("X")) <= sent])
    head = block.ops[0] if block.ops else None
    before, after = [], []
    for param, grad in pairs:
        var = block.find_var(param)
        for suffix in (OLD, LOCAL, DIFF):
            _declare(block, param + suffix, var)
        _declare(block, grad, var)
        before += [
            ("elementwise_sub", {"X": [param], "Y": [param + OLD]}, {"Out": [grad]}, {"axis": -1}),
            ("scale", {"X": [grad]}, {"Out": [grad]}, {"scale": 1.0 / trainers}),
            ("elementwise_add", {"X": [param + OLD], "Y": [grad]}, {"Out": [param + OLD]}, {"axis": -1}),
            ("assign", {"X": [param]}, {"Out": [param + LOCAL]}, {}),
        ]
        after += [
            ("elementwise_sub", {"X": [param], "Y": [param + OLD]}, {"Out": [param + DIFF]}, {"axis": -1}),
            ("assign", {"X": [param]}, {"Out": [param + OLD]}, {}),
            ("elementwise_add", {"X": [param + LOCAL], "Y": [param + DIFF]}, {"Out": [param]}, {"axis": -1}),
        ]
    for op_type, inputs, outputs, attrs in before:
        if head is None:
            block.add_op(op_type, inputs, outputs, attrs)
        else:
            block.insert_before(head, op_type, inputs, outputs, attrs)
    for op_type, inputs, outputs, attrs in after:
        block.add_op(op_type, inputs, outputs, attrs)
    return sync


def snapshot_program(trainer: Program, pairs: list[tuple[str, str]]) -> Program:
    """`y = x` for every param (after the startup received the pservers' values)."""
    snap = trainer.clone()
    block = snap.global_block()
    block.clear_ops()
    for param, _ in pairs:
        _declare(block, param + OLD, block.find_var(param))
        block.add_op("assign", {"X": [param]}, {"Out": [param + OLD]}, {})
    return snap


def rows_program(trainer: Program, table: str) -> tuple[Program, str, str]:
    """(program, ids var, rows var): the async trainer's prefetch of the distributed
    `table` (`split_ids` → `prefetch` → `merge_ids`) alone, so that setting the ids var to
    some ids and running it gives their rows as the pservers hold them (an unseen row is
    created there from the table's initializer, as a lookup would)."""
    program = trainer.clone()
    block = program.global_block()
    ops = list(block.ops)
    prefetch = next((op for op in ops if op.type == "prefetch"), None)
    if prefetch is None:
        raise NotImplementedError(f"GeoStrategy: the trainer program has no prefetch of the distributed table {table}")
    sent = set(prefetch.input("X"))
    split = next((op for op in ops if op.type == "split_ids" and sent <= set(op.output("Out"))), None)
    merge = next((op for op in ops if op.type == "merge_ids" and set(prefetch.output("Out")) <= set(op.input("X"))),
                 None)
    if split is None or merge is None:
        raise NotImplementedError(f"GeoStrategy: the prefetch of the distributed table {table} is not "
                                  "split_ids → prefetch → merge_ids")
    block.remove_ops([op for op in ops if op not in (split, prefetch, merge)])
    return program, split.input("Ids")[0], merge.output("Out")[0]


class GeoWorker:
    """A GEO trainer's programs and its step count: `fleet` hangs `after_startup` on the
    startup program and `after_step` on the main program (`fluid.Executor` calls them)."""

    def __init__(self, session: Session, update_frequency: int) -> None:
        if isinstance(update_frequency, bool) or not isinstance(update_frequency, int) or update_frequency < 1:
            raise ValueError(f"GeoStrategy update_frequency must be an integer >= 1, got {update_frequency!r}")
        check_supported(session)
        self.session, self.every = session, update_frequency
        self.tables = sparse_tables(session.main)
        pairs = optimize_pairs(session.main)
        self.table_grads = {param: grad for param, grad in pairs if param in self.tables}
        self.pairs = [(param, grad) for param, grad in pairs if param not in self.tables]
        self.sync = sync_program(session.result.trainer, self.pairs, session.role.trainers,
                                 tuple(self.table_grads.values()))
        self.snapshot = snapshot_program(session.result.trainer, self.pairs)
        self.plan = session.result.plan.to_json()
        self.distributed = (self.plan.get("table") or {}).get("table")
        if self.distributed is not None:
            self.rows = rows_program(session.result.trainer, self.distributed)
        self.old: dict[str, np.ndarray] = {}  # each table's rows at the last sync
        self.touched: dict[str, set[int]] = {table: set() for table in self.tables}
        self.steps = 0

    def _run(self, program: Program, scope: Any, executor: Executor) -> None:
        executor.run(program, scope=scope, env={"rpc": self.session.client})

    def _pull_tables(self, scope: Any, executor: Executor, rows_of: dict[str, np.ndarray] | None = None
                     ) -> dict[str, np.ndarray]:
        """Each table's pservers' values: a sparse table whole; the distributed table's rows
        `rows_of[table]` (all rows when None) through its prefetch (the rest left zero)."""
        tables = [t for t in self.tables if t != self.distributed]
        out = pull(self.session.client, self.plan, tables) if tables else {}
        if self.distributed is not None:
            program, ids_var, rows_var = self.rows
            height = scope.find_var(self.distributed).array.shape[0]
            rows = np.arange(height, dtype=np.int64) if rows_of is None else rows_of[self.distributed]
            whole = np.zeros_like(scope.find_var(self.distributed).array)
            if rows.size:
                scope.set_var(ids_var, LoDTensor(rows.reshape(-1, 1)))
                self._run(program, scope, executor)
                whole[rows] = scope.find_var(rows_var).array.reshape(rows.size, -1)
            out[self.distributed] = whole
        return out

    def after_startup(self, scope: Any, executor: Executor) -> None:
        """Take the pservers' initial params (the async trainer startup; the tables whole),
        then snapshot them."""
        self._run(self.session.result.trainer_startup, scope, executor)
        for table, value in self._pull_tables(scope, executor).items():
            scope.set_var(table, LoDTensor(np.array(value)))
            self.old[table] = np.array(value)
        self._run(self.snapshot, scope, executor)

    def after_step(self, scope: Any, executor: Executor) -> None:
        self.steps += 1
        for table, id_vars in self.tables.items():
            for name in id_vars:
                ids = scope.find_var(name)
                if isinstance(ids, LoDTensor):
                    self.touched[table].update(np.unique(ids.array).tolist())
        if self.steps % self.every:
            return
        rows_of = {}
        for table, grad in self.table_grads.items():
            rows = np.array(sorted(self.touched[table]), dtype=np.int64)
            local, old = scope.find_var(table).array, self.old[table]
            delta = (local[rows] - old[rows]) / self.session.role.trainers
            old[rows] += delta
            scope.set_var(grad, SelectedRows(rows, delta.astype(local.dtype), local.shape[0]))
            rows_of[table] = rows
        self._run(self.sync, scope, executor)
        for table, merged in self._pull_tables(scope, executor, rows_of).items():
            rows, old = rows_of[table], self.old[table]
            local = np.array(scope.find_var(table).array)
            local[rows] += merged[rows] - old[rows]
            old[rows] = merged[rows]
            scope.set_var(table, LoDTensor(local))
            self.touched[table].clear()
