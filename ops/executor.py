"""`Executor`: runs a block of a `Program` op by op with the registered kernels.

    exe = Executor(seed=0)
    exe.run(startup, scope=scope)
    loss, = exe.run(main, feed={"x": x, "y": y}, fetch_list=["mean_0.tmp_0"], scope=scope)

Feed values (numpy arrays, `LoDTensor`s, `SelectedRows`) are bound by name in the scope
before the block runs (arrays are wrapped, not copied); `feed` / `fetch` ops a program
carries are honoured. Fetched tensors come back as read-only numpy views (SelectedRows
as themselves). Temporaries stay in the scope after a run, which is what lets a pserver
read what a block produced.

Freeing dead temporaries (`Executor(free_dead=True)`, which a `Session` and a pserver
use): a liveness pass, worked out once per prepared block, lists after which op each
temporary is last read; the executor then drops it from the scope there, so a big
grad or activation does not stay alive (and count in the peak) past its last reader,
and a kernel may compute into a dying input's array instead of a new one
(`OpContext.reusable_input`, same bits). It frees only what no one outside the block can
want: never a persistable var, a fetch target of the run, a var any other block of the
program names, or a var the block writes last (what a block produces for the RPC layer
or the caller, a pserver's prefetch output); a queued send keeps its own reference. It
applies to the run's own block and, on a sync pserver (`RunContext.update_in_place`),
to the blocks `listen_and_serv` runs; never to a loop body or another control-flow
sub-block. Without `free_dead` (the default), temporaries stay in the scope after a
run, as in Paddle.

Releasing a param the step replaces (issue 30, `Liveness.released`): in a sync trainer
program (a block with a `fetch_barrier`), a param is received wholly every step, by a
`recv` of it or a `concat` of its received blocks; from its last read in the step (the
forward `mul`: a `mul_grad` that computes no X@GRAD reads only the shape of Y) until
that write, its value is dead. With `free_dead` it is dropped from the scope there, so
malloc can give its pages to the grads: a trainer then no longer holds every param and
every grad at once. Only when: a `fetch_barrier` comes later in the block, the block has
no control flow and is the run's own (not a served or a sub-block), the var is a dense
`LoDTensor` with a fully known shape, no other block names it, it is not fed or fetched
by the run, and no op between the read and the writer names it as anything but a
shape-only input. The param's array becomes the buffer its grad is computed into
(`Liveness.heirs`: `mul_grad`'s Y@GRAD, through the op's spare), and the writer makes a
new array (the bulk channel receives the blocks straight into it, `ops.rpc.kernels`,
once the grads are sent and freed). A startup program never releases: its params are
written by their initialisers, not read first. If the step fails between the release
and the write, the value is gone (a failed receive would have torn it anyway): a later
run or fetch that needs it fails naming the var and the step (`Executor.lost`), until
something binds it again.

Randomness: an op with a non-zero `seed` attr is reproducible on its own (Paddle's
rule). For `seed` 0 (Paddle: "random"), the executor's `seed` decides: an int makes
the draws a pure function of (executor seed, output var name, how many times this
executor drew for that name) — so two executors with the same seed initialise the same
program identically, whatever the op order — and `None` draws from OS entropy. The
default is seed 0: runs are reproducible unless asked otherwise. While `stream` is an int
(a `Session` sets it to the training step before each step), the count restarts for each
stream and the stream is part of the seed: a step's draws are a pure function of (seed,
name, step, how many times this step drew for that name), so the step a checkpoint
records is the whole RNG state a restored trainer needs to draw what it would have.

A block is prepared once per executor — each op's kernel looked up, a memo for what a
kernel works out about its op's place in the block — and reused until the block's ops
change (`Block.version`) or a kernel is (un)registered: the per-step cost is the kernels,
not the lookups.

When a kernel fails, `ExecutionError` names the block, the op index and type, and each
input's name, shape and dtype, and chains the original exception. An op without a
kernel is an `UnknownOpError` before anything in its block runs.
"""

from __future__ import annotations

