"""`fluid.io`: Fluid's files, one LoDTensor file per var (`ops.rpc.tensor_file`), which
Paddle's `fluid.io.load_persistables` reads and which `init_server(model_dir)`, `Session(init=)`
and `pstranspile launch --init` warm start from.

    fluid.io.save_persistables(exe, "model")                      # every persistable var
    fluid.io.load_persistables(exe, "model")
    fluid.io.save_inference_model("infer", ["x"], [predict], exe)  # `__model__` + params
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ops.rpc.tensor_file import read_tensor, write_tensor
from ops.executor import global_scope
from ops.scope import Scope
from ops.tensor import LoDTensor
from transpiler.errors import PsTranspilerError
from transpiler.fileio import write_bytes_atomic
from transpiler.frontend import default_main_program
from transpiler.ir import Program, VarKind
from transpiler.ir.types import OpRole

MODEL_FILE = "__model__"
_NOT_SAVED = (VarKind.FEED_MINIBATCH, VarKind.FETCH_LIST, VarKind.RAW, VarKind.READER, VarKind.STEP_SCOPES)


class FluidIOError(PsTranspilerError):
    """A var to save is not in the scope, or a file to load is missing or of the wrong shape."""


def _file_name(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise FluidIOError(f"var name {name!r} cannot be a file name")
    return name


def persistable_names(program: Program) -> list[str]:
    """The program's persistable vars that hold tensors, sorted (what Fluid saves)."""
    return sorted(name for name, var in program.global_block().vars.items()
                  if var.persistable and var.kind not in _NOT_SAVED)


def parameter_names(program: Program) -> list[str]:
    return sorted(name for name, var in program.global_block().vars.items() if var.is_parameter)


def write_vars(dirname: str | Path, values: Mapping[str, np.ndarray]) -> list[Path]:
    """Write each value as `dirname/<name>`, a LoDTensor file (each atomically)."""
    folder = Path(dirname)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in sorted(values):
        path = folder / _file_name(name)
        write_tensor(path, np.asarray(values[name]))
        written.append(path)
    return written


def scope_values(names: Iterable[str], scope: Scope | None = None) -> dict[str, np.ndarray]:
    scope = global_scope() if scope is None else scope
    out = {}
    for name in names:
        value = scope.find_var(name)
        if not isinstance(value, LoDTensor):
            raise FluidIOError(f"cannot save {name}: it is not a tensor in the scope (run the startup program first)")
        out[name] = np.array(value.array)
    return out


def save_vars(executor: Any, dirname: str | Path, main_program: Program | None = None, vars: Sequence[Any] | None = None,
              predicate: Any = None, filename: str | None = None) -> list[Path]:
    if filename is not None:
        raise FluidIOError("saving every var into one file (filename=) is not supported; one file per var is")
    program = default_main_program() if main_program is None else main_program
    if vars is not None:
        names = [v if isinstance(v, str) else v.name for v in vars]
    else:
        names = sorted(n for n, var in program.global_block().vars.items() if predicate is None or predicate(var))
    hook = getattr(program, "_fleet_save", None)  # a fleet worker's program: whole params come from the pservers
    values = hook(names) if hook is not None else scope_values(names)
    return write_vars(dirname, values)


def save_persistables(executor: Any, dirname: str | Path, main_program: Program | None = None,
                      filename: str | None = None) -> list[Path]:
    """Every persistable var of `main_program` (default: the default main program)."""
    program = default_main_program() if main_program is None else main_program
    return save_vars(executor, dirname, program, persistable_names(program), filename=filename)


def save_params(executor: Any, dirname: str | Path, main_program: Program | None = None,
                filename: str | None = None) -> list[Path]:
    program = default_main_program() if main_program is None else main_program
    return save_vars(executor, dirname, program, parameter_names(program), filename=filename)


def load_vars(executor: Any, dirname: str | Path, main_program: Program | None = None, vars: Sequence[Any] | None = None,
              scope: Scope | None = None) -> list[str]:
    """Set each var from `dirname/<name>`; a missing file or a shape that differs from the
    program's raises `FluidIOError`."""
    program = default_main_program() if main_program is None else main_program
    scope = global_scope() if scope is None else scope
    names = [v if isinstance(v, str) else v.name for v in vars] if vars is not None else persistable_names(program)
    block = program.global_block()
    for name in names:
        path = Path(dirname) / _file_name(name)
        if not path.is_file():
            raise FluidIOError(f"no file for {name} in {dirname}")
        array = read_tensor(path)
        var = block.find_var(name)
        if var is not None and var.shape is not None and len(var.shape) == array.ndim and any(
                d >= 0 and d != a for d, a in zip(var.shape, array.shape)):
            raise FluidIOError(f"{path} has shape {list(array.shape)}, {name} is {list(var.shape)}")
        scope.set_var(name, LoDTensor(array))
    return names


