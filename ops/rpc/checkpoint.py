"""Checkpoints: atomic as a whole, confined to the pserver's checkpoint dir, restorable
onto any pserver count, in Fluid's file formats.

Layout under a checkpoint root (`serve --checkpoint-dir ROOT`, `Session(checkpoint_dir=)`):

    ROOT/latest                   "ckpt-<step>\\n": the newest complete checkpoint (atomic rename)
    ROOT/ckpt-<step>/MANIFEST.json  written last: the checkpoint exists once this does
    ROOT/ckpt-<step>/ps<i>/       pserver i's part (`local` for local training)
    ROOT/ckpt-<step>/ps<i>/PART.json  its vars: what rows of which whole var, sha256
    ROOT/ckpt-<step>/ps<i>/<var>  one file per var, Fluid's LoDTensor format
                                  (a distributed table shard: Fluid's SelectedRows format)
    ROOT/ckpt-<step>/trainer0/    trainer 0's own state, the params no pserver holds (batch
                                  norm's moving stats): LoDTensor files of whole vars, written
                                  (all or nothing) before it asks the pservers; not a part
                                  of the manifest; a restored trainer warm starts from it

A part is written into a staging folder beside it (`.ps<i>.tmp-…`), every file fsynced,
its `PART.json` last, then renamed into place; the pserver that completes the set (every
part of the plan present) writes `MANIFEST.json` (step, the plan, every part's vars) and
then `latest`, both atomically, and removes all but the newest `keep` complete
checkpoints (and incomplete ones older than the newest complete). A crash at any point
leaves the previous complete checkpoint as it was; a folder without `MANIFEST.json` is
never read. In sync mode trainer 0 asks for checkpoint `s` only after step `s` and waits
for every pserver's answer before its next send barrier, so every part holds the state
after step `s` and at most one checkpoint is incomplete at a time.

What a part holds, by mode. Sync: every part holds the state after step `s` (trainer 0
asks after step `s`, each pserver saves between rounds). Async: no step is common to the
pservers (a trainer's grads of one step reach them at different times, and other trainers
keep sending); each pserver saves with every optimize block and the lr-decay block held,
so its part is its state between whole updates (no param saved with half an optimizer
step), and PART.json's `state` (gathered into the manifest's `states`) records the mode
and how many grads that pserver had applied (`updates`; sync: optimize rounds run).
`step` is trainer 0's step when it asked.

A var's entry says which rows of which whole var the file holds (`origin`, `rows`:
`[start, end)` of the first dimension, or null for the whole var): a param block, the
optimizer accumulators sliced with it, or a whole (possibly replicated) var such as the
learning rate. Restore assembles each whole var from every part that holds rows of it and
cuts the rows the new layout wants, so M pservers restore onto M' (Paddle's pservers
cannot). The distributed table is one SelectedRows per part (rows = global ids, the
unused preallocated rows in `<table>@POOL`); restoring it onto M' keeps the rows with
`id % M' == i`; onto the same M it is the exact table, pool included.

Per-pserver directories: a root containing `{pserver}` (`serve --checkpoint-dir
'/data/ps{pserver}/ckpt'`, the same string for every process of the job) is a template.
Pserver i writes its part under the template with `{pserver}` = i, on a disk of its own
(`<root i>/ckpt-<step>/ps<i>/`, the same staging and PART.json). No process reads another's
dir (`ops.rpc.own_dirs`): each pserver sends trainer 0 its PART.json over RPC; trainer 0
writes the job-level manifest into the template with `{pserver}` = `job` (its own dir:
`/data/psjob/ckpt/ckpt-<step>/MANIFEST.json` and `latest`; every part's vars, and in
`locations` where each part is) and sends it to every pserver, which keeps a copy beside
its part (`Checkpointer.commit`) once it matches the part on disk: the checkpoint is then
complete in each pserver's own dir. A restore onto the same pserver count reads the
pserver's own part only (`CheckpointReader.own_part_fits`). A reader of whole vars
(restore onto another pserver count, `fetch`, `Session.pull`) given the template, the job
root or a pserver's own dir reads each part where `locations` says or, when that path is
not there, from the manifest's own folder (`<...>/ckpt-<step>/ps<i>/`: a gathered copy, the
parts copied beside the manifest): it must reach every part.

Names a checkpoint request carries are relative: one or more components of
`[A-Za-z0-9_.-]`, no `.` or `..`; anything else is refused (`CheckpointPathError`,
`INVALID_ARGUMENT` on the wire), and so is a path whose real location (symlinks
resolved) leaves the root (`PERMISSION_DENIED`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ops.rpc.table_io import join_pieces
from ops.rpc.tensor_file import TensorFileError, conform_scalar, decode_tensor, encode_tensor
from ops.scope import Scope
from ops.tensor import LoDTensor, SelectedRows
from transpiler.errors import PsTranspilerError
from transpiler.fileio import write_atomic
from transpiler.ir import Program
from transpiler.ir.types import VarKind

FORMAT = "ps-transpiler-checkpoint/1"
MANIFEST = "MANIFEST.json"
PART = "PART.json"
LATEST = "latest"
PREFIX = "ckpt-"
POOL_SUFFIX = "@POOL"
TRAINER_STATE = "trainer0"  # trainer 0's own state beside the parts (see the layout above)
DEFAULT_KEEP = 3
INCOMPLETE_KEEP = 3  # incomplete checkpoints (a part, no manifest) newer than the newest complete one a root keeps
NAME_MAX = 255  # bytes of one component of a checkpoint name (the filesystems' limit)
PATH_CHARS = 1024  # characters of a whole checkpoint name
STEP_DIGITS = 18  # a step fits an int64
_COMPONENT = re.compile(r"^[A-Za-z0-9_.-]+$")
_BLOCK_SUFFIX = re.compile(r"\.block\d+$")


class CheckpointError(PsTranspilerError):
    """A checkpoint that cannot be written, found, read or restored."""


class CheckpointPathError(CheckpointError):
    """A checkpoint name that is not a plain relative name (`escapes` when it is one but
    its real path leaves the root through a symlink)."""

    def __init__(self, message: str, *, escapes: bool = False) -> None:
        super().__init__(message)
        self.escapes = escapes


PSERVER_FIELD = "{pserver}"
JOB_PART = "job"


def is_template(root: Path | str) -> bool:
    """A checkpoint root that names one directory per pserver (`{pserver}` in it)."""
    return PSERVER_FIELD in str(root)


def part_root(root: Path | str, index: int) -> Path:
    """Pserver `index`'s checkpoint root: the template with `{pserver}` = index (a
    shared root: the root itself)."""
    return Path(str(root).replace(PSERVER_FIELD, str(int(index))))


def job_root(root: Path | str) -> Path:
    """Where the job-level manifests are: the template with `{pserver}` = `job` (a
    shared root: the root itself)."""
    return Path(str(root).replace(PSERVER_FIELD, JOB_PART))


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{int(step)}"


def step_of(name: str) -> int | None:
    match = re.fullmatch(rf"{PREFIX}(\d{{1,{STEP_DIGITS}}})", name)
    return int(match.group(1)) if match else None


def confine(root: Path, name: str) -> Path:
    """`root/name`, refusing anything but a plain relative name inside `root`."""
    if not name or name.startswith("/") or "\\" in name or "\x00" in name:
        raise CheckpointPathError(f"checkpoint name {name!r} is not a relative name inside the checkpoint dir")
    if len(name) > PATH_CHARS or any(len(p.encode()) > NAME_MAX for p in name.split("/")):
        raise CheckpointPathError(f"checkpoint name {name[:40]!r}... ({len(name)} characters) is longer than a name "
                                  f"inside the checkpoint dir may be ({NAME_MAX} bytes a component, {PATH_CHARS} in all)")
    parts = name.split("/")
    for part in parts:
        if part in ("", ".", "..") or not _COMPONENT.match(part):
            raise CheckpointPathError(f"checkpoint name {name!r} is not a relative name inside the checkpoint dir")
    real_root = Path(os.path.realpath(root))
    target = Path(os.path.realpath(real_root.joinpath(*parts)))
    if target != real_root and real_root not in target.parents:
        raise CheckpointPathError(f"checkpoint name {name!r} leads outside the checkpoint dir (a symlink)", escapes=True)
    return real_root.joinpath(*parts)


# ------------------------------------------------------------------ layouts


@dataclass(frozen=True)
class VarSlice:
    """What a var in a scope is of a whole var: rows `[start, end)` of `origin` (None: all)
    and, for a 2-D partition (`transpiler.partition`), columns `[start, end)` of the
    product of its other dims (None: all)."""

    origin: str
    whole_shape: tuple[int, ...]
    rows: tuple[int, int] | None = None
    table: bool = False  # the distributed table's shard (SelectedRows, ids % M), or a piece of it (`rows` set)
    cols: tuple[int, int] | None = None
    # A piece of an accumulator of a partitioned distributed table: the table's origin,
    # whose rows it follows (`SelectedRows.follow`). Not saved: restore-time knowledge.
    follows: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"origin": self.origin, "whole_shape": list(self.whole_shape),
               "rows": list(self.rows) if self.rows is not None else None, "table": self.table}
        if self.cols is not None:  # a row block's entry as it always was
            out["cols"] = list(self.cols)
        return out

    def piece_shape(self) -> tuple[int, ...]:
        """The shape this slice of the whole var has."""
        if self.cols is not None:
            return (self.rows[1] - self.rows[0], self.cols[1] - self.cols[0])
        if self.rows is not None:
            return (self.rows[1] - self.rows[0], *self.whole_shape[1:])
        return tuple(self.whole_shape)

    def cut(self, whole: np.ndarray) -> np.ndarray:
        """This slice of `whole`."""
        if self.rows is None:
            return whole
        if self.cols is None:
            return whole[self.rows[0] : self.rows[1]]
        flat = whole.reshape(whole.shape[0], -1) if whole.ndim != 2 else whole
        return flat[self.rows[0] : self.rows[1], self.cols[0] : self.cols[1]]


def local_layout(program: Program) -> dict[str, VarSlice]:
    """Every persistable tensor of a (local or trainer) program, whole."""
    return {
        name: VarSlice(name, tuple(var.shape or ()))
        for name, var in sorted(program.global_block().vars.items())
        if var.persistable and var.kind in (VarKind.LOD_TENSOR, VarKind.SELECTED_ROWS) and var.shape is not None
    }


def pserver_layout(program: Program, plan: Mapping[str, Any], endpoint: str, skip: Iterable[str]) -> dict[str, VarSlice]:
    """What each persistable var of a pserver program is of the whole model, from the
    plan (`plan.json`'s content): param blocks by their row ranges, the accumulators an
    optimize op updates with a block by the same rows, the table shard, the rest whole.
    `skip`: the grads trainers send (not state)."""
    block0 = program.global_block()
    skip = set(skip)
    # block var -> (param shape, start, rows, sliced, column range or None)
    blocks: dict[str, tuple[tuple[int, ...], int, int, bool, tuple[int, int] | None]] = {}
    pieces: dict[str, str] = {}  # block var of a partitioned distributed table -> the table
    for param in plan.get("params", []):
        sliced = len(param["blocks"]) > 1
        if param.get("distributed"):
            pieces.update({blk["name"]: param["param"] for blk in param["blocks"] if blk["endpoint"] == endpoint})
        width = math.prod(param["shape"][1:]) if len(param["shape"]) >= 2 else 1
        for blk in param["blocks"]:
            if blk["endpoint"] == endpoint:
                cols = None
                flat = len(param["shape"]) > 2 and len(blk.get("shape", ())) == 2  # a rank-3+ param's 2-D piece
                if "cols" in blk and ((int(blk["col_offset"]), int(blk["cols"])) != (0, width) or flat):
                    cols = (int(blk["col_offset"]), int(blk["col_offset"]) + int(blk["cols"]))
                blocks[blk["name"]] = (tuple(param["shape"]), int(blk["row_offset"]), int(blk["rows"]), sliced, cols)
    layout: dict[str, VarSlice] = {}
    for name, (shape, start, rows, sliced, cols) in blocks.items():
        origin = _BLOCK_SUFFIX.sub("", name) if sliced else name
        if name in pieces:  # an auto-grown piece: its rows are ids re-based to `start`
            layout[name] = VarSlice(pieces[name], shape, (start, start + rows), table=True, cols=cols)
            continue
        layout[name] = VarSlice(origin, shape, (start, start + rows) if sliced else None, cols=cols)
    for blk in program.blocks[1:]:
        for op in blk.ops:
            params = op.input("Param")
            if len(params) != 1 or params[0] not in blocks:
                continue
            shape, start, rows, sliced, cols = blocks[params[0]]
            piece = (rows, cols[1] - cols[0]) if cols is not None else (rows, *shape[1:])
            for slot in op.inputs:
                if slot in ("Param", "Grad", "LearningRate"):
                    continue
                for arg in op.input(slot):
                    var = block0.find_var(arg)
                    if params[0] in pieces and var is not None and var.kind == VarKind.SELECTED_ROWS:
                        layout[arg] = VarSlice(_BLOCK_SUFFIX.sub("", arg) if sliced else arg, shape, (start, start + rows),
                                               table=True, cols=cols, follows=pieces[params[0]])
                    elif sliced and var is not None and var.shape is not None and tuple(var.shape) == piece:
                        layout[arg] = VarSlice(_BLOCK_SUFFIX.sub("", arg), (shape[0], *shape[1:]), (start, start + rows),
                                               cols=cols)
                    elif sliced and var is not None and var.shape is not None and var.persistable \
                            and arg not in skip and _BLOCK_SUFFIX.search(arg):
                        # whole state a pserver holding two blocks of the param keeps per block
                        # (`<beta_pow>.block<i>`, the same value in each): the var it is a copy of
                        layout[arg] = VarSlice(_BLOCK_SUFFIX.sub("", arg), tuple(var.shape))
    table = plan.get("table")
    for name, var in sorted(block0.vars.items()):
        if name in layout or name in skip or not var.persistable or var.shape is None:
            continue
        if table is not None and name == table["table"]:
            layout[name] = VarSlice(name, tuple(table["shape"]), table=True)
        elif var.kind == VarKind.LOD_TENSOR:
            layout[name] = VarSlice(name, tuple(var.shape))
    return dict(sorted(layout.items()))


def plan_fingerprint(plan_text: str) -> str:
    return hashlib.sha256(plan_text.encode()).hexdigest()


# ------------------------------------------------------------------ file formats


def encode_table(table: SelectedRows) -> tuple[bytes, bytes]:
    """Fluid's SelectedRows file (uint32 version 0, uint64 row count, int64 rows, int64
    height, then the value as a Tensor) of the table's rows, and its unused preallocated
    rows as a LoDTensor file."""
    with table.lock:
        rows = np.ascontiguousarray(table.rows, dtype="<i8")
        value = np.array(table.value)  # a snapshot: the table may grow right after
    tensor = encode_tensor(value[: rows.size])[12:]  # a Tensor: drop the LoDTensor's version and LoD
    head = struct.pack("<IQ", 0, rows.size) + rows.tobytes() + struct.pack("<q", table.height)
    return head + tensor, encode_tensor(value[rows.size :])


def decode_table(data: bytes, pool: bytes | None, where: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(rows, value with the pool rows after the active ones, height)."""
    try:
        version, count = struct.unpack_from("<IQ", data, 0)
        if version != 0:
            raise TensorFileError(f"{where}: SelectedRows version {version}, not 0")
        rows = np.frombuffer(data, "<i8", count, 12).astype(np.int64)
        (height,) = struct.unpack_from("<q", data, 12 + 8 * count)
    except (struct.error, ValueError) as exc:
        raise TensorFileError(f"{where}: not a SelectedRows file ({exc})") from None
    value = decode_tensor(struct.pack("<IQ", 0, 0) + data[20 + 8 * count :], where).array
    if pool is not None:
        value = np.concatenate([value, decode_tensor(pool, where + POOL_SUFFIX).array])
    return rows, value, int(height)