import threading
import weakref
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ops.kernels import Frame, OpContext, RunContext, get_kernel
from ops.kernels import registry
from ops.kernels.pcg64 import Rng, default_rng
from ops.kernels.context import SOLE_LOCAL_REFERENCES, SPARES, _references
from ops.kernels.registry import KernelSpec
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows, describe
from transpiler.errors import PsTranspilerError, UnknownOpError
from transpiler.ir import Block, Op, Program, Var
from transpiler.ir.printer import op_line
from transpiler.ir.types import EMPTY_VAR_NAME, VarKind


class ExecutionError(PsTranspilerError):
    """A kernel failed. `block`, `op_index`, `op_type` locate it; `inputs` lists
    `(slot, name, description)` of each input (`fp32[4, 5]`, `missing`, ...)."""

    def __init__(
        self,
        reason: str,
        *,
        block: int,
        op_index: int,
        op_type: str,
        inputs: list[tuple[str, str, str]],
        op_text: str = "",
    ) -> None:
        self.reason = reason
        self.block = block
        self.op_index = op_index
        self.op_type = op_type
        self.inputs = inputs
        lines = [f"block {block}, op {op_index} ({op_type}): {reason}"]
        if inputs:
            lines.append("  inputs: " + "; ".join(f"{slot}={name} {desc}" for slot, name, desc in inputs))
        if op_text:
            lines.append(f"  op: {op_text}")
        super().__init__("\n".join(lines))

    @property
    def headline(self) -> str:
        return str(self).splitlines()[0]


class FetchError(PsTranspilerError):
    """A fetched name has no value after the run."""


_GLOBAL_SCOPE = Scope()


def global_scope() -> Scope:
    """The scope `Executor.run` uses when none is given (Paddle's `global_scope()`)."""
    return _GLOBAL_SCOPE


