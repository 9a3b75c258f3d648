"""Whole params out of a job: from its running pservers (`pull`) or from a checkpoint
(`from_checkpoint`), written as Fluid LoDTensor files, one per var (`write_vars`:
what `fluid.io.load_persistables` reads, and what `serve --init` warm starts from).

`pull` asks each pserver for its blocks of every param by the plan and concatenates
them by their row ranges (and column ranges: 2-D partitions; a distributed table cut by
a partitioner answers its auto-grown pieces, dense-ified, rows never touched 0); the
distributed table (`id % M`) comes back from every pserver as its
touched rows (global ids) and is assembled dense, rows never touched 0. In sync mode a
get waits for the pservers' get phase, so a pull between steps sees one step's params.
The pull's RPCs go as trainer 0's (a pserver knows only its trainers' ids).
"""

from __future__ import annotations

import math

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ops.rpc.checkpoint import CheckpointReader
from ops.rpc.tensor_file import encode_tensor
from ops.tensor import LoDTensor, SelectedRows
from transpiler.errors import PsTranspilerError
from transpiler.fileio import write_files

if TYPE_CHECKING:  # `pull` is given a client; `write_vars` (a trainer's --save, a pserver's script) needs none
    from ops.rpc.client import RpcClient


class FetchError(PsTranspilerError):
    """A var the plan does not hold, or an answer that does not fit it."""


def plan_vars(plan: Mapping[str, Any]) -> list[str]:
    """Every param the plan places, and the distributed table."""
    names = [p["param"] for p in plan.get("params", [])]
    table = plan.get("table")
    return sorted([*names, *([table["table"]] if table else [])])


def pull(client: RpcClient, plan: Mapping[str, Any], names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """The whole value of each of `names` (default: every param and the table)."""
    wanted = list(names) if names is not None else plan_vars(plan)
    params = {p["param"]: p for p in plan.get("params", [])}
    table = plan.get("table")
    requests: list[tuple[str, str]] = []
    for name in wanted:
        if name in params:
            requests += [(b["endpoint"], b["name"]) for b in params[name]["blocks"]]
        elif table is not None and name == table["table"]:
            requests += [(ep, name) for ep in table["endpoints"]]
        else:
            raise FetchError(f"the plan places no var {name!r} on the pservers (it has: {', '.join(plan_vars(plan))})")
    values = iter(client.get_many(requests))
    out: dict[str, np.ndarray] = {}
    for name in wanted:
        if name in params:
            param = params[name]
            blocks = [_piece(next(values), b, param) if param.get("distributed") else _array(next(values), b["name"])
                      for b in param["blocks"]]
            if any("cols" in b for b in param["blocks"]):
                whole = _join_2d(param, blocks)
            else:
                whole = np.concatenate(blocks) if len(blocks) > 1 else blocks[0]  # blocks are row ranges, in order
            if list(whole.shape) != list(param["shape"]):
                raise FetchError(f"{name}: the pservers' blocks make a {list(whole.shape)} var, the plan says {param['shape']}")
            out[name] = whole
        else:
            dense = None
            for _ in table["endpoints"]:
                shard = next(values)
                if not isinstance(shard, SelectedRows):
                    raise FetchError(f"{name}: a pserver answered a {type(shard).__name__}, not its table shard")
                if dense is None:
                    dense = np.zeros(table["shape"], shard.dtype)
                dense[shard.rows] = shard.active_value()
            out[name] = dense
    return out


def _join_2d(param: dict[str, Any], blocks: list[np.ndarray]) -> np.ndarray:
    """A param cut into 2-D partitions (`transpiler.partition`), put back together."""
    shape = [int(d) for d in param["shape"]]
    width = math.prod(shape[1:]) if len(shape) >= 2 else 1
    flat = np.empty((shape[0] if shape else 1, width), blocks[0].dtype)
    covered = 0
    for b, array in zip(param["blocks"], blocks, strict=True):
        r0, c0 = int(b["row_offset"]), int(b["col_offset"])
        rows, cols = int(b["rows"]), int(b["cols"])
        if array.size != rows * cols:
            raise FetchError(f"{param['param']}: block {b['name']} holds {list(array.shape)}, the plan says "
                             f"{rows} x {cols}")
        flat[r0 : r0 + rows, c0 : c0 + cols] = array.reshape(rows, cols)
        covered += rows * cols
    if covered != flat.size:
        raise FetchError(f"{param['param']}: the pservers' blocks hold {covered} of its {flat.size} elements")
    return flat.reshape(shape)


def _piece(value: Any, block: Mapping[str, Any], param: Mapping[str, Any]) -> np.ndarray:
    """A piece of a distributed table cut by a partitioner (an auto-grown SelectedRows,
    ids re-based to its rows) as its dense block: rows never touched 0."""
    if not isinstance(value, SelectedRows):
        raise FetchError(f"{block['name']}: a pserver answered a {type(value).__name__}, not a table piece")
    shape = [int(d) for d in param["shape"]]
    cols = int(block["cols"]) if "cols" in block else math.prod(shape[1:])
    rows = value.rows
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= int(block["rows"])):
        raise FetchError(f"{block['name']}: a row id outside its {block['rows']} rows")
    dense = np.zeros((int(block["rows"]), cols), value.dtype)
    dense[rows] = value.active_value().reshape(rows.size, cols)
    return dense if "cols" in block else dense.reshape(int(block["rows"]), *shape[1:])


def _array(value: Any, name: str) -> np.ndarray:
    if not isinstance(value, LoDTensor):
        raise FetchError(f"{name}: a pserver answered a {type(value).__name__}, not a dense block")
    return np.array(value.array)


def from_checkpoint(path: Path, names: Iterable[str] | None = None) -> tuple[int, dict[str, np.ndarray]]:
    """(step, whole vars) of the newest complete checkpoint in `path` (default: every
    var it holds, accumulators and learning rate included)."""
    reader = CheckpointReader(path)
    wanted = list(names) if names is not None else reader.origins()
    return reader.step, {name: reader.whole(name) for name in wanted}


def write_vars(folder: Path, arrays: Mapping[str, np.ndarray]) -> list[Path]:
    """One LoDTensor file per var, named by the var, all or nothing (a temp folder, then
    renamed in)."""
    for name in arrays:
        if "/" in name or name in (".", ".."):
            raise FetchError(f"var {name!r} cannot be a file name")
    return write_files({name: encode_tensor(array) for name, array in arrays.items()}, folder)


__all__ = ["FetchError", "from_checkpoint", "plan_vars", "pull", "write_vars"]
