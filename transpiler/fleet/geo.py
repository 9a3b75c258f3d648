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

Dense params only: a program with a sparse grad, a distributed lookup table or a
learning-rate decay is refused (`NotImplementedError`).
"""

from __future__ import annotations

from typing import Any

from ops.executor import Executor
from transpiler.ir import Program
from transpiler.ir.types import OpRole
from transpiler.runtime.session import Session

OLD, LOCAL, DIFF = "@GEO_OLD", "@GEO_LOCAL", "@GEO_DIFF"


def optimize_pairs(program: Program) -> list[tuple[str, str]]:
    """(param, grad) of every optimizer op of `program`, in op order."""
    pairs = []
    for op in program.global_block().ops:
        if op.input("Param") and op.input("Grad") and op.has_role(OpRole.Optimize):
            pairs.append((op.input("Param")[0], op.input("Grad")[0]))
    return pairs


def check_supported(session: Session) -> None:
    plan = session.result.plan.to_json()
    if plan.get("table"):
        raise NotImplementedError("GeoStrategy with a distributed lookup table is not implemented by this runtime")
    block = session.main.global_block()
    for op in block.ops:
        if op.has_role(OpRole.LRSched):
            raise NotImplementedError("GeoStrategy with a learning-rate decay is not implemented by this runtime")
        if op.type in ("lookup_table", "lookup_table_v2") and op.attr("is_sparse", False):
            raise NotImplementedError("GeoStrategy with sparse embedding grads (is_sparse=True) is not implemented by "
                                      "this runtime; dense params only")


def pserver_program(main: Program) -> Program:
    """The async pserver `main` with each optimize block replaced by `param += grad`."""
    block0 = main.global_block()
    (serve,) = [op for op in block0.ops if op.type == "listen_and_serv"]
    for block in serve.blocks_attr("optimize_blocks"):
        optimizers = [op for op in block.ops if op.input("Param") and op.input("Grad")]
        if len(optimizers) != 1:
            raise NotImplementedError(f"GeoStrategy: pserver optimize block {block.idx} has {len(optimizers)} "
                                      "optimizer ops; expected one")
        param, grad = optimizers[0].input("Param")[0], optimizers[0].input("Grad")[0]
        block.clear_ops()
        block.add_op("elementwise_add", {"X": [param], "Y": [grad]}, {"Out": [param]},
                     {"axis": -1, "op_role": int(OpRole.Optimize)})
    return main


def _declare(block, name: str, like) -> None:
    if block.find_var(name) is None:
        block.create_var(name, like.kind, dtype=like.dtype, shape=like.shape, persistable=True)


def sync_program(trainer: Program, pairs: list[tuple[str, str]], trainers: int) -> Program:
    """The async trainer program's RPC ops (split, send, recv, concat), wrapped in the GEO
    delta computation before and the merge after (see the module docstring)."""
    sync = trainer.clone()
    block = sync.global_block()
    rpc = OpRole.RPC | OpRole.Dist
    block.remove_ops([op for op in block.ops if not (op.role & rpc)])
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


class GeoWorker:
    """A GEO trainer's programs and its step count: `fleet` hangs `after_startup` on the
    startup program and `after_step` on the main program (`fluid.Executor` calls them)."""

    def __init__(self, session: Session, update_frequency: int) -> None:
        if isinstance(update_frequency, bool) or not isinstance(update_frequency, int) or update_frequency < 1:
            raise ValueError(f"GeoStrategy update_frequency must be an integer >= 1, got {update_frequency!r}")
        check_supported(session)
        self.session, self.every = session, update_frequency
        self.pairs = optimize_pairs(session.main)
        self.sync = sync_program(session.result.trainer, self.pairs, session.role.trainers)
        self.snapshot = snapshot_program(session.result.trainer, self.pairs)
        self.steps = 0

    def _run(self, program: Program, scope: Any, executor: Executor) -> None:
        executor.run(program, scope=scope, env={"rpc": self.session.client})

    def after_startup(self, scope: Any, executor: Executor) -> None:
        """Take the pservers' initial params (the async trainer startup), then snapshot them."""
        self._run(self.session.result.trainer_startup, scope, executor)
        self._run(self.snapshot, scope, executor)

    def after_step(self, scope: Any, executor: Executor) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            self._run(self.sync, scope, executor)