class Executor:
    """Runs programs; holds the seed policy and the services kernels may need (`env`)."""

    def __init__(self, *, seed: int | None = 0, env: Mapping[str, Any] | None = None, free_dead: bool = False) -> None:
        self.seed = seed
        self.free_dead = bool(free_dead)  # drop temporaries after their last read (module docstring)
        self.env: dict[str, Any] = dict(env or {})
        self._draws: dict[str, int] = {}
        self.stream: int | None = None  # the training step (Session); None: one stream for the executor's life
        self._stream_draws: tuple[int | None, dict[str, int]] = (None, {})
        self._lock = threading.Lock()
        self._prepared: weakref.WeakKeyDictionary[Block, _Prepared] = weakref.WeakKeyDictionary()
        # Released params (module docstring) a failed step left unbound: name -> why. Read
        # when a run or a fetch misses one; an entry whose var is bound again is stale.
        self.lost: dict[str, str] = {}

    # -- public API
    def run(
        self,
        program: Program,
        feed: Mapping[str, Any] | None = None,
        fetch_list: Iterable[str | Var] | None = None,
        scope: Scope | None = None,
        block_id: int = 0,
        *,
        return_numpy: bool = True,
        env: Mapping[str, Any] | None = None,
        update_in_place: bool = False,
        concurrent_readers: bool = False,
    ) -> list[Any]:
        """Run block `block_id` of `program` in `scope` (the global scope by default)
        and return the values of `fetch_list`. `update_in_place` and `concurrent_readers`
        run it as a pserver runs its optimize blocks (`RunContext`: a sync pserver sets
        both, an async one the second): `pstranspile calibrate` measures either path."""
        scope = global_scope() if scope is None else scope
        block = program.block(block_id)
        for name, value in (feed or {}).items():
            scope.set_var(name, _feed_value(value, block.find_var(name)))
        fetches = list(fetch_list or ())
        run = RunContext(
            program,
            env={**self.env, **(env or {})},
            rng_factory=self.rng,
            run_block=lambda idx, sc, parent: self._run_block(run, program.block(idx), sc, parent),
        )
        # Never freed or released: what the run fetches, and what it is fed.
        run.keep = frozenset(item.name if isinstance(item, Var) else str(item) for item in fetches) | frozenset(feed or ())
        run.update_in_place, run.concurrent_readers = update_in_place, concurrent_readers
        self._run_block(run, block, scope, None, top=True)
        return [self._fetch(scope, item, return_numpy) for item in fetches]

    def rng(self, key: str) -> Rng:
        """The generator for a `seed`-0 draw keyed by `key` (see the module docstring)."""
        if self.seed is None:
            return default_rng()
        seed = int(self.seed) & 0xFFFF_FFFF_FFFF_FFFF
        with self._lock:
            stream = self.stream
            if stream is None:
                count = self._draws.get(key, 0)
                self._draws[key] = count + 1
                return default_rng([seed, zlib.crc32(key.encode()), count])
            if self._stream_draws[0] != stream:
                self._stream_draws = (stream, {})
            draws = self._stream_draws[1]
            count = draws.get(key, 0)
            draws[key] = count + 1
        return default_rng([seed, zlib.crc32(key.encode()), count, int(stream) & 0xFFFF_FFFF_FFFF_FFFF])

    # -- internals
    def _run_block(self, run: RunContext, block: Block, scope: Scope, parent: Frame | None, top: bool = False) -> None:
        frame = Frame(block, scope, parent)
        prepared = self._prepare(block)
        liveness = prepared.liveness(block) if self.free_dead else None
        if liveness is not None and not (top or (run.update_in_place and liveness.served)):
            liveness = None
        keep = run.keep
        released: dict[str, int] = {}  # this run's released params not yet written again -> op index
        for i, (op, spec, memo) in enumerate(prepared.steps):
            # Done by whoever filled `skip_ops`: a pserver's sum on arrival, or a trainer's
            # `fetch_barrier` receiving params early (it adds the `concat`s after it, so
            # `skip_ops` is read afresh for each op).
            skip = run.skip_ops
            if skip and (block.idx, i) in skip:
                continue
            dying = EMPTY if liveness is None else liveness.dying[i]
            if keep and dying:
                dying = dying - keep
            try:
                spec.fn(OpContext(op, frame, run, spec, memo, dying))
            except (ExecutionError, UnknownOpError) as exc:  # from a sub-block: its report names the place
                self._note_lost(block, scope, released, i)
                if isinstance(exc, ExecutionError) and self.lost:
                    raise self._explained(exc, scope) from exc.__cause__
                raise
            except Exception as exc:
                self._note_lost(block, scope, released, i)
                raise self._explained(_execution_error(block, i, op, scope, exc), scope) from exc
            if released:
                for name in op.output_names:
                    released.pop(name, None)
            if liveness is not None and i in liveness.heir_slots:
                _drop_unclaimed(memo, liveness.heir_slots[i])
            if dying:
                self._free(prepared, liveness, i, op, scope, dying)
                if liveness.released and dying & liveness.released:
                    released.update((name, i) for name in dying & liveness.released)
        if top and self.lost:
            self.lost = {name: why for name, why in self.lost.items() if scope.find_var(name) is None}

    def _note_lost(self, block: Block, scope: Scope, released: dict[str, int], failed: int) -> None:
        """A step failed at op `failed` after releasing params it had not written again:
        remember why they are unbound, for the next run or fetch that misses them."""
        step = "" if self.stream is None else f" of step {self.stream}"
        for name, index in released.items():
            if scope.find_var(name) is None:
                self.lost[name] = (f"var {name!r} has no value: it was released after op {index} "
                                   f"({block.ops[index].type}) of block {block.idx}{step}, to be received again later in "
                                   f"the step, and the step failed at op {failed} ({block.ops[failed].type}) before that; "
                                   "restore the params (a checkpoint, or the startup program) before running again")

    def _explained(self, error: ExecutionError, scope: Scope) -> ExecutionError:
        """`error` with the reason of a lost input (a released param of a failed step) first."""
        missing = [self.lost[name] for _, name, desc in error.inputs
                   if desc == "missing" and name in self.lost and scope.find_var(name) is None]
        if not missing:
            return error
        return ExecutionError(missing[0] + "; " + error.reason, block=error.block, op_index=error.op_index,
                              op_type=error.op_type, inputs=error.inputs)

    @staticmethod
    def _free(prepared: _Prepared, liveness: Liveness, index: int, op: Op, scope: Scope, dying: frozenset[str]) -> None:
        """Drop op `index`'s dying inputs from the scope. An array the op that wrote it
        computes into a recycled buffer (`OpContext.output_buffer`) goes back to that op as
        its spare when nothing else holds it (not this op's output, no view, no queued
        send): next step it is computed into again instead of a new array (no page faults
        where malloc returns big blocks to the kernel). A released param's array goes the
        same way to the op computing its grad (`Liveness.heirs`)."""
        for name in dying:
            owner = scope.find_scope(name)
            if owner is None:
                continue
            value = owner.local_var(name)
            owner.erase(name)
            heir = liveness.heirs.get(name)
            writer = heir or liveness.writers.get(name)
            if writer is None or type(value) is not LoDTensor:
                continue
            memo = prepared.steps[writer[0]][2]
            key = writer[1:]
            # A released param's array takes the heir's slot even when it holds a spare
            # (that one is then freed: the grad needs one buffer, not two), and even before
            # the heir ever ran (the first step): else that step's grad is a new array,
            # which malloc may place beside the freed param instead of in it (a peak of a
            # whole param more, depending on what else the heap holds). The run drops it
            # again if the heir's kernel does not take it (`_drop_unclaimed`).
            spares = memo.setdefault(SPARES, {}) if heir is not None else memo.get(SPARES)
            if spares is None or (heir is None and (key not in spares or spares[key] is not None)):
                continue
            array = value.array
            del value
            # Only an array nothing else holds (a queued send's views keep it: dropped, it
            # is freed when the send lets go, not kept past it as a spare). A released
            # param's goes to its heir even while others hold it: an early receive's thread
            # may still hold views of the array it just filled for a moment after the op
            # went on. The heir's `output_buffer` counts the references again when it takes
            # it, and the run drops it after the heir (`_drop_unclaimed`): kept a step at most.
            if heir is not None or _references(array) == SOLE_LOCAL_REFERENCES:
                spares[key] = array

    def _prepare(self, block: Block) -> _Prepared:
        """The block's prepared form, rebuilt when its ops or the kernels changed."""
        ops = block.ops
        prepared = self._prepared.get(block)
        if prepared is None or not prepared.fits(block, ops):
            prepared = _Prepared(block, ops)
            self._prepared[block] = prepared
        return prepared

    def _fetch(self, scope: Scope, item: str | Var, return_numpy: bool) -> Any:
        name = item.name if isinstance(item, Var) else str(item)
        value = scope.find_var(name)
        if value is None:
            if name in self.lost:
                raise FetchError(f"fetch: {self.lost[name]}")
            raise FetchError(f"fetch: var {name!r} has no value in the scope after the run")
        if not return_numpy:
            return value
        if isinstance(value, LoDTensor):
            view = value.array.view()
            view.flags.writeable = False
            return view
        return value  # SelectedRows and other objects come back as they are


