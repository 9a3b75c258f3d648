"""Sum on arrival: a sync pserver adds its trainers' copies of a grad into one kept array
as they arrive, instead of keeping one copy per trainer for the optimize block's `sum`
(issue 30; docs/runtime.md "Summed on arrival").

A sync pserver's optimize block starts `sum(g.trainer_0, ..., g.trainer_{n-1}) -> g`.
`find_plans` finds such a `sum` once per program when its inputs are exactly the
per-trainer copies the pserver receives (dense, one fixed shape and dtype, read by no
other op, not kept). The pserver (`ops.rpc.server`) then adds each arrival into `g`'s
kept array and the executor skips that `sum` op (`RunContext.skip_ops`).

Exactness. The `sum` kernel computes `((x0 + x1) + x2) + ...` element by element. IEEE
addition commutes exactly, so x0 and x1 may come in either order: the first of them is
received straight into the accumulator (`recv_into`), the second added to it. Trainer
k >= 2 is added only in its turn: when it arrives before all of x0..x_{k-1} have at least
started arriving, it is received into a buffer kept for it and added when its turn comes
(`Arrivals.finish`). A completed trainer's missing grad is added as zeros in its turn, as
the `sum` of `_zeros` would (-0.0 + 0.0 is +0.0: not skipped).

Chunks. On the bulk channel a big payload is received `chunk_elements` at a time; an
arrival in its turn adds chunk i once every earlier input has written chunk i
(`progress`, under the var's condition): two connections never write one chunk at once,
and the first arrival never waits, so every wait ends (the earliest claim never waits;
each wait is on an earlier claim). A wait is bounded (the pserver's timeout) and ends at
once when the round fails. Through a shared-memory ring (`ops.rpc.bulk.Ring`) the chunk is
a slot, added straight from it (no chunk buffer); the order and the bits are the same.

Torn sums. A call that breaks after it started writing into the accumulator leaves a
partial sum: `Arrivals.tear` marks it and the pserver fails the round with one error
naming the trainer and the var (there are no client retries; a lost trainer fails a sync
job the same way).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ops.heap import ARRIVAL_SUM_MIN_BYTES

MIN_BYTES = ARRIVAL_SUM_MIN_BYTES  # a grad smaller than this keeps its `sum` op (`ops.heap`)
CHUNK_BYTES = 512 << 10  # bytes received, then added, at a time: measured, docs/runtime.md "Summed on arrival"

NONE, RECEIVING, HELD, DONE = "none", "receiving", "held", "done"
BASE, ADD, HOLD = "base", "add", "hold"  # how an arrival writes: into the accumulator, added to it, kept aside


class TornSum(Exception):
    """The round's sum of a grad cannot be completed (a torn arrival, a failure, a timeout)."""


@dataclass(frozen=True)
class SumPlan:
    """`sum(inputs) -> out`, op `op_index` of optimize block `block`, done on arrival."""

    out: str
    inputs: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    block: int
    op_index: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def find_plans(program: Any, optimize_blocks: Iterable[int], received: Iterable[str],
               templates: Mapping[str, tuple[tuple[int, ...], Any]], sparse: Iterable[str],
               persistables: Iterable[str], skip_types: tuple[str, ...] = ("listen_and_serv",)) -> tuple[SumPlan, ...]:
    """The `sum` ops a sync pserver may do on arrival: the first op of an optimize block,
    whose X are two or more distinct received, dense, not-kept vars of one fixed shape and
    dtype that no other op of the program reads or writes, and whose Out is a dense var of
    that shape and dtype other than those."""
    received, sparse, kept = set(received), set(sparse), set(persistables)
    named: dict[str, int] = {}  # var -> how many op slots name it (listen_and_serv's excepted)
    for block in program.blocks:
        for op in block.ops:
            if op.type in skip_types:
                continue
            for name in (*op.input_names, *op.output_names):
                named[name] = named.get(name, 0) + 1
    plans: list[SumPlan] = []
    seen: set[str] = set()
    for idx in optimize_blocks:
        block = program.block(idx)
        if not block.ops or block.ops[0].type != "sum" or block.ops[0].sub_block_indices():
            continue
        op = block.ops[0]
        inputs, outs = tuple(op.input("X")), tuple(op.output("Out"))
        if len(inputs) < 2 or len(set(inputs)) != len(inputs) or len(outs) != 1:
            continue
        out = outs[0]
        if out in inputs or out in received or out in sparse or out in seen:
            continue
        if any(x not in received or x in sparse or x in kept or named.get(x) != 1 for x in inputs):
            continue
        found = [templates.get(name) for name in (*inputs, out)]
        if any(t is None for t in found):
            continue
        shape, dtype = tuple(int(d) for d in found[0][0]), np.dtype(found[0][1])
        if any(d < 0 for d in shape) or not math.prod(shape) or dtype.kind not in "fiuc":
            continue
        if any(tuple(int(d) for d in t[0]) != shape or np.dtype(t[1]) != dtype for t in found):
            continue
        seen.update((out, *inputs))
        plans.append(SumPlan(out, inputs, shape, dtype, idx, 0))
    return tuple(plans)


