"""`Executor`: runs a block of a `Program` op by op with the registered kernels.

    exe = Executor(seed=0)
    exe.run(startup, scope=scope)
    loss, = exe.run(main, feed={"x": x, "y": y}, fetch_list=["mean_0.tmp_0"], scope=scope)

Feed values (numpy arrays, `LoDTensor`s, `SelectedRows`) are bound by name in the scope
before the block runs (arrays are wrapped, not copied); `feed` / `fetch` ops a program
carries are honoured. Fetched tensors come back as read-only numpy views (SelectedRows
as themselves). Temporaries stay in the scope after a run, which is what lets a pserver
read what a block produced.

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
from ops.kernels.registry import KernelSpec
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows, describe
from transpiler.errors import PsTranspilerError, UnknownOpError
from transpiler.ir import Block, Op, Program, Var
from transpiler.ir.printer import op_line


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

    def __init__(self, *, seed: int | None = 0, env: Mapping[str, Any] | None = None) -> None:
        self.seed = seed
        self.env: dict[str, Any] = dict(env or {})
        self._draws: dict[str, int] = {}
        self.stream: int | None = None  # the training step (Session); None: one stream for the executor's life
        self._stream_draws: tuple[int | None, dict[str, int]] = (None, {})
        self._lock = threading.Lock()
        self._prepared: weakref.WeakKeyDictionary[Block, _Prepared] = weakref.WeakKeyDictionary()

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
    ) -> list[Any]:
        """Run block `block_id` of `program` in `scope` (the global scope by default)
        and return the values of `fetch_list`."""
        scope = global_scope() if scope is None else scope
        block = program.block(block_id)
        for name, value in (feed or {}).items():
            scope.set_var(name, _feed_value(value, block.find_var(name)))
        run = RunContext(
            program,
            env={**self.env, **(env or {})},
            rng_factory=self.rng,
            run_block=lambda idx, sc, parent: self._run_block(run, program.block(idx), sc, parent),
        )
        self._run_block(run, block, scope, None)
        return [self._fetch(scope, item, return_numpy) for item in (fetch_list or ())]

    def rng(self, key: str) -> np.random.Generator:
        """The generator for a `seed`-0 draw keyed by `key` (see the module docstring)."""
        if self.seed is None:
            return np.random.default_rng()
        seed = int(self.seed) & 0xFFFF_FFFF_FFFF_FFFF
        with self._lock:
            stream = self.stream
            if stream is None:
                count = self._draws.get(key, 0)
                self._draws[key] = count + 1
                return np.random.default_rng([seed, zlib.crc32(key.encode()), count])
            if self._stream_draws[0] != stream:
                self._stream_draws = (stream, {})
            draws = self._stream_draws[1]
            count = draws.get(key, 0)
            draws[key] = count + 1
        return np.random.default_rng([seed, zlib.crc32(key.encode()), count, int(stream) & 0xFFFF_FFFF_FFFF_FFFF])

    # -- internals
    def _run_block(self, run: RunContext, block: Block, scope: Scope, parent: Frame | None) -> None:
        frame = Frame(block, scope, parent)
        for i, (op, spec, memo) in enumerate(self._prepare(block).steps):
            try:
                spec.fn(OpContext(op, frame, run, spec, memo))
            except (ExecutionError, UnknownOpError):
                raise  # from a sub-block: its report already names the precise place
            except Exception as exc:
                raise _execution_error(block, i, op, scope, exc) from exc

    def _prepare(self, block: Block) -> _Prepared:
        """The block's prepared form, rebuilt when its ops or the kernels changed."""
        ops = block.ops
        prepared = self._prepared.get(block)
        if prepared is None or not prepared.fits(block, ops):
            prepared = _Prepared(block, ops)
            self._prepared[block] = prepared
        return prepared

    @staticmethod
    def _fetch(scope: Scope, item: str | Var, return_numpy: bool) -> Any:
        name = item.name if isinstance(item, Var) else str(item)
        value = scope.find_var(name)
        if value is None:
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

    __slots__ = ("ops", "version", "generation", "steps")

    def __init__(self, block: Block, ops: tuple[Op, ...]) -> None:
        self.ops = ops
        self.version = block.version
        self.generation = registry.generation()
        self.steps: tuple[tuple[Op, KernelSpec, dict[str, Any]], ...] = tuple(
            (op, _kernel_for(block, i, op), {}) for i, op in enumerate(ops)
        )

    def fits(self, block: Block, ops: tuple[Op, ...]) -> bool:
        return self.ops is ops and self.version == block.version and self.generation == registry.generation()


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
            inputs.append((slot, name, describe(scope.find_var(name))))
    reason = str(exc) if isinstance(exc, PsTranspilerError) else f"{type(exc).__name__}: {exc}"
    try:
        text = op_line(op, index)
    except Exception:  # pragma: no cover - the dump never fails on a loaded op
        text = op.type
    return ExecutionError(reason, block=block.idx, op_index=index, op_type=op.type, inputs=inputs, op_text=text)
