"""What a kernel sees: `OpContext` (one op: its inputs, attrs, outputs) inside a
`RunContext` (one `Executor.run`: the program, the executor's services, the RNG policy).

Kernels read inputs with `ctx.input(slot)` (a numpy array), `ctx.value(slot)` (the raw
scope value: `LoDTensor`, `SelectedRows`, ...), attrs with `ctx.attr(name)` (Paddle's
default when the program omits the attr), and write with `ctx.set_output(slot, value)`.
A write goes where Paddle's executor creates the var (`Frame.write`): a persistable var
in the run's outermost scope, else the scope of the innermost running block that
declares it, else the nearest scope that already holds it, else the current scope — so
`assign` in a conditional sub-block updates the global `learning_rate`, while the
sub-block's own temporaries die with its child scope.

`RunContext.env` is the hook for services the runtime plugs in (an RPC client under
`env["rpc"]`, the trainer id, ...); the numpy kernels never touch it.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ops.kernels.pcg64 import Rng, default_rng
from ops.tensor import LoDTensor, SelectedRows
from transpiler.errors import PsTranspilerError
from transpiler.ir.types import EMPTY_VAR_NAME, VarKind

if TYPE_CHECKING:
    from ops.kernels.registry import KernelSpec
    from ops.scope import Scope
    from transpiler.ir import Block, Op, Program, Var

_MISSING: Any = object()
SPARES = "spares"  # the memo key of an op's recyclable output arrays, (slot, i) -> array or None


def _references(array: np.ndarray) -> int:
    return sys.getrefcount(array)


def _references_of_a_sole_local() -> int:
    """What `_references` reports for an array one local variable alone holds (the
    interpreter's own references differ between Python versions, so measure them)."""
    probe = np.empty(0)
    return _references(probe)


# CPython only: elsewhere reference counts say nothing and every output is a new array.
SOLE_LOCAL_REFERENCES = _references_of_a_sole_local() if sys.implementation.name == "cpython" else -1


BATCH_SHARD = "batch_shard"
"""`RunContext.env` key: `(trainer_id, trainers)` of a sync trainer that runs rows
`[i*b, (i+1)*b)` of every global batch (`Role.shard`, batch split evenly). The dropout
mask of an element is a function of the op's per-run key and the element's index in the
*global* batch, so N trainers draw, between them, exactly the mask local training draws
on the whole batch. Here rather than beside dropout (`ops.kernels.transformer`): a process
loads that family only to run its ops."""


class KernelError(PsTranspilerError):
    """A kernel met inputs or attrs it cannot run with (the executor adds where)."""


class Frame:
    """One running block: its scope, and the frame of the block that started it."""

    __slots__ = ("block", "scope", "parent")

    def __init__(self, block: Block, scope: Scope, parent: Frame | None = None) -> None:
        self.block = block
        self.scope = scope
        self.parent = parent

    def write(self, name: str, value: Any) -> Any:
        """Bind `name` where Paddle's executor would have created it: a persistable var in
        the run's outermost scope; else the scope of the innermost running block that
        declares it; else the nearest scope holding it; else this frame's scope. Returns
        the value `name` had in that scope (None if none)."""
        return self.target(name).exchange(name, value)

    def target(self, name: str) -> Scope:
        """The scope `write` binds `name` in."""
        frame: Frame | None = self
        while frame is not None:
            block = frame.block
            if block.has_var(name):
                outer = frame.parent is not None and block.var(name).persistable
                return frame.outermost().scope if outer else frame.scope
            frame = frame.parent
        owner = self.scope.find_scope(name)
        return owner if owner is not None else self.scope

    def outermost(self) -> Frame:
        frame = self
        while frame.parent is not None:
            frame = frame.parent
        return frame


class RunContext:
    """State shared by every op of one `Executor.run` (and the sub-blocks it starts)."""

    def __init__(
        self,
        program: Program,
        *,
        env: Mapping[str, Any] | None = None,
        rng_factory: Callable[[str], Rng] | None = None,
        run_block: Callable[[int, Scope, Frame | None], None] | None = None,
    ) -> None:
        self.program = program
        self.env: dict[str, Any] = dict(env or {})
        # True when whoever runs the blocks guarantees that nothing reads a param while a
        # block updating it runs (a sync pserver: every fetch, prefetch and checkpoint of a
        # round is over before its optimize blocks start). A sparse update then changes the
        # rows of the param in place, as Paddle does, instead of copying the whole table.
        self.update_in_place = False
        # True when other threads read the scope while blocks run (a pserver serving
        # fetches): then a value nothing holds *now* may be taken by a reader mid-update, so
        # `OpContext.may_update_in_place` says no unless `update_in_place` says yes.
        self.concurrent_readers = False
        # The run's fetch targets: never freed after their last read (`ops.executor.Liveness`).
        self.keep: frozenset[str] = frozenset()
        # (block index, op index) of ops the run skips: a sync pserver's `sum`s of received
        # grads it did as they arrived (`ops.rpc.arrival_sum`; the pserver fills it).
        self.skip_ops: set[tuple[int, int]] | frozenset[tuple[int, int]] = frozenset()
        # A buffer of at least n bytes the run lends a kernel for a temporary it drops before
        # it returns, or None (`OpContext.scratch`): a sync pserver lends its idle chunk
        # buffers of sums on arrival while its optimize blocks run (issue 30: sgd's
        # `lr * Grad` piece then takes no memory of its own).
        self.lend_scratch: Callable[[int], np.ndarray | None] | None = None
        self._rng_factory = rng_factory
        self._run_block = run_block

    def run_block(self, block_idx: int, scope: Scope, parent: Frame | None = None) -> None:
        """Run block `block_idx` of this program in `scope` (control-flow kernels use it)."""
        if self._run_block is None:
            raise KernelError("this run cannot start sub-blocks")
        self._run_block(block_idx, scope, parent)

    def rng(self, key: str, seed: int = 0) -> Rng:
        """The generator for one draw: a fresh one seeded with `seed` when non-zero (so the
        same op gives the same numbers on every run, as in Paddle), else the executor's
        stream for `key` (see `Executor`)."""
        if seed:
            return default_rng(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
        if self._rng_factory is None:
            return default_rng([0, zlib.crc32(key.encode())])
        return self._rng_factory(key)


class OpContext:
    """One op being run: slot and attr access for its kernel."""

    __slots__ = ("op", "frame", "run", "spec", "memo", "block", "scope", "dying")

    def __init__(self, op: Op, frame: Frame, run: RunContext, spec: KernelSpec, memo: dict[str, Any] | None = None,
                 dying: frozenset[str] = frozenset()) -> None:
        self.op = op
        # The input vars the executor drops from the scope right after this op (their last
        # read; `ops.executor.Liveness`): their arrays may become this op's outputs.
        self.dying = dying
        self.frame = frame
        self.run = run
        self.spec = spec
        # Facts about the op and its place in the block (its slots' args, does a barrier
        # follow?), kept by the executor for as long as the block is unchanged.
        self.memo: dict[str, Any] = {} if memo is None else memo
        # The frame's, as plain attributes: every input a kernel reads goes through them.
        self.block: Block = frame.block
        self.scope: Scope = frame.scope

    @property
    def type(self) -> str:
        return self.op.type

    @property
    def env(self) -> dict[str, Any]:
        return self.run.env

    # -- attrs
    def attr(self, name: str, default: Any = _MISSING) -> Any:
        """The attr's value, else Paddle's default from the kernel's table, else `default`."""
        value = self.op.attr(name, _MISSING)
        if value is not _MISSING:
            return value
        if name in self.spec.defaults:
            return self.spec.defaults[name]
        if default is not _MISSING:
            return default
        raise KernelError(f"op {self.op.type!r} has no attr {name!r} and Paddle gives it no default")

    def has_attr(self, name: str) -> bool:
        return self.op.has_attr(name)

    # -- inputs
    def input_names(self, slot: str) -> tuple[str, ...]:
        """The slot's args, without Paddle's `@EMPTY@` placeholders (worked out once per
        prepared block: the memo lives as long as the op's slots do)."""
        key = ("in", slot)
        names = self.memo.get(key)
        if names is None:
            names = self.memo[key] = tuple(n for n in self.op.input(slot) if n and n != EMPTY_VAR_NAME)
        return names

    def has_input(self, slot: str) -> bool:
        return bool(self.input_names(slot))

    def value(self, slot: str, i: int = 0) -> Any:
        """The scope value of the slot's `i`-th arg; `KernelError` if absent."""
        names = self.memo.get(("in", slot))
        if names is None:
            names = self.input_names(slot)
        if i >= len(names):
            raise KernelError(f"op {self.op.type!r} needs input slot {slot!r} (arg {i}); it has {list(names)}")
        value = self.scope.find_var(names[i], _MISSING)
        if value is _MISSING or value is None:
            raise KernelError(f"input {slot}={names[i]!r} of op {self.op.type!r} has no value in the scope")
        return value

    def optional_value(self, slot: str, i: int = 0) -> Any:
        names = self.input_names(slot)
        if i >= len(names):
            return None
        return self.scope.find_var(names[i])

    def values(self, slot: str) -> list[Any]:
        return [self.value(slot, i) for i in range(len(self.input_names(slot)))]

    def input(self, slot: str, i: int = 0) -> np.ndarray:
        """The slot's `i`-th arg as a dense numpy array (never a copy)."""
        value = self.value(slot, i)
        return value.array if type(value) is LoDTensor else self.dense(slot, value)

    def optional_input(self, slot: str, i: int = 0) -> np.ndarray | None:
        value = self.optional_value(slot, i)
        return None if value is None else self.dense(slot, value)

    def inputs(self, slot: str) -> list[np.ndarray]:
        return [self.dense(slot, v) for v in self.values(slot)]

    def lod(self, slot: str, i: int = 0) -> tuple[np.ndarray, ...]:
        value = self.optional_value(slot, i)
        return value.lod if isinstance(value, LoDTensor) else ()

    def scalar(self, slot: str) -> Any:
        """A one-element input (a learning rate, a condition) as a numpy scalar."""
        array = self.input(slot)
        if array.size != 1:
            shape = list(array.shape)
            raise KernelError(f"input {slot} of op {self.op.type!r} must hold one element, got shape {shape}")
        return array.reshape(-1)[0]

    def dense(self, slot: str, value: Any) -> np.ndarray:
        """A value `value(slot)` returned as a dense numpy array (a kernel that looked at
        the value first, for SelectedRows, need not look it up again)."""
        if isinstance(value, LoDTensor):
            return value.array
        if isinstance(value, np.ndarray):
            return value
        if isinstance(value, SelectedRows):
            raise KernelError(f"op {self.op.type!r} needs a dense tensor in slot {slot!r}, got SelectedRows")
        raise KernelError(f"op {self.op.type!r} needs a tensor in slot {slot!r}, got {type(value).__name__}")

    # -- declarations
    def decl(self, name: str) -> Var | None:
        """The declaration of `name` in the running block or its ancestors."""
        return self.frame.block.find_var(name)

    def output_decl(self, slot: str, i: int = 0) -> Var | None:
        names = self.output_names(slot)
        return self.decl(names[i]) if i < len(names) else None

    def output_kind(self, slot: str, i: int = 0) -> VarKind | None:
        var = self.output_decl(slot, i)
        return None if var is None else var.kind

    def declared_shape(self, slot: str, i: int = 0) -> tuple[int, ...] | None:
        var = self.output_decl(slot, i)
        return None if var is None else var.shape

    # -- outputs
    def output_names(self, slot: str) -> tuple[str, ...]:
        key = ("out", slot)
        names = self.memo.get(key)
        if names is None:
            names = self.memo[key] = tuple(n for n in self.op.output(slot) if n and n != EMPTY_VAR_NAME)
        return names

    def has_output(self, slot: str) -> bool:
        return bool(self.output_names(slot))

    def set_output(self, slot: str, value: Any, *, lod: Any = None, i: int = 0) -> None:
        """Store `value` (an array is wrapped in a `LoDTensor` with `lod`) as the slot's
        `i`-th output. A slot the op leaves empty (`X@GRAD=[]`) is skipped."""
        names = self.output_names(slot)
        if i >= len(names):
            return
        if isinstance(value, np.ndarray) or np.isscalar(value):
            value = LoDTensor(np.asarray(value), lod)
        displaced = self.frame.write(names[i], value)
        spares = self.memo.get(SPARES)
        if (spares is not None and (slot, i) in spares and isinstance(displaced, LoDTensor)
                and displaced.array is not getattr(value, "array", None)):  # not an update in place
            spares[(slot, i)] = displaced.array

    def may_update_in_place(self, slot: str, out_slot: str) -> bool:
        """Whether the op may write its `out_slot` result into input `slot`'s own array, as
        Paddle does (ParamOut is Param): the op writes `out_slot` back to the same var, the
        array owns its memory and is writeable (not a received buffer, not a view), and
        either the run orders every read before the updates (`RunContext.update_in_place`:
        a sync pserver) or no reader can tell: no other thread reads the scope meanwhile and
        nothing but the scope holds the var's tensor or the tensor's array (no fetched view,
        no alias under another name, no tensor a caller kept). A kernel asks before it binds
        any of the arrays itself: its own references would count as another holder's."""
        names = self.input_names(slot)
        if len(names) != 1 or names != self.output_names(out_slot):
            return False
        tensor = self.scope.find_var(names[0])
        if type(tensor) is not LoDTensor:
            return False
        array = tensor.array
        if array.base is not None or not array.flags.writeable:
            return False
        if self.run.update_in_place:
            return True
        # Each is held once by its owner (the scope's dict; the tensor) and once here.
        return (not self.run.concurrent_readers and array.flags.c_contiguous
                and _references(tensor) == SOLE_LOCAL_REFERENCES + 1
                and _references(array) == SOLE_LOCAL_REFERENCES + 1)

    def scratch(self, size: int, dtype: np.dtype) -> np.ndarray:
        """`size` elements of `dtype` for a temporary the kernel drops before it returns (its
        values undefined): the run's lent buffer when it has one that big
        (`RunContext.lend_scratch`), else a new array."""
        dtype = np.dtype(dtype)
        nbytes = size * dtype.itemsize
        lent = self.run.lend_scratch(nbytes) if self.run.lend_scratch is not None else None
        if lent is None:
            return np.empty(size, dtype)
        return lent.reshape(-1).view(np.uint8)[:nbytes].view(dtype)

    def reusable_input(self, slot: str, shape: tuple[int, ...], dtype: np.dtype, i: int = 0) -> np.ndarray | None:
        """The array of input `slot`'s `i`-th arg, for the kernel to compute an output into
        (`out=`), when nobody can see the difference: the executor drops the var right
        after this op (`dying`), its value is a `LoDTensor` whose array owns its memory, is
        writeable and C-contiguous with `shape` and `dtype`, and nothing but the scope
        holds the tensor or the array (no fetched view, no alias, no queued send, no other
        var). Else None: the kernel computes into a new array. Ask before binding the
        input: the kernel's own references would count as another holder's."""
        if not self.dying:
            return None
        names = self.input_names(slot)
        if i >= len(names) or names[i] not in self.dying or self.op.input_names.count(names[i]) > 1:
            return None
        tensor = self.scope.find_var(names[i])
        if type(tensor) is not LoDTensor:
            return None
        array = tensor.array
        if not _fits(array, shape, dtype):
            return None
        # Each is held once by its owner (the scope's dict; the tensor) and once here.
        if _references(tensor) != SOLE_LOCAL_REFERENCES + 1 or _references(array) != SOLE_LOCAL_REFERENCES + 1:
            return None
        return array

    def current_output(self, slot: str, shape: tuple[int, ...], dtype: np.dtype, i: int = 0) -> np.ndarray | None:
        """The array the slot's `i`-th output var holds now, for the kernel to compute the
        new value into (`out=`) instead of a new array, when no reader can tell: a
        `LoDTensor` whose array owns its memory, is writeable and C-contiguous with `shape`
        and `dtype`, no input of the op names the var, and either the run orders every read
        before the updates (`RunContext.update_in_place`) or no other thread reads the scope
        and nothing but the scope holds the tensor or the array (no fetched view, no alias,
        no tensor a caller kept). Else None. (A trainer's `concat` of the param blocks it
        received, into the param it already holds.)"""
        names = self.output_names(slot)
        if i >= len(names) or names[i] in self.op.input_names:
            return None
        tensor = self.scope.find_var(names[i])
        if type(tensor) is not LoDTensor:
            return None
        array = tensor.array
        if not _fits(array, shape, dtype):
            return None
        if self.run.update_in_place:
            return array
        if self.run.concurrent_readers:
            return None
        # Each is held once by its owner (the scope's dict; the tensor) and once here.
        if _references(tensor) != SOLE_LOCAL_REFERENCES + 1 or _references(array) != SOLE_LOCAL_REFERENCES + 1:
            return None
        return array

    def unshared_array(self, name: str) -> np.ndarray | None:
        """The array var `name` holds, for a kernel to overwrite with the var's next value
        before the op that writes it runs, when no reader can tell: a `LoDTensor` whose
        array owns its memory, is writeable and C-contiguous, no other thread reads the
        scope, and nothing but the scope holds the tensor or the array (no fetched view, no
        alias, no tensor a caller kept, no queued send). Else None. (A trainer's
        `fetch_barrier` receiving the param blocks straight into the param that the
        following `concat` writes.) The caller must not bind the array before asking."""
        if self.run.concurrent_readers or self.run.update_in_place:
            return None
        tensor = self.scope.find_var(name)
        if type(tensor) is not LoDTensor:
            return None
        array = tensor.array
        if array.base is not None or not array.flags.writeable or not array.flags.c_contiguous or array.ndim == 0:
            return None
        # Each is held once by its owner (the scope's dict; the tensor) and once here.
        if _references(tensor) != SOLE_LOCAL_REFERENCES + 1 or _references(array) != SOLE_LOCAL_REFERENCES + 1:
            return None
        return array

    def output_buffer(self, slot: str, shape: tuple[int, ...], dtype: np.dtype, i: int = 0) -> np.ndarray:
        """An array of `shape` and `dtype` for the kernel to compute the slot's `i`-th
        output into (`out=`) and then `set_output`: the array this op's last output in
        that slot displaced from the scope, when nothing else holds it any more, else a
        new one. Outputs stay values that are replaced, never mutated in place: the
        recycled array was unreachable (out of the scope, no view, no fetch result, no
        queued send refers to it), so a reader holding an old value keeps it intact, and
        the arithmetic into it is the same as into a new array, bit for bit. Writing a
        new array every step costs page faults for large tensors (a param, its moments);
        recycling costs one spare array per recycled output."""
        spares = self.memo.get(SPARES)
        if spares is None:
            spares = self.memo.setdefault(SPARES, {})
        # `pop` is atomic: two threads running the op at once never get the same array.
        spare = spares.pop((slot, i), None)
        spares.setdefault((slot, i), None)  # from now on, set_output keeps what it displaces
        if spare is not None and _references(spare) == SOLE_LOCAL_REFERENCES and _fits(spare, shape, dtype):
            return spare
        return np.empty(shape, dtype)

    def set_var(self, name: str, value: Any, *, lod: Any = None) -> None:
        """Store `value` under an output arg `name` (for slots whose args line up with
        another slot's and may hold `@EMPTY@` placeholders, like `concat_grad`'s)."""
        if not name or name == EMPTY_VAR_NAME:
            return
        if isinstance(value, np.ndarray) or np.isscalar(value):
            value = LoDTensor(np.asarray(value), lod)
        self.frame.write(name, value)

    def set_outputs(self, slot: str, values: list[Any], *, lods: list[Any] | None = None) -> None:
        names = self.output_names(slot)
        if len(values) != len(names):
            raise KernelError(
                f"op {self.op.type!r} computed {len(values)} outputs for slot {slot!r} of {len(names)} args"
            )
        for i, value in enumerate(values):
            self.set_output(slot, value, lod=None if lods is None else lods[i], i=i)

    # -- randomness
    def rng(self) -> Rng:
        """The generator for this op (its `seed` attr, else the executor's stream keyed by
        the op's first output name)."""
        names = self.op.output_names
        return self.run.rng(names[0] if names else self.op.type, int(self.attr("seed", 0)))


def _fits(array: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> bool:
    """`array` owns its memory (a view's base may be held elsewhere), is writeable and
    C-contiguous, with `shape` and `dtype`."""
    flags = array.flags
    return (
        array.base is None
        and flags.writeable
        and flags.c_contiguous
        and array.shape == tuple(shape)
        and array.dtype == dtype
    )
