"""Lowering: the global step of lr decay in async mode (Fluid 1.6+, Paddle PR #20816 "Optimize
decay": `DistributeTranspiler._get_lr_ops` rewrites the program the same way).

In async mode no pserver sees "a step"; each trainer counts its own. The `increment` of
`@LR_DECAY_COUNTER@` becomes `sum(@LR_DECAY_COUNTER@.trainer_0 .. _{n-1}) ->
@LR_DECAY_COUNTER@` (role LRSched); each per-trainer counter starts at 1 and the
shared counter's initial value becomes `-trainers`. The trainer sends its counter to
every pserver after each step (`send` with `merge_add=True`), where it is added to the
pserver's copy before the lr-decay block runs.

It runs before the analysis and rewrites the bundle's private copies of the original
programs, so find_optimize and every pass after it see the per-trainer counters; it
records the counter it rewrote in `bundle.lowered_lr_counter`. Sync mode is left alone.
"""

from __future__ import annotations

from dataclasses import replace

from ops.catalogue import make_op
from transpiler.config import TranspileOptions
from transpiler.errors import TranspileError
from transpiler.ir import Attr, AttrType, Op, OpRole
from transpiler.ir.types import OP_ROLE_ATTR
from transpiler.naming import trainer_name
from transpiler.passes.bundle import Bundle
from transpiler.passes.contract import Pass
from transpiler.passes.lr_ops import counter_increment, is_lr_op


def run(bundle: Bundle, options: TranspileOptions) -> Bundle:
    if options.sync_mode or _increment(bundle) is None:
        return bundle
    bundle = bundle.own_origins()
    main = bundle.origin.global_block()
    increment = _increment(bundle)
    (counter,) = increment.input("X")
    counter_var = main.var(counter)
    per_trainer = [trainer_name(counter, k) for k in range(options.trainers)]
    for name in per_trainer:
        if main.has_var(name):
            raise TranspileError(f"the program already declares {name!r}, which async lr decay needs")
        main.add_var(counter_var.copy(name))

    merged = make_op("sum", {"X": per_trainer}, {"Out": [counter]}, role=OpRole.LRSched)
    main.insert_after(increment, merged)
    main.remove_op(increment)

    startup = bundle.origin_startup.global_block()
    init = next((op for op in startup.ops if counter in op.output("Out")), None)
    if init is None or init.type != "fill_constant":
        raise TranspileError(f"async lr decay needs {counter!r} initialised by a fill_constant in the startup program")
    _set_fill_value(init, float(-options.trainers))
    first = startup.ops[0]
    for name in per_trainer:
        startup.add_var(startup.var(counter).copy(name))
        fill = init.clone()
        fill.set_output("Out", [name])
        _set_fill_value(fill, 1.0)
        fill.set_attr(OP_ROLE_ATTR, Attr.of(int(OpRole.Forward), AttrType.INT))
        startup.insert_before(first, fill)
    return replace(bundle, lowered_lr_counter=counter)


def _increment(bundle: Bundle) -> Op | None:
    return counter_increment(op for op in bundle.origin.global_block().ops if is_lr_op(op))


def _set_fill_value(op: Op, value: float) -> None:
    """Set a fill_constant's value; Paddle reads `str_value` first when it is set."""
    op.set_attr("value", value)
    if op.attr("str_value", ""):
        op.set_attr("str_value", repr(value))


PASS = Pass("lower_async_lr_decay", run, requires=("origin", "origin_startup"), produces=())