class Arrivals:
    """One planned grad's sum for the rounds: the accumulator, the buffers kept for early
    arrivals, and the round's state per input (position in `plan.inputs`)."""

    def __init__(self, plan: SumPlan, chunk_bytes: int | None = None) -> None:
        self.plan = plan
        self.n = len(plan.inputs)
        self.position = {name: k for k, name in enumerate(plan.inputs)}
        self.size = math.prod(plan.shape)
        self.nbytes = plan.nbytes
        self.chunk = max(1, (chunk_bytes or CHUNK_BYTES) // plan.dtype.itemsize)  # elements
        # kept across rounds, shaped and owning its memory: the scope's value of `out`, which
        # the ops after the skipped `sum` (a `scale`) may then update in place
        self.acc: np.ndarray | None = None
        self.held: dict[int, np.ndarray] = {}  # flat, kept across rounds for early arrivals
        self.cond = threading.Condition(threading.Lock())
        self.allocations = 0  # grad-sized arrays made (tests: none per step once warm)
        self.streamed = 0  # arrivals received off the bulk channel (the others came whole, by gRPC)
        self.reset()

    def reset(self) -> None:
        self.state = [NONE] * self.n
        self.progress = [0] * self.n  # elements of each input written or added
        self.base: int | None = None  # the input received straight into the accumulator
        self.lod: Any = None  # input 0's LoD (the `sum` kernel's output takes X[0]'s)
        self.torn: str | None = None
        self.who: dict[int, int] = {}  # position -> trainer id (for the messages)

    # ------------------------------------------------------------ claims (under `cond`)
    def _order(self) -> list[int]:
        first = 0 if self.base is None else self.base
        return [first, 1 - first, *range(2, self.n)]

    def predecessors(self, k: int) -> list[int]:
        if k < 2:
            return [] if self.base in (None, k) else [self.base]
        return list(range(k))

    def claim(self, k: int, *, may_wait: bool) -> str:
        """Start input `k`'s arrival (lock held): BASE (into the accumulator), ADD (added to
        it; with `may_wait`, possibly chunk by chunk behind earlier inputs still arriving)
        or HOLD (into a kept buffer, added in its turn). `TornSum` when the round's sum is
        torn or input `k` arrived already this round."""
        if self.torn is not None:
            raise TornSum(self.torn)
        if self.state[k] != NONE:
            raise TornSum(f"{self.plan.inputs[k]} arrived twice this round")
        if k < 2 and self.base is None:
            self.base = k
            mode = BASE
        else:
            before = [self.state[p] for p in self.predecessors(k)]
            if all(s == DONE for s in before) or (may_wait and all(s in (RECEIVING, DONE) for s in before)):
                mode = ADD
            else:
                mode = HOLD
        self.state[k] = RECEIVING
        self._ensure_acc()
        return mode

    def _ensure_acc(self) -> None:
        if self.acc is None:
            self.acc = np.empty(self.plan.shape, self.plan.dtype)
            self.allocations += 1

    def flat(self) -> np.ndarray:
        """The accumulator as one dimension (a view)."""
        return self.acc.reshape(-1)

    def buffer(self, k: int) -> np.ndarray:
        """Input `k`'s kept buffer for an early arrival (made on its first use)."""
        found = self.held.get(k)
        if found is None:
            found = self.held[k] = np.empty(self.size, self.plan.dtype)
            self.allocations += 1
        return found

    def wait_turn(self, k: int, end: int, failed: Callable[[], str | None], timeout: float) -> None:
        """Block until every input before `k` wrote elements [.., end) (lock held)."""
        deadline = time.monotonic() + timeout
        preds = self.predecessors(k)
        while any(self.progress[p] < end for p in preds):
            reason = self.torn or failed()
            if reason is not None:
                raise TornSum(reason)
            left = deadline - time.monotonic()
            if left <= 0:
                late = [self.plan.inputs[p] for p in preds if self.progress[p] < end]
                raise TornSum(f"{self.plan.inputs[k]} waited {timeout:.0f} s for {', '.join(late)} to arrive")
            self.cond.wait(min(left, 0.2))

    def advance(self, k: int, end: int) -> None:
        """Input `k` wrote elements [.., end) (lock held)."""
        self.progress[k] = end
        self.cond.notify_all()

    def finish(self, k: int, mode: str, lod: Any = None) -> None:
        """Input `k` arrived whole (lock held): mark it, then add the kept early arrivals
        whose turn came."""
        if k == 0:
            self.lod = lod
        self.state[k] = HELD if mode == HOLD else DONE
        if mode != HOLD:
            self.progress[k] = self.size
        self._drain()
        self.cond.notify_all()

    def _drain(self) -> None:
        acc = self.flat()
        for k in self._order():
            state = self.state[k]
            if state == DONE:
                continue
            if state != HELD:  # a base is never held: it arrives straight into the accumulator
                return
            np.add(acc, self.held[k], out=acc)
            self.state[k], self.progress[k] = DONE, self.size

    def tear(self, k: int, reason: str) -> None:
        self.torn = self.torn or reason
        self.state[k] = DONE  # stays out of the round
        self.cond.notify_all()

    # ------------------------------------------------------------ the round's end
    def complete(self) -> tuple[np.ndarray, Any]:
        """The round's sum (lock held): the missing inputs (completed trainers') added as
        zeros in their turns, the early arrivals in theirs. `TornSum` if it cannot be."""
        if self.torn is not None:
            raise TornSum(self.torn)
        busy = [self.plan.inputs[k] for k, s in enumerate(self.state) if s == RECEIVING]
        if busy:
            raise TornSum(f"{', '.join(busy)} still arriving when the round's barriers were all in")
        self._ensure_acc()
        acc = self.flat()
        zero = self.plan.dtype.type(0)
        if self.base is None:  # neither x0 nor x1 arrived: 0 + 0
            acc[...] = zero
            self.base = 0
            self.state[0] = self.state[1] = DONE
        for k in self._order():
            state = self.state[k]
            if state == DONE:
                continue
            if state == HELD:
                np.add(acc, self.held[k], out=acc)
            else:  # never arrived: zeros, in its turn
                np.add(acc, zero, out=acc)
            self.state[k] = DONE
        return self.acc, self.lod


__all__ = ["ADD", "BASE", "CHUNK_BYTES", "HOLD", "MIN_BYTES", "Arrivals", "SumPlan", "TornSum", "find_plans"]