def load_persistables(executor: Any, dirname: str | Path, main_program: Program | None = None,
                      filename: str | None = None) -> list[str]:
    if filename is not None:
        raise FluidIOError("loading one combined file (filename=) is not supported; one file per var is")
    return load_vars(executor, dirname, main_program)


def load_params(executor: Any, dirname: str | Path, main_program: Program | None = None,
                filename: str | None = None) -> list[str]:
    program = default_main_program() if main_program is None else main_program
    return load_vars(executor, dirname, program, parameter_names(program))


def inference_program(program: Program, feeded_var_names: Sequence[str], target_names: Sequence[str]) -> Program:
    """A copy of `program` holding only the forward ops `target_names` need (block 0), with
    Fluid's `feed` ops (col i ← `feeded_var_names[i]`) first and `fetch` ops last, and only
    the vars those ops name."""
    pruned = program.clone()
    block = pruned.global_block()
    if pruned.num_blocks > 1:
        raise FluidIOError("save_inference_model: programs with sub-blocks (control flow) are not supported")
    for name in [*feeded_var_names, *target_names]:
        if block.find_var(name) is None:
            raise FluidIOError(f"save_inference_model: no var {name!r} in the program")
    needed = set(target_names)
    keep = []
    for op in reversed(block.ops):
        forward = not (op.role & (OpRole.Backward | OpRole.Optimize | OpRole.LRSched))
        if forward and needed.intersection(op.output_names):
            keep.append(op)
            needed.update(n for n in op.input_names if n not in feeded_var_names)
    kept = set(map(id, keep))
    block.remove_ops([op for op in block.ops if id(op) not in kept])
    feed = block.create_var("feed", VarKind.FEED_MINIBATCH, persistable=True)
    fetch = block.create_var("fetch", VarKind.FETCH_LIST, persistable=True)
    for col, name in reversed(list(enumerate(feeded_var_names))):
        block.add_op("feed", {"X": [feed.name]}, {"Out": [name]}, {"col": col}, index=0)
    for col, name in enumerate(target_names):
        block.add_op("fetch", {"X": [name]}, {"Out": [fetch.name]}, {"col": col})
    used = set()
    for op in block.ops:
        used.update(op.input_names)
        used.update(op.output_names)
    for name in [n for n in block.vars if n not in used]:
        block.remove_var(name)
    return pruned


def save_inference_model(dirname: str | Path, feeded_var_names: Sequence[str], target_vars: Sequence[Any],
                         executor: Any, main_program: Program | None = None, model_filename: str | None = None,
                         params_filename: str | None = None, export_for_deployment: bool = True,
                         program_only: bool = False) -> list[str]:
    """Fluid's inference model: `dirname/__model__` (the pruned program) and a file per
    persistable var it uses; returns the fetch targets' names."""
    if params_filename is not None:
        raise FluidIOError("params in one combined file (params_filename=) is not supported; one file per var is")
    if isinstance(feeded_var_names, str):
        feeded_var_names = [feeded_var_names]
    if not isinstance(target_vars, (list, tuple)):
        target_vars = [target_vars]
    program = default_main_program() if main_program is None else main_program
    source = getattr(program, "_fleet_origin", program)  # a fleet worker saves its net, not its RPC ops
    targets = [t if isinstance(t, str) else t.name for t in target_vars]
    pruned = inference_program(source, list(feeded_var_names), targets)
    folder = Path(dirname)
    folder.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(folder / (model_filename or MODEL_FILE), pruned.to_bytes())
    if not program_only:
        save_vars(executor, folder, program, persistable_names(pruned))
    return targets


__all__ = [
    "FluidIOError",
    "inference_program",
    "load_params",
    "load_persistables",
    "load_vars",
    "save_inference_model",
    "save_params",
    "save_persistables",
    "save_vars",
    "write_vars",
]