class _Prepared:
    """A block's ops with their kernels and memos, as of `Block.version` and the registry's
    generation. Built whole before anything runs: an op without a kernel is an error
    before the block's first op."""

    __slots__ = ("ops", "version", "generation", "steps", "_liveness")

    def __init__(self, block: Block, ops: tuple[Op, ...]) -> None:
        self.ops = ops
        self.version = block.version
        self.steps: tuple[tuple[Op, KernelSpec, dict[str, Any]], ...] = tuple(
            (op, _kernel_for(block, i, op), {}) for i, op in enumerate(ops)
        )
        # after the lookups: one may have imported a family registered by name (`register_lazily`)
        self.generation = registry.generation()
        self._liveness: Liveness | None = None

    def liveness(self, block: Block) -> Liveness:
        """The block's liveness, worked out on first use and again when any block of the
        program changed (it depends on what the other blocks name)."""
        program = block.program
        signature = tuple(b.version for b in program.blocks) if program is not None else ()
        found = self._liveness
        if found is None or found.signature != signature:
            found = self._liveness = Liveness(block, self.ops, signature)
        return found

    def fits(self, block: Block, ops: tuple[Op, ...]) -> bool:
        return self.ops is ops and self.version == block.version and self.generation == registry.generation()


EMPTY: frozenset[str] = frozenset()
# Ops whose sub-blocks the executor may free temporaries in (when the run is a sync
# pserver's): each block runs once per round, its inputs put in the scope afresh.
SERVED_BY = ("listen_and_serv",)


