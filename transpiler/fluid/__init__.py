"""`import transpiler.fluid as fluid`: the `fluid` names Fluid 1.x training scripts use,
over our program builder (`transpiler.frontend`) and executor (`ops.executor`).

    import transpiler.fluid as fluid          # was: import paddle.fluid as fluid
    x = fluid.layers.data(name="x", shape=[13], dtype="float32")
    ...
    fluid.optimizer.SGD(learning_rate=0.01).minimize(loss)
    exe = fluid.Executor(fluid.CPUPlace())
    exe.run(fluid.default_startup_program())
    loss_value, = exe.run(fluid.default_main_program(), feed={...}, fetch_list=[loss])
    fluid.io.save_persistables(exe, "model")

Only CPU places exist (`CUDAPlace` raises). Under `transpiler.fleet` a worker's `Executor`
runs the transpiled trainer programs and talks to the pservers through the fleet's RPC
client (`fleet.init_worker()` connects it), as Fluid's does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ops.executor import Executor as _OpsExecutor
from ops.executor import global_scope
from ops.scope import Scope
from transpiler.errors import PsTranspilerError
from transpiler.frontend import (
    ParamAttr,
    Program,
    Variable,
    clip,
    default_main_program,
    default_startup_program,
    initializer,
    layers,
    name_scope,
    optimizer,
    program_guard,
    regularizer,
    unique_name,
)
from transpiler.frontend import data as data
from transpiler.frontend.framework import switch_main_program, switch_startup_program
from transpiler.ir import Program as IRProgram

# Services a distributed role gives every `Executor` of this process (`rpc`: the RPC client
# of a fleet worker), set by `transpiler.fleet` and cleared when the worker stops.
_distributed_env: dict[str, Any] = {}


class CPUPlace:
    """The one place programs run on (numpy)."""

    def __repr__(self) -> str:
        return "CPUPlace"


class CUDAPlace:
    def __init__(self, device_id: int = 0) -> None:
        raise PsTranspilerError("CUDAPlace: this runtime runs on the CPU only; use fluid.CPUPlace()")


def _fetch_name(item: Any) -> str:
    if isinstance(item, str):
        return item
    name = getattr(item, "name", None)
    if not isinstance(name, str):
        raise PsTranspilerError(f"fetch_list takes Variables or names, got {type(item).__name__}")
    return name


class Executor:
    """`fluid.Executor(place)`: runs a program's block 0 in `scope` (default the global
    scope) and returns the fetched values, numpy arrays unless `return_numpy=False`."""

    def __init__(self, place: Any = None, *, seed: int | None = 0) -> None:
        self.place = place if place is not None else CPUPlace()
        self._executor = _OpsExecutor(seed=seed)
        self._closed = False

    def run(
        self,
        program: IRProgram | None = None,
        feed: Mapping[str, Any] | None = None,
        fetch_list: Sequence[Any] | None = None,
        feed_var_name: str = "feed",
        fetch_var_name: str = "fetch",
        scope: Scope | None = None,
        return_numpy: bool = True,
        use_program_cache: bool = False,
    ) -> list[Any]:
        if self._closed:
            raise PsTranspilerError("Executor.run after close()")
        program = default_main_program() if program is None else program
        compiled = getattr(program, "_program", None)  # a CompiledProgram
        if compiled is not None:
            program = compiled
        if not isinstance(program, IRProgram):
            raise PsTranspilerError(f"Executor.run takes a Program, got {type(program).__name__}")
        if isinstance(fetch_list, (str, Variable)):
            fetch_list = [fetch_list]
        names = [_fetch_name(item) for item in (fetch_list or ())]
        scope = scope if scope is not None else global_scope()
        values = self._executor.run(program, feed=feed, fetch_list=names, scope=scope, return_numpy=return_numpy,
                                    env=dict(_distributed_env))
        after = getattr(program, "_fleet_after_run", None)  # a fleet GEO worker's sync (`transpiler.fleet.geo`)
        if after is not None:
            after(scope, self._executor)
        return values

    def close(self) -> None:
        """Fluid's close tells the pservers this trainer is done; a fleet worker does that in
        `fleet.stop_worker()`, so here it only stops this executor."""
        self._closed = True


class CompiledProgram:
    """`fluid.CompiledProgram(program)`: runs as the program itself (one CPU place)."""

    def __init__(self, program_or_graph: IRProgram, build_strategy: Any = None) -> None:
        self._program = program_or_graph

    def with_data_parallel(self, *args: Any, **kwargs: Any) -> CompiledProgram:
        return self


class DataFeeder:
    """`fluid.DataFeeder(feed_list, place)`: a list of samples (tuples, one field per
    feed var) → a feed dict of batched arrays, each in its var's dtype and shape."""

    def __init__(self, feed_list: Sequence[Any], place: Any = None, program: IRProgram | None = None) -> None:
        program = default_main_program() if program is None else program
        self.vars = []
        for item in feed_list:
            name = _fetch_name(item)
            var = program.global_block().find_var(name) if not isinstance(item, Variable) else item.desc
            if var is None:
                raise PsTranspilerError(f"DataFeeder: no var {name!r} in the program")
            self.vars.append((name, var))

    def feed(self, iterable: Iterable[Sequence[Any]]) -> dict[str, np.ndarray]:
        samples = list(iterable)
        out = {}
        for index, (name, var) in enumerate(self.vars):
            column = [np.asarray(sample[index]) for sample in samples]
            shape = [len(samples), *[d for d in var.shape[1:]]]
            array = np.stack(column).astype(var.dtype.to_numpy())
            if all(d >= 0 for d in shape[1:]):
                array = array.reshape(shape)
            out[name] = array
        return out


from transpiler.fluid import io  # noqa: E402  (io uses Executor's module state)

__all__ = [
    "CPUPlace",
    "CUDAPlace",
    "CompiledProgram",
    "DataFeeder",
    "Executor",
    "ParamAttr",
    "Program",
    "Scope",
    "clip",
    "data",
    "default_main_program",
    "default_startup_program",
    "global_scope",
    "initializer",
    "io",
    "layers",
    "name_scope",
    "optimizer",
    "program_guard",
    "regularizer",
    "switch_main_program",
    "switch_startup_program",
    "unique_name",
]