def _point_latest(root: Path, folder: Path, step: int) -> None:
    """Point `root/latest` at the complete checkpoint `folder` unless it names a newer one."""
    pointer = root / LATEST
    try:
        current = step_of(pointer.read_text().strip())
    except OSError:
        current = None
    if current is not None and current > step and (root / checkpoint_name(current) / MANIFEST).is_file():
        return
    if current == step:
        return
    write_atomic(pointer, lambda out: out.write(f"{folder.name}\n".encode()), durable=True)
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    write_atomic(path, lambda out: out.write(text.encode()), durable=True)


def _file_name(var: str) -> str:
    return var.replace("%", "%25").replace("/", "%2F")


def var_of_file_name(file: str) -> str:
    """The var a checkpoint file is of (`_file_name` undone)."""
    return file.replace("%2F", "/").replace("%25", "%")


# ------------------------------------------------------------------ saving


@dataclass
class Checkpointer:
    """One process's part of the job's checkpoints."""

    root: Path
    part: str  # "ps<i>" or "local"
    parts: tuple[str, ...]  # every part a complete checkpoint has
    layout: Mapping[str, VarSlice]
    plan_text: str = "{}"
    keep: int = DEFAULT_KEEP
    shared: bool = True  # every part in `root`; False: this part's own dir (the job manifest is trainer 0's)

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise CheckpointError(f"keep at least 1 checkpoint, not {self.keep}")
        self.root = Path(self.root)

    def save(self, scope: Scope, name: str, *, info: Mapping[str, Any] | None = None) -> Path:
        """Write this part of checkpoint `name` (`ckpt-<step>`); complete the checkpoint
        when every part is in. Returns the checkpoint's folder. A part left by an
        earlier, interrupted save of that step is replaced; a complete checkpoint is
        left as it is. `info` (the pserver's mode and the updates it had applied) is
        recorded in PART.json as `state`."""
        import shutil
        import tempfile

        step = step_of(name)
        if step is None:
            raise CheckpointPathError(f"checkpoint name {name!r} is not ckpt-<step>")
        self.root.mkdir(parents=True, exist_ok=True)
        folder = confine(self.root, name)
        if (folder / MANIFEST).is_file():  # complete already (a restored job asked again): never unmake a complete one,
            _point_latest(self.root, folder, step)  # but point `latest` at it (a kill may have come between its manifest and `latest`)
            return folder
        folder.mkdir(exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder, prefix=f".{self.part}.tmp-"))
        try:
            entries = self._write_vars(scope, staging)
            _write_json(staging / PART, {"format": FORMAT, "step": step, "part": self.part, "parts": list(self.parts),
                                         "plan_sha256": plan_fingerprint(self.plan_text), "vars": entries,
                                         **({"state": dict(info)} if info is not None else {})})
            self._validate_part(staging, entries, name)
            _fsync_dir(staging)
            final = folder / self.part
            old = None
            if final.exists() or final.is_symlink():
                old = folder / f".{self.part}.old-{os.getpid()}"
                os.replace(final, old)
            os.replace(staging, final)
            _fsync_dir(folder)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self._complete(folder, step)
        return folder

    def _write_vars(self, scope: Scope, staging: Path) -> dict[str, Any]:
        entries: dict[str, Any] = {}
        for name, where in self.layout.items():
            value = scope.find_var(name)
            files: dict[str, bytes] = {}
            if isinstance(value, SelectedRows):
                files[_file_name(name)], files[_file_name(name + POOL_SUFFIX)] = encode_table(value)
                shape, dtype = list(value.shape), value.dtype.name
            elif isinstance(value, LoDTensor):
                files[_file_name(name)] = encode_tensor(value.array)
                shape, dtype = list(value.array.shape), value.array.dtype.name
            else:
                raise CheckpointError(f"checkpoint: {name} has no value in this scope to save")
            for file, data in files.items():
                write_atomic(staging / file, lambda out, data=data: out.write(data), durable=True)
            entries[name] = {**where.to_json(), "shape": shape, "dtype": dtype,
                             "files": {f: hashlib.sha256(d).hexdigest() for f, d in files.items()}}
        return entries

    def _validate_part(self, staging: Path, entries: Mapping[str, Any], name: str) -> None:
        """Read back the part just written, as a restore will: its PART.json, every file
        by its sha256, every tensor decoded to the shape its entry records, and that shape
        fits what the layout says the var is of the whole var (its rows, or the whole; a
        0-d var written `[1]` or back passes, as the readers accept it). A part that fails
        is an error now (`CheckpointError`, the staging folder removed), not at the next
        crash's restore."""
        where_part = f"checkpoint {name} part {self.part}"
        try:
            info = json.loads((staging / PART).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{where_part}: {PART} does not read back ({exc})") from None
        if info.get("vars") != json.loads(json.dumps(entries)):
            raise CheckpointError(f"{where_part}: {PART} does not read back as written")
        for var, entry in entries.items():
            where = self.layout[var]
            blobs = {}
            for file, sha in entry["files"].items():
                try:
                    blobs[file] = (staging / file).read_bytes()
                except OSError as exc:
                    raise CheckpointError(f"{where_part}: {file} does not read back ({exc.strerror})") from None
                if hashlib.sha256(blobs[file]).hexdigest() != sha:
                    raise CheckpointError(f"{where_part}: {file} does not read back as written (sha256)")
            file = _file_name(var)
            try:
                if where.table:
                    rows, value, _ = decode_table(blobs[file], blobs[_file_name(var + POOL_SUFFIX)], f"{where_part}: {file}")
                    # (a table's entry records the SelectedRows' own shape: its height, not its value's rows)
                    shape = list(entry["shape"])
                    fits = rows.size <= value.shape[0] and tuple(value.shape[1:]) == tuple(where.piece_shape()[1:])
                else:
                    array = decode_tensor(blobs[file], f"{where_part}: {file}").array
                    shape = list(array.shape)
                    if where.rows is None:
                        fits = conform_scalar(array, where.whole_shape) is not None
                    else:
                        fits = tuple(array.shape) == where.piece_shape()
            except TensorFileError as exc:
                raise CheckpointError(str(exc)) from None
            if shape != list(entry["shape"]):
                raise CheckpointError(f"{where_part}: {file} reads back as shape {shape}, {PART} says {entry['shape']}")
            if not fits:
                rows = "whole" if where.rows is None else f"rows [{where.rows[0]}, {where.rows[1]})"
                if where.cols is not None:
                    rows += f" x columns [{where.cols[0]}, {where.cols[1]})"
                raise CheckpointError(f"{where_part}: {var} has shape {shape}, which is not {rows} of {where.origin} "
                                      f"{list(where.whole_shape)}: it could not be restored")

    def _complete(self, folder: Path, step: int) -> None:
        """Write MANIFEST.json and `latest` if every part is in (any part's writer may).
        In a directory of its own the set is complete when trainer 0 sends the job
        manifest (`commit`)."""
        if not self.shared:
            self.prune(protect=step)
            return
        parts, states = {}, {}
        for part in self.parts:
            try:
                info = json.loads((folder / part / PART).read_text())
            except (OSError, ValueError):
                self.prune(protect=step)  # not all in yet: the last part's writer completes it
                return
            if info.get("step") != step:
                self.prune(protect=step)
                return
            parts[part] = info["vars"]
            if "state" in info:
                states[part] = info["state"]
        manifest = {"format": FORMAT, "step": step, "plan": json.loads(self.plan_text),
                    "plan_sha256": plan_fingerprint(self.plan_text), "parts": parts,
                    **({"states": states} if states else {})}
        validate_manifest(manifest, folder)  # before it exists: an invalid set stays incomplete, never restored
        _write_json(folder / MANIFEST, manifest)
        if read_manifest(folder) != json.loads(json.dumps(manifest)):
            raise CheckpointError(f"{folder}: {MANIFEST} does not read back as written")
        _fsync_dir(folder)
        _point_latest(self.root, folder, step)
        self.prune()

    def commit(self, name: str, manifest: Mapping[str, Any]) -> Path:
        """A directory of its own: keep a copy of checkpoint `name`'s job manifest beside
        this part (`<root>/<name>/MANIFEST.json`), once it is checked against the part on
        disk (the manifest's entry for this part is this part's PART.json, the plan is this
        plan, the set is restorable); point `latest` at it and prune. The checkpoint is then
        complete in this dir: a restore needs nothing outside it (`ops.rpc.own_dirs`)."""
        step = step_of(name)
        if step is None:
            raise CheckpointPathError(f"checkpoint name {name!r} is not ckpt-<step>")
        folder = confine(self.root, name)
        where = f"checkpoint {name} part {self.part}"
        check_manifest_form(manifest, self.parts)
        if manifest.get("format") != FORMAT or manifest.get("step") != step:
            raise CheckpointError(f"{where}: the job manifest sent is not a {FORMAT} manifest of step {step}")
        parts = manifest.get("parts")
        if not isinstance(parts, dict) or sorted(parts) != sorted(self.parts) or not part_fits(parts.get(self.part), self.layout):
            # (not the plan's fingerprint: a restarted job's endpoints, in the plan, differ; its layout does not)
            raise CheckpointError(f"{where}: the job manifest sent is of another plan (other parts or vars)")
        try:
            info = json.loads((folder / self.part / PART).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{where}: this pserver holds no such part ({exc})") from None
        if parts[self.part] != info.get("vars") or info.get("step") != step:
            raise CheckpointError(f"{where}: the job manifest sent does not describe the part on disk")
        validate_manifest(manifest, folder)
        if not (folder / MANIFEST).is_file():
            _write_json(folder / MANIFEST, manifest)
            if read_manifest(folder) != json.loads(json.dumps(manifest)):
                raise CheckpointError(f"{folder}: {MANIFEST} does not read back as written")
            _fsync_dir(folder)
        _point_latest(self.root, folder, step)
        self.prune()
        return folder

    def prune(self, protect: int | None = None) -> None:
        """Remove all but the newest `keep` complete checkpoints, and incomplete ones
        older than the newest complete one. (In a directory of its own a checkpoint is
        complete once the job manifest's copy is beside the part: a part newer than the
        newest copy is kept, it may be the newest complete checkpoint of the job.) Of the
        incomplete ones newer than that, only the `INCOMPLETE_KEEP` written last are kept
        (and step `protect`, the part just written): notices of steps no other pserver
        saves, or trainer 0 never commits, cannot fill the disk."""
        import shutil

        found = sorted(((s, p) for p in self.root.iterdir() if (s := step_of(p.name)) is not None), reverse=True)
        complete = [s for s, p in found if (p / MANIFEST).is_file()]
        kept = set(complete[: self.keep])
        newest = complete[0] if complete else -1
        for step, path in found:
            if step not in kept and (step in complete or step < newest):
                shutil.rmtree(path, ignore_errors=True)
        pending = [(s, p) for s, p in found if s > newest and s != protect]

        def written(item: tuple[int, Path]) -> int:
            try:
                return item[1].stat().st_mtime_ns
            except OSError:
                return 0

        pending.sort(key=lambda item: (written(item), item[0]), reverse=True)
        for _, path in pending[INCOMPLETE_KEEP - (protect is not None and protect > newest):]:
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------ reading


def find_latest(path: Path, *, missing_ok: bool = False) -> Path | None:
    """The complete checkpoint `path` names: a checkpoint folder itself, or a root's
    newest complete `ckpt-<step>` (what `latest` names, or a newer complete one when a
    kill came between that one's manifest and `latest`); a per-pserver template's job root."""
    path = job_root(path)
    if (path / MANIFEST).is_file():
        return path
    candidates = []
    pointer = path / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        candidate = confine(path, name)
        if (candidate / MANIFEST).is_file() and step_of(candidate.name) is not None:
            candidates.append((step_of(candidate.name), candidate))
    # A newer complete one than `latest` names: a kill came between its manifest and `latest`.
    found = [(s, p) for p in (path.iterdir() if path.is_dir() else ()) if (s := step_of(p.name)) is not None
             and (p / MANIFEST).is_file()]
    candidates += found
    if candidates:
        return max(candidates, key=lambda c: c[0])[1]
    if missing_ok:
        return None
    raise CheckpointError(f"{path}: no complete checkpoint (no {MANIFEST}, no {LATEST}, no complete {PREFIX}<step>)")


def write_job_manifest(template: Path | str, name: str, parts: int, plan_text: str, keep: int = DEFAULT_KEEP,
                       infos: Mapping[str, Mapping[str, Any]] | None = None) -> Path:
    """Trainer 0, once all `parts` pservers answered checkpoint `name` in their own dirs
    (`template`): take every part's PART.json (`infos`, by part, as each pserver sent it
    over RPC; None: read where its pserver wrote it), check the set as a restore needs
    it, write `<job root>/name/MANIFEST.json` (every part's vars and `locations`) and
    `latest`, and keep the newest `keep` job manifests. Returns the job-level checkpoint
    folder."""
    import shutil

    step = step_of(name)
    if step is None:
        raise CheckpointPathError(f"checkpoint name {name!r} is not ckpt-<step>")
    root = job_root(template)
    root.mkdir(parents=True, exist_ok=True)
    folder = confine(root, name)
    vars_, locations, states = {}, {}, {}
    for index in range(parts):
        part = f"ps{index}"
        where = Path(os.path.abspath(confine(part_root(template, index), name) / part))
        if infos is not None:
            info = infos.get(part, {})
        else:
            try:
                info = json.loads((where / PART).read_text())
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"checkpoint {name}: part {part} does not read at {where} ({exc})") from None
        if info.get("part", part) != part:
            raise CheckpointError(f"checkpoint {name}: the PART.json given for {part} is {info.get('part')}'s")
        if info.get("step") != step or info.get("plan_sha256") != plan_fingerprint(plan_text):
            raise CheckpointError(f"checkpoint {name}: {where / PART} is of step {info.get('step')} or another plan")
        vars_[part], locations[part] = info["vars"], str(where)
        if "state" in info:
            states[part] = info["state"]
    manifest = {"format": FORMAT, "step": step, "plan": json.loads(plan_text), "plan_sha256": plan_fingerprint(plan_text),
                "parts": vars_, "locations": locations, **({"states": states} if states else {})}
    validate_manifest(manifest, folder)
    folder.mkdir(exist_ok=True)
    _write_json(folder / MANIFEST, manifest)
    if read_manifest(folder) != json.loads(json.dumps(manifest)):
        raise CheckpointError(f"{folder}: {MANIFEST} does not read back as written")
    _fsync_dir(folder)
    _point_latest(root, folder, step)
    found = sorted(((s, p) for p in root.iterdir() if (s := step_of(p.name)) is not None and (p / MANIFEST).is_file()),
                   reverse=True)
    for _, path in found[keep:]:
        shutil.rmtree(path, ignore_errors=True)
    return folder


_DIM_MAX = 1 << 62  # a dim or a row bound of a manifest entry
_NDIM_MAX = 16


def _ints(value: Any, count: int | None, what: str) -> None:
    if not isinstance(value, list) or (count is not None and len(value) != count) or len(value) > _NDIM_MAX or \
            not all(type(v) is int and 0 <= v < _DIM_MAX for v in value):
        raise CheckpointError(f"{what} is not {count or 'up to ' + str(_NDIM_MAX)} int(s) in [0, 2**62)")


def check_manifest_form(manifest: Any, parts: Sequence[str]) -> None:
    """A job manifest another process sent (`CheckpointCommit`, `CheckpointRestore`):
    the fields a restore reads, of the types it reads them as (a part for each of
    `parts`, each entry's origin, shapes and rows ints in [0, 2**62), its files sha256
    hex), before anything walks or multiplies them. `CheckpointError` otherwise."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or type(manifest.get("step")) is not int:
        raise CheckpointError(f"the job manifest sent is not a {FORMAT} manifest with a step")
    found = manifest.get("parts")
    if not isinstance(found, dict) or sorted(found) != sorted(parts):
        raise CheckpointError(f"the job manifest sent does not hold the parts {list(parts)}")
    for part, vars_ in found.items():
        if not isinstance(vars_, dict):
            raise CheckpointError(f"the job manifest's part {part} is not a JSON object of vars")
        for var, entry in vars_.items():
            where = f"the job manifest's entry {part}/{var[:100]}"
            if not isinstance(entry, dict) or not isinstance(entry.get("origin"), str) or \
                    not isinstance(entry.get("dtype"), str) or not isinstance(entry.get("files"), dict):
                raise CheckpointError(f"{where} lacks an origin, a dtype or its files")
            _ints(entry.get("whole_shape"), None, f"{where}: whole_shape")
            _ints(entry.get("shape"), None, f"{where}: shape")
            for key in ("rows", "cols"):
                if entry.get(key) is not None:
                    _ints(entry[key], 2, f"{where}: {key}")
                    if entry[key][0] > entry[key][1]:
                        raise CheckpointError(f"{where}: {key} {entry[key]} is not a range")
            if not all(isinstance(f, str) and isinstance(h, str) and re.fullmatch(r"[0-9a-f]{64}", h)
                       for f, h in entry["files"].items()):
                raise CheckpointError(f"{where}: its files are not name -> sha256")


def validate_manifest(manifest: Mapping[str, Any], folder: Path) -> None:
    """What a restore needs of a manifest, from its entries alone: every whole var's
    pieces agree on its shape and dtype, and its row pieces cover every row once."""
    origins: dict[str, list[Mapping[str, Any]]] = {}
    for vars_ in manifest["parts"].values():
        for entry in vars_.values():
            origins.setdefault(entry["origin"], []).append(entry)
    for origin, pieces in sorted(origins.items()):
        shapes = {tuple(e["whole_shape"]) for e in pieces}
        dtypes = {e["dtype"] for e in pieces}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise CheckpointError(f"{folder}: the parts disagree on {origin}: shapes {sorted(map(list, shapes))}, "
                                  f"dtypes {sorted(dtypes)}")
        if any(e.get("cols") is not None for e in pieces):  # 2-D partitions: every element held once
            whole = shapes.pop()
            height, width = whole[0], math.prod(whole[1:]) if len(whole) >= 2 else 1
            area = sum((e["rows"][1] - e["rows"][0]) * ((e["cols"][1] - e["cols"][0]) if e.get("cols") else width)
                       for e in pieces if e["rows"] is not None)
            if area != height * width:
                raise CheckpointError(f"{folder}: the parts hold {area} of {origin}'s {height * width} elements: "
                                      "its partitions do not tile it")
            continue
        ranges = sorted(tuple(e["rows"]) for e in pieces if e["rows"] is not None and not e.get("table"))
        if not ranges:
            continue
        height, covered = shapes.pop()[0], 0
        for start, end in ranges:
            if start != covered:
                raise CheckpointError(f"{folder}: the parts hold rows [{start}, {end}) of {origin} after row {covered}: "
                                      f"its {height} rows are not each held once")
            covered = end
        if covered != height:
            raise CheckpointError(f"{folder}: the parts hold only {covered} of {origin}'s {height} rows")


def read_manifest(folder: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: unreadable {MANIFEST} ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{folder}: {MANIFEST} is not a {FORMAT} manifest")
    return manifest


class CheckpointReader:
    """Whole vars (and table rows) out of a complete checkpoint, checksums verified."""

    def __init__(self, path: Path) -> None:
        self.folder = find_latest(path)
        self.manifest = read_manifest(self.folder)
        self.step = int(self.manifest["step"])
        for part, vars_ in self.manifest["parts"].items():  # names from a file: read only inside the folder
            files = [f for entry in vars_.values() for f in entry["files"]]
            bad_file = any("/" in f or "\x00" in f or f in ("", ".", "..") for f in files)
            if bad_file or not re.fullmatch(r"ps\d+|local", part):
                raise CheckpointError(f"{self.folder}: {MANIFEST} names a part or file outside the checkpoint")
        self._wholes: dict[str, np.ndarray] = {}
        self._pieces: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # a partitioned table's rows (`table_rows`)
        self._found: dict[str, Path] = {}  # each part's folder, found when first read

    @property
    def _dirs(self) -> Mapping[str, Path]:
        return _PartDirs(self)

    def _part_dir(self, part: str) -> Path:
        """Where `part`'s files are: beside the manifest (a shared dir, or a gathered copy),
        else where the job manifest's `locations` says (its pserver's own dir)."""
        here = self.folder / part
        if (here / PART).is_file() or here.is_dir():
            return here
        location = self.manifest.get("locations", {}).get(part)
        if location is not None:
            there = self.folder / location  # absolute stays absolute
            if (there / PART).is_file():
                return there
            raise CheckpointError(f"{self.folder}: part {part} is neither at {there} nor gathered in {here}")
        raise CheckpointError(f"{self.folder}: part {part} is missing ({here})")

    def _bytes(self, part: str, file: str, sha: str) -> bytes:
        path = self._dirs[part] / file
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
        if hashlib.sha256(data).hexdigest() != sha:
            raise CheckpointError(f"{path}: sha256 does not match {MANIFEST}: the checkpoint is damaged")
        return data

    def entries(self) -> list[tuple[str, str, dict[str, Any]]]:
        return [(part, name, entry) for part, vars_ in sorted(self.manifest["parts"].items())
                for name, entry in sorted(vars_.items())]

    def origins(self) -> list[str]:
        return sorted({entry["origin"] for _, _, entry in self.entries()})

    def whole(self, origin: str) -> np.ndarray:
        """The whole var `origin` assembled from every part's rows (a table: dense, rows
        never touched are 0)."""
        if origin in self._wholes:
            return self._wholes[origin]
        pieces = [(part, name, e) for part, name, e in self.entries() if e["origin"] == origin]
        if not pieces:
            raise CheckpointError(f"{self.folder}: the checkpoint holds no var {origin!r}")
        shape = tuple(pieces[0][2]["whole_shape"])
        if pieces[0][2].get("table"):
            rows, values = self.table_rows(origin)
            whole = np.zeros(shape, values.dtype)
            whole[rows] = values
        elif all(e["rows"] is None for _, _, e in pieces):
            whole = self._read(*pieces[0])
        elif any(e.get("cols") is not None for _, _, e in pieces):  # 2-D partitions
            width = math.prod(shape[1:]) if len(shape) >= 2 else 1
            parts = [(e, self._read(p, n, e)) for p, n, e in pieces if e["rows"] is not None]
            flat = np.empty((shape[0], width), parts[0][1].dtype)
            covered = np.zeros((shape[0], width), bool)
            for e, array in parts:
                (r0, r1), (c0, c1) = e["rows"], e.get("cols") or (0, width)
                flat[r0:r1, c0:c1] = array.reshape(r1 - r0, c1 - c0)
                covered[r0:r1, c0:c1] = True
            if not covered.all():
                raise CheckpointError(f"{self.folder}: the parts hold only {int(covered.sum())} of {origin}'s "
                                      f"{covered.size} elements")
            whole = flat.reshape(shape)
        else:
            parts = [(tuple(e["rows"]), self._read(p, n, e)) for p, n, e in pieces if e["rows"] is not None]
            whole = np.empty(shape, parts[0][1].dtype)
            covered = np.zeros(shape[0], bool)
            for (start, end), array in parts:
                whole[start:end] = array
                covered[start:end] = True
            if not covered.all():
                raise CheckpointError(f"{self.folder}: the parts hold only {int(covered.sum())} of {origin}'s {shape[0]} rows")
        self._wholes[origin] = whole
        return whole

    def _read(self, part: str, name: str, entry: Mapping[str, Any]) -> np.ndarray:
        file = _file_name(name)
        array = decode_tensor(self._bytes(part, file, entry["files"][file]), str(self._dirs[part] / file)).array
        fitted = conform_scalar(array, entry["shape"])  # a 0-d var an older writer wrote [1]
        if fitted is None:
            raise CheckpointError(f"{self._dirs[part] / file}: shape {list(array.shape)}, the manifest says {entry['shape']}")
        return fitted

    def table_parts(self, origin: str) -> list[tuple[str, np.ndarray, np.ndarray, int]]:
        """Per part: (part, rows, value including the pool, height)."""
        out = []
        for part, name, entry in self.entries():
            if entry["origin"] == origin and entry.get("table"):
                file, pool = _file_name(name), _file_name(name + POOL_SUFFIX)
                rows, value, height = decode_table(self._bytes(part, file, entry["files"][file]),
                                                   self._bytes(part, pool, entry["files"][pool]), str(self._dirs[part] / file))
                out.append((part, rows, value, height))
        return out

    def table_rows(self, origin: str) -> tuple[np.ndarray, np.ndarray]:
        """Every touched row of the table: (ids, values), ids ascending. A table cut by a
        partitioner is joined from its pieces (ids re-based to their rows, columns ranges
        of the row): a row must be held by every column piece of its band."""
        pieces = [(name, e) for part, name, e in self.entries() if e["origin"] == origin and e.get("table")]
        if any(e.get("rows") is not None for _, e in pieces):
            if origin not in self._pieces:  # every piece of the table restores from the same rows
                self._pieces[origin] = self._piece_rows(origin, [e for _, e in pieces])
            return self._pieces[origin]
        parts = self.table_parts(origin)
        if not parts:
            raise CheckpointError(f"{self.folder}: the checkpoint holds no table {origin!r}")
        rows = np.concatenate([r for _, r, _, _ in parts])
        values = np.concatenate([v[: r.size] for _, r, v, _ in parts])
        order = np.argsort(rows, kind="stable")
        return rows[order], values[order]

    def _piece_rows(self, origin: str, entries: list[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        shape = tuple(entries[0]["whole_shape"])
        width = math.prod(shape[1:]) if len(shape) >= 2 else 1
        pieces = []
        for (part, rows, value, _), entry in zip(self.table_parts(origin), entries, strict=True):
            (r0, r1), (c0, c1) = entry["rows"], entry.get("cols") or (0, width)
            if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= r1 - r0):
                raise CheckpointError(f"{self.folder}: a piece of {origin} in {part} holds a row outside its {r1 - r0}")
            pieces.append((rows + r0, value[: rows.size].reshape(rows.size, -1), c0, c1))
        ids, values, held = join_pieces(pieces, width, pieces[0][1].dtype)
        if not held.all():
            bad = int(ids[~held.all(axis=1)][0])
            raise CheckpointError(f"{self.folder}: row {bad} of {origin} is held by only some of its column pieces")
        return ids, values.reshape(ids.size, *shape[1:])

    def own_part_fits(self, layout: Mapping[str, VarSlice], part: str, parts: int) -> bool:
        """True when `part` of this checkpoint holds exactly what `layout` wants (the same
        pserver count and placement): a restore then reads that one part and nothing else."""
        return len(self.manifest["parts"]) == parts and part_fits(self.manifest["parts"].get(part), layout)

    def restore(self, scope: Scope, layout: Mapping[str, VarSlice], part: str, parts: int) -> None:
        """Set every var of `layout` in `scope` from the checkpoint, cut to its rows
        (`part` of `parts`: "ps<i>" of M', or "local"). Where `part` holds exactly the
        layout's vars (the same pserver count and plan), only that part is read: the same
        values (its rows are the rows cut from the whole), and no other pserver's dir."""
        if self.own_part_fits(layout, part, parts):
            self._restore_own(scope, layout, part)
            return
        for name, where in layout.items():
            if where.table:
                self._restore_table(scope, name, where, part, parts)
                continue
            saved = self.whole(where.origin)
            whole = conform_scalar(saved, where.whole_shape)  # a Fluid 1.8 [1] scalar onto a 0-d var, or back
            if whole is None:
                raise CheckpointError(
                    f"{self.folder}: {where.origin} has shape {list(saved.shape)}, this program's is {list(where.whole_shape)}")
            scope.set_var(name, LoDTensor(np.array(where.cut(whole))))

    def _restore_own(self, scope: Scope, layout: Mapping[str, VarSlice], part: str) -> None:
        entries = self.manifest["parts"][part]
        for name, where in layout.items():
            entry = entries[name]
            if where.table:
                table = scope.find_var(name)
                if not isinstance(table, SelectedRows):
                    raise CheckpointError(f"restore: {name} is not a sparse table in this scope")
                file, pool = _file_name(name), _file_name(name + POOL_SUFFIX)
                rows, value, _ = decode_table(self._bytes(part, file, entry["files"][file]),
                                              self._bytes(part, pool, entry["files"][pool]), str(self._dirs[part] / file))
                with table.lock:
                    _set_table(table, rows, value)
                continue
            saved = self._read(part, name, entry)
            want = where.piece_shape()  # a 2-D partition's [rows, cols] too
            array = conform_scalar(saved, want)
            if array is None:
                raise CheckpointError(f"{self.folder}: {name} has shape {list(saved.shape)}, this program's is {list(want)}")
            scope.set_var(name, LoDTensor(np.array(array)))

    def _restore_table(self, scope: Scope, name: str, where: VarSlice, part: str, parts: int) -> None:
        """The same pserver count: the exact shard, pool included; another: the rows with
        `id % parts == i`, the pool this pserver's startup drew."""
        table = scope.find_var(name)
        if not isinstance(table, SelectedRows):
            raise CheckpointError(f"restore: {name} is not a sparse table in this scope")
        if where.rows is not None:
            self._restore_piece(table, where)
            return
        saved = self.table_parts(where.origin)
        mine = [s for s in saved if s[0] == part]
        old_style = all(e.get("rows") is None for _, _, e in self.entries() if e["origin"] == where.origin)
        if len(saved) == parts and mine and old_style:
            _, rows, value, _ = mine[0]
            with table.lock:
                _set_table(table, rows, value)
            return
        ids, values = self.table_rows(where.origin)
        set_table_rows(table, ids, values, parts, _index_of(part))

    def _restore_piece(self, table: SelectedRows, where: VarSlice) -> None:
        """A piece of a partitioned distributed table (rows `where.rows`, columns
        `where.cols`) from whatever the checkpoint holds of its table: pieces of any
        partitioner or `id % M` shards. An accumulator gets its table's rows, in the same
        slots (it follows them); a row it never held keeps this pserver's initial value."""
        r0, r1 = where.rows
        width = math.prod(where.whole_shape[1:]) if len(where.whole_shape) >= 2 else 1
        c0, c1 = where.cols or (0, width)
        ids = self.table_rows(where.follows or where.origin)[0]
        ids = ids[(ids >= r0) & (ids < r1)]
        has = any(e["origin"] == where.origin for _, _, e in self.entries())
        own_ids, own_values = self.table_rows(where.origin) if has else (np.zeros(0, np.int64), None)
        with table.lock:
            value = np.array(table.value)
            if value.shape[0] < ids.size:
                raise CheckpointError(f"restore: {where.origin} rows [{r0}, {r1}): {ids.size} saved rows do not fit "
                                      f"a piece of {value.shape[0]}")
            if own_values is not None:
                at = np.searchsorted(own_ids, ids)
                found = (at < own_ids.size) & (own_ids[np.minimum(at, max(own_ids.size - 1, 0))] == ids) \
                    if own_ids.size else np.zeros(ids.size, bool)
                flat = own_values.reshape(own_ids.size, -1)[:, c0:c1]
                rows = np.flatnonzero(found)
                value.reshape(value.shape[0], -1)[rows] = flat[at[found]].astype(value.dtype)
            _set_table(table, ids - r0, value)


def part_fits(entries: Any, layout: Mapping[str, VarSlice]) -> bool:
    """True when a part's vars (PART.json's `vars`) are exactly `layout`'s: the same
    names, each the same rows of the same whole var (or the same table)."""
    if not isinstance(entries, dict) or set(entries) != set(layout):
        return False
    return all(isinstance(e := entries[name], dict) and e.get("origin") == where.origin
               and tuple(e.get("whole_shape", ())) == where.whole_shape
               and e.get("rows") == (list(where.rows) if where.rows is not None else None)
               and e.get("cols") == (list(where.cols) if where.cols is not None else None)
               and bool(e.get("table")) == where.table for name, where in layout.items())


class _PartDirs(Mapping[str, Path]):
    """A reader's part folders, each looked for when first asked: a reader of one part
    never touches where the others are."""

    def __init__(self, reader: CheckpointReader) -> None:
        self._reader = reader

    def __getitem__(self, part: str) -> Path:
        found = self._reader._found  # noqa: SLF001
        if part not in found:
            found[part] = self._reader._part_dir(part)  # noqa: SLF001
        return found[part]

    def __iter__(self):
        return iter(self._reader.manifest["parts"])

    def __len__(self) -> int:
        return len(self._reader.manifest["parts"])


def _index_of(part: str) -> int:
    return int(part[2:]) if part.startswith("ps") else 0


def _set_table(table: SelectedRows, rows: np.ndarray, value: np.ndarray) -> None:
    table.rows = np.array(rows, np.int64)
    table.value = np.array(value, table.dtype)
    table._index = None  # noqa: SLF001 - rebuilt from rows on the next lookup
    table._rows_buf = None  # noqa: SLF001


def set_table_rows(table: SelectedRows, ids: np.ndarray, values: np.ndarray, parts: int, index: int) -> None:
    """Make `table` (pserver `index` of `parts`'s shard) hold the rows of `ids` with
    `id % parts == index`; the rows after them keep the pool this pserver drew."""
    keep = ids % parts == index
    rows = ids[keep]
    with table.lock:
        pool = table.value[rows.size :]
        _set_table(table, rows, np.concatenate([values[keep].astype(table.dtype), pool]))


def warm_start(scope: Scope, layout: Mapping[str, VarSlice], folder: Path, parts: int, index: int) -> list[str]:
    """Set the vars of `layout` whose whole var has a LoDTensor file in `folder` (named
    by the whole var, as `save_persistables` and `pstranspile fetch` write), cut to their
    rows; a table's file is its dense whole (every row is set). Returns what was set."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"warm start: {folder} is not a folder of LoDTensor files")

    def read(origin: str) -> tuple[bytes, str] | None:
        path = folder / _file_name(origin)
        if not path.is_file():
            return None
        try:
            return path.read_bytes(), str(path)
        except OSError as exc:
            raise CheckpointError(f"warm start: cannot read {path}: {exc.strerror}") from None

    return _warm_start(scope, layout, read, parts, index)


def warm_start_files(scope: Scope, layout: Mapping[str, VarSlice], files: Mapping[str, bytes], where: str) -> list[str]:
    """`warm_start` from LoDTensor files' bytes by file name (trainer 0's state relayed over
    RPC from a `{pserver}` template's restore, `ops.rpc.own_dirs`); `where` names their origin
    in errors. Returns what was set."""

    def read(origin: str) -> tuple[bytes, str] | None:
        data = files.get(_file_name(origin))
        return None if data is None else (data, f"{where}: {origin}")

    return _warm_start(scope, layout, read, 1, 0)


def _warm_start(scope: Scope, layout: Mapping[str, VarSlice], read_file: Any, parts: int, index: int) -> list[str]:
    loaded = []
    for name, where in layout.items():
        found = read_file(where.origin)
        if found is None:
            continue
        data, path = found
        read = decode_tensor(data, path).array
        whole = conform_scalar(read, where.whole_shape)  # Fluid 1.8 wrote scalars [1], Paddle 2.x 0-d
        if whole is None:
            raise CheckpointError(f"warm start: {path} has shape {list(read.shape)}, {where.origin}'s is {list(where.whole_shape)}")
        if where.table:
            table = scope.find_var(name)
            if not isinstance(table, SelectedRows):
                raise CheckpointError(f"warm start: {name} is not a sparse table in this scope")
            if where.rows is not None:  # a piece: every row of its band, its columns
                (r0, r1), flat = where.rows, whole.reshape(whole.shape[0], -1)
                c0, c1 = where.cols or (0, flat.shape[1])
                with table.lock:
                    _set_table(table, np.arange(r1 - r0, dtype=np.int64), np.array(flat[r0:r1, c0:c1], table.dtype))
            else:
                set_table_rows(table, np.arange(whole.shape[0], dtype=np.int64), whole, parts, index)
        else:
            value = scope.find_var(name)
            array = where.cut(whole)
            dtype = value.array.dtype if isinstance(value, LoDTensor) else array.dtype
            scope.set_var(name, LoDTensor(np.array(array, dtype)))
        loaded.append(name)
    return loaded


__all__ = [
    "DEFAULT_KEEP",
    "LATEST",
    "MANIFEST",
    "CheckpointError",
    "check_manifest_form",
    "CheckpointPathError",
    "CheckpointReader",
    "Checkpointer",
    "VarSlice",
    "checkpoint_name",
    "confine",
    "find_latest",
    "is_template",
    "job_root",
    "part_root",
    "local_layout",
    "pserver_layout",
    "part_fits",
    "read_manifest",
    "set_table_rows",
    "step_of",
    "validate_manifest",
    "var_of_file_name",
    "warm_start",
    "warm_start_files",
    "write_job_manifest",
]