class Liveness:
    """Which temporaries of a block die after which op: `dying[i]` are the vars op `i`
    reads last, that the executor may drop from the scope after it (see the module
    docstring for what is never freed). `served`: a block `listen_and_serv` runs.
    `released`: the params among them, dropped because a later op writes them whole
    (module docstring)."""

    __slots__ = ("dying", "served", "signature", "writers", "released", "heirs", "heir_slots")

    def __init__(self, block: Block, ops: tuple[Op, ...], signature: tuple[int, ...]) -> None:
        self.signature = signature
        program = block.program
        elsewhere: set[str] = set()  # named by an op of any other block
        served = False
        loop_body = False
        if program is not None:
            for other in program.blocks:
                for op in other.ops:
                    if other is block:
                        continue
                    # What `listen_and_serv` names are the vars it receives into the scope
                    # and serves from it before its blocks run: not a later reader.
                    if op.type not in SERVED_BY:
                        elsewhere.update(op.input_names)
                        elsewhere.update(op.output_names)
                    if block.idx in op.sub_block_indices():
                        if op.type in SERVED_BY:
                            served = True
                        else:
                            loop_body = True
        self.served = served and not loop_body
        last: dict[str, tuple[int, bool]] = {}  # name -> (index of its last access, was a read)
        produced: dict[str, int] = {}  # name -> index of the block's first op writing it
        for i, op in enumerate(ops):
            for name in op.input_names:
                last[name] = (i, True)
            for name in op.output_names:
                last[name] = (i, False)
                produced.setdefault(name, i)
        dying: list[set[str]] = [set() for _ in ops]
        # name -> (op index, slot, position among the slot's non-empty args) of the op that
        # wrote the value the var holds when it dies: its output buffer takes the array back
        self.writers: dict[str, tuple[int, str, int]] = {}
        for name, (i, read) in last.items():
            if not read or not name or name == EMPTY_VAR_NAME or name in elsewhere or ops[i].sub_block_indices():
                continue
            # The run's own block frees only what it produced itself (a feed, or a var a
            # caller put in the scope, stays); a served block also what the RPC layer
            # puts in the scope for it every round (the trainers' grads).
            if not self.served and produced.get(name, i) >= i:
                continue
            var = block.find_var(name)
            if var is None or var.persistable:
                continue
            dying[i].add(name)
            for j in range(i - 1, -1, -1):
                found = _output_slot(ops[j], name)
                if found is not None:
                    self.writers[name] = (j, *found)
                    break
        self.released: frozenset[str] = EMPTY
        # released param -> (op index, slot, position) of the op whose output takes its
        # array as a spare: its grad, computed later in the step (`mul_grad`'s Y@GRAD)
        self.heirs: dict[str, tuple[int, str, int]] = {}
        if not self.served and not loop_body:
            for name, i in _replaced_params(block, ops, elsewhere).items():
                dying[i].add(name)
                self.released |= {name}
                heir = _heir(ops, name, i)
                if heir is not None:
                    self.heirs[name] = heir
        self.heir_slots: dict[int, tuple[str, int]] = {j: (slot, k) for j, slot, k in self.heirs.values()}
        self.dying: tuple[frozenset[str], ...] = tuple(frozenset(d) if d else EMPTY for d in dying)


# Ops that write their output whole and read nothing of what it held (`Liveness.released`).
WHOLE_WRITERS = ("recv", "concat")
# Inputs an op names but reads only the declared shape of, unless it computes the given
# output: `mul_grad` needs Y's values for X@GRAD only.
SHAPE_ONLY_UNLESS = {"mul_grad": {"Y": "X@GRAD"}}


# An op's output slot whose value has the shape and dtype of an input (the grad of it).
GRAD_SLOTS = {"mul_grad": {"Y": "Y@GRAD"}}


def _drop_unclaimed(memo: dict[str, Any], key: tuple[str, int]) -> None:
    """After a heir op ran: a released param's array its kernel did not compute into (a
    mixed-dtype `mul_grad`, say) is not kept as a spare past it, so the param's memory is
    freed, not held until the next step."""
    spares = memo.get(SPARES)
    if spares and spares.get(key) is not None:
        spares[key] = None


def _heir(ops: tuple[Op, ...], name: str, released: int) -> tuple[int, str, int] | None:
    """The first op after `released` that computes the grad of `name` (`GRAD_SLOTS`)
    before any op writes `name`: (its index, the grad's slot, 0). Its kernel computes into
    the released array (`OpContext.output_buffer`) instead of a new one, so the memory
    goes from the param to its grad whatever malloc would have done."""
    for j in range(released + 1, len(ops)):
        op = ops[j]
        if name in op.output_names:
            return None
        for source, target in GRAD_SLOTS.get(op.type, {}).items():
            args = [n for n in op.outputs.get(target, ()) if n and n != EMPTY_VAR_NAME]
            if name in op.inputs.get(source, ()) and len(args) == 1:
                return j, target, 0
    return None


def _reads(op: Op) -> set[str]:
    """The vars whose values `op` reads (its inputs but the shape-only ones)."""
    unless = SHAPE_ONLY_UNLESS.get(op.type)
    if unless is None:
        return set(op.input_names)
    names = set()
    for slot, args in op.inputs.items():
        needed_for = unless.get(slot)
        if needed_for is not None and not any(n and n != EMPTY_VAR_NAME for n in op.outputs.get(needed_for, ())):
            continue
        names.update(args)
    return names


def _replaced_params(block: Block, ops: tuple[Op, ...], elsewhere: set[str]) -> dict[str, int]:
    """Persistable vars the block reads and later writes whole without reading them in
    between (a sync trainer's params, received each step): name -> the index of the op
    that reads it last before that write (module docstring for the conditions)."""
    if not any(op.type == "fetch_barrier" for op in ops) or any(op.sub_block_indices() for op in ops):
        return {}
    found: dict[str, int] = {}
    last_read: dict[str, int] = {}  # name -> its last read, while no op wrote it since
    for i, op in enumerate(ops):
        reads = _reads(op)
        for name in op.output_names:
            read = last_read.pop(name, None)
            if read is None or name in reads or not _whole_write(op, name) or name in elsewhere:
                continue
            var = block.find_var(name)
            if (var is not None and var.persistable and var.kind is VarKind.LOD_TENSOR
                    and var.shape is not None and all(d >= 0 for d in var.shape)):
                found.setdefault(name, read)
        for name in reads:
            if name and name != EMPTY_VAR_NAME:
                last_read[name] = i
    return found


def _whole_write(op: Op, name: str) -> bool:
    """True when `op` (a `WHOLE_WRITERS` op) writes `name` whole: a `recv` that runs
    (`do_not_run` 0) into its `Out`, a `concat` into its `Out`."""
    if op.type not in WHOLE_WRITERS or name not in op.outputs.get("Out", ()):
        return False
    return op.type != "recv" or not int(op.attr("do_not_run", 0) or 0)


def _output_slot(op: Op, name: str) -> tuple[str, int] | None:
    """(slot, position among its non-empty args) where `op` writes `name`, or None."""
    for slot, args in op.outputs.items():
        names = [n for n in args if n and n != EMPTY_VAR_NAME]
        if name in names:
            return slot, names.index(name)
    return None


def _kernel_for(block: Block, index: int, op: Op) -> KernelSpec:
    try:
        return get_kernel(op.type)
    except UnknownOpError:
        raise UnknownOpError(f"no kernel for op {op.type!r} (block {block.idx}, op {index})") from None


def _feed_value(value: Any, var: Var | None) -> Any:
    """A feed value as a scope value: arrays are wrapped without copying; Python lists
    and scalars take the declared dtype."""
    if isinstance(value, (LoDTensor, SelectedRows)):
        return value
    if isinstance(value, np.ndarray):
        return LoDTensor(value)
    dtype = var.dtype.to_numpy() if var is not None and var.dtype is not None else None
    return LoDTensor(np.asarray(value, dtype=dtype))


def _execution_error(block: Block, index: int, op: Op, scope: Scope, exc: Exception) -> ExecutionError:
    inputs = []
    for slot, names in op.inputs.items():
        for name in names:
            try:
                found = describe(scope.find_var(name))
            except PsTranspilerError:  # a var whose early receive failed (ops.rpc.early_recv)
                found = "not received"
            inputs.append((slot, name, found))
    reason = str(exc) if isinstance(exc, PsTranspilerError) else f"{type(exc).__name__}: {exc}"
    try:
        text = op_line(op, index)
    except Exception:  # pragma: no cover - the dump never fails on a loaded op
        text = op.type
    return ExecutionError(reason, block=block.idx, op_index=index, op_type=op.type, inputs=inputs, op_text=text)
