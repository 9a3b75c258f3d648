"""Checkpoints in per-pserver directories that only their own pserver can read (a
StatefulSet's volume per pserver, a local disk per machine): nothing is read across
processes, every piece of the job-level bookkeeping travels over RPC.

Saving checkpoint `ckpt-<s>` (trainer 0, `--checkpoint-dir` a `{pserver}` template):

1. `CheckpointNotify`: each pserver writes its part into its own dir (`<root i>/ckpt-<s>/ps<i>/`,
   staged, validated, renamed: `ops.rpc.checkpoint.Checkpointer.save`).
2. `CheckpointPart`: each pserver answers its part's PART.json (what it holds, sha256s).
3. Trainer 0 builds the job manifest from those answers and checks the set
   (`write_job_manifest(infos=...)`), writes it into its own dir (the template with
   `{pserver}` = `job`; a scratch dir, read by no other process), then
4. `CheckpointCommit`: each pserver checks the manifest against the part on its disk and
   keeps a copy beside it (`<root i>/ckpt-<s>/MANIFEST.json`, then `latest`). From then
   on the checkpoint is complete in every pserver's own dir.

Restoring (`--restore` a `{pserver}` template: `launch --max-restarts`, `serve --restore`,
`Session(restore=...)`): a pserver does not choose alone (trainer 0 may have died between
two pservers' commits: one holds ckpt-6's manifest copy, the other only its part). It
serves with every var RPC refused (`FAILED_PRECONDITION`) until trainer 0 agrees the step:

1. `CheckpointList`: each pserver answers the steps it holds a manifest copy of (of this
   plan) and the steps it holds a part of.
2. Trainer 0 takes the newest step that some pserver holds the manifest of and every
   pserver holds its part of, asks one holder for that manifest (`CheckpointPart`,
   `manifest`), and
3. `CheckpointRestore` (step, manifest) to every pserver: each commits the copy if it
   lacked it and restores from its own part alone (`CheckpointReader.own_part_fits`: the
   same plan), then opens. The other trainers send `CheckpointRestore` without a step:
   it waits for trainer 0's and answers the step, their `Session.steps`.

Trainer 0's own state (the params no pserver holds: batch norm's moving stats) is in its
own dir (`<job dir>/ckpt-<s>/trainer0/`, written before the pservers complete the
checkpoint). Trainer 0 reads it back at the agreed step and sends it with its
`CheckpointRestore` (`trainer_state`, LoDTensor file bytes by var); each pserver keeps it
in memory and answers it to the other trainers' waiting calls, so every trainer restarts
those params from trainer 0's, as from a shared dir's `trainer0/`.

A checkpoint "of this plan" is one whose part has exactly this pserver's vars (names,
rows, tables) among as many parts: not the plan's fingerprint, which holds the endpoints a
restarted job changes. No step held everywhere: a launcher's restart
(`PSTRANSPILE_RESTORE_IF_ANY`) starts from scratch when no pserver holds a manifest copy; anything else is an error
naming what each pserver holds. Restoring onto another pserver count (another plan) reads
every part: restore the job manifest's folder (or a gathered copy) by its path instead.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from ops.rpc.checkpoint import (
    MANIFEST,
    PART,
    TRAINER_STATE,
    CheckpointError,
    CheckpointPathError,
    CheckpointReader,
    VarSlice,
    check_manifest_form,
    checkpoint_name,
    confine,
    part_fits,
    part_root,
    read_manifest,
    step_of,
)
from ops.scope import Scope
from proto import rpc_pb2

RESTORE_METHODS = frozenset({"CheckpointList", "CheckpointPart", "CheckpointRestore", "Watch", "SendComplete"})


def held(root: Path, part: str, parts_count: int, layout: Mapping[str, VarSlice]) -> dict[str, list[int]]:
    """What pserver `part`'s own dir `root` holds that this pserver can restore from its
    part alone (`parts_count` parts, its vars `layout`'s; not the plan's fingerprint: a
    restarted job's endpoints differ): `committed`, the steps with a manifest copy;
    `parts`, the steps with this part (PART.json)."""
    committed, parts = [], []
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        step = step_of(folder.name)
        if step is None:
            continue
        try:
            info = json.loads((folder / part / PART).read_text())
        except (OSError, ValueError):
            continue
        if info.get("step") != step or len(info.get("parts", ())) != parts_count or not part_fits(info.get("vars"), layout):
            continue
        parts.append(step)
        try:
            manifest = read_manifest(folder)
        except CheckpointError:
            continue
        if manifest.get("step") == step and manifest.get("parts", {}).get(part) == info.get("vars"):
            committed.append(step)
    return {"committed": sorted(committed), "parts": sorted(parts)}


class PartRestorer:
    """A pserver's restore from its own dir, at the step trainer 0 agrees
    (`CheckpointRestore`); until then the pserver is `pending`."""

    def __init__(self, template: Path | str, index: int, part: str, parts: int, layout: Mapping[str, VarSlice],
                 plan_text: str) -> None:
        self.root = part_root(template, index)
        self.part, self.parts, self.layout, self.plan_text = part, parts, layout, plan_text
        self.step: int | None = None  # restored at (0: started from scratch); None: not yet
        self.reason: str | None = None  # a restore that failed
        self.trainer_state: dict[str, bytes] = {}  # trainer 0's own state at the step, for the other trainers
        self._cond = threading.Condition()
        self._waiting: set[int] = set()  # trainers with a CheckpointRestore waiting: one each

    @property
    def pending(self) -> bool:
        with self._cond:
            return self.step is None

    def held(self) -> dict[str, Any]:
        return {**held(self.root, self.part, self.parts, self.layout), "part": self.part}

    def manifest_text(self, name: str) -> str:
        folder = confine(self.root, name)
        try:
            return (folder / MANIFEST).read_text()
        except OSError as exc:
            raise CheckpointError(f"{folder}: no {MANIFEST} here ({exc.strerror})") from None

    def restore(self, scope: Scope, name: str, manifest: Mapping[str, Any] | str | None, commit: Any,
                trainer_state: Mapping[str, bytes] | None = None) -> int:
        """Restore from checkpoint `name` of this dir (`name` empty: from scratch), once;
        `commit(name, manifest)` keeps the manifest's copy; `trainer_state` (trainer 0's own
        state at that step) is kept for the other trainers' waits. The step."""
        with self._cond:
            if self.step is not None:
                want = step_of(name) if name else 0
                if want != self.step:
                    raise CheckpointError(f"{self.part} restored step {self.step} already, not {name or 'from scratch'}")
                return self.step
            try:
                step = 0
                if name:
                    if isinstance(manifest, str):
                        manifest = json.loads(manifest)
                    if not isinstance(manifest, dict):
                        raise CheckpointError(f"the manifest sent for {name} is not a JSON object")
                    folder = commit(name, manifest)
                    reader = CheckpointReader(folder)
                    if not reader.own_part_fits(self.layout, self.part, self.parts):
                        raise CheckpointError(f"{folder}: part {self.part} does not hold this pserver's vars (another "
                                              "plan): restoring onto another layout reads every part, restore the job "
                                              "manifest's folder or a gathered copy instead")
                    reader.restore(scope, self.layout, self.part, self.parts)
                    step = reader.step
            except (CheckpointError, OSError, ValueError) as exc:
                self.reason = str(exc)
                raise CheckpointError(str(exc)) from None
            self.trainer_state = dict(trainer_state or {}) if step else {}
            self.step, self.reason = step, None  # (a failed try before, then this one: the waiters learn the step)
            self._cond.notify_all()
            return step

    def wait(self, trainer_id: int, seconds: float) -> int | None:
        """Trainer `trainer_id`'s wait for the agreed restore: the step (trainer 0's state
        at it: `trainer_state`), None after `seconds`. One wait per trainer at a time (a
        second is refused at once), so no trainer can park more than one server thread here."""
        with self._cond:
            if trainer_id in self._waiting:
                raise RestoreWaitRefused(f"trainer {trainer_id} already waits for the agreed restore")
            self._waiting.add(trainer_id)
            try:
                self._cond.wait_for(lambda: self.step is not None or self.reason is not None, timeout=seconds)
            finally:
                self._waiting.discard(trainer_id)
            if self.reason is not None:
                raise CheckpointError(self.reason)
            return self.step


class RestoreWaitRefused(CheckpointError):
    """A second `CheckpointRestore` wait of one trainer while its first one waits."""


class OwnDirRpc:
    """The pserver's RPC handlers of per-pserver dirs (mixed into `ops.rpc.server.PServer`,
    which provides `config`, `scope`, `_handle`, `_run`)."""

    def _restoring(self, method: str) -> str | None:
        """Why `method` is refused now: the pserver waits for its agreed restore."""
        restorer = getattr(self.config, "restorer", None)
        if restorer is None or method in RESTORE_METHODS or not restorer.pending:
            return None
        return (f"pserver {self.config.endpoint} is waiting for trainer 0 to agree the checkpoint it restores "
                f"(CheckpointRestore); {method} refused")

    def _checkpoint_name(self, name: str, context: Any, *, empty_ok: bool = False) -> str:
        """`name` if it is a `ckpt-<step>` name (or, with `empty_ok`, empty); refused
        `INVALID_ARGUMENT` otherwise: these methods name nothing else."""
        if (empty_ok and not name) or step_of(name) is not None:
            return name
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"pserver {self.config.endpoint}: checkpoint name {name[:60]!r} is not ckpt-<step>")
        return name  # (abort raises)

    def _rpc_CheckpointPart(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC's name
        def body() -> Any:
            name = self._checkpoint_name(request.dir, context)
            try:
                if request.manifest:
                    restorer = self.config.restorer
                    if restorer is None:
                        context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"pserver {self.config.endpoint} restores nothing")
                    return rpc_pb2.CheckpointMessage(dir=name, json=restorer.manifest_text(name))
                checkpointer = self._own_checkpointer(context)
                folder = confine(checkpointer.root, name)
                try:
                    text = (folder / checkpointer.part / PART).read_text()
                except OSError as exc:
                    raise CheckpointError(f"{folder}: no part {checkpointer.part} ({exc.strerror})") from None
                return rpc_pb2.CheckpointMessage(dir=name, json=text)
            except CheckpointPathError as exc:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"pserver {self.config.endpoint}: {exc}")
            except CheckpointError as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"pserver {self.config.endpoint}: {exc}")
        return self._handle(context, "CheckpointPart", request.trainer_id, "checkpoint part", body)

    def _rpc_CheckpointCommit(self, request: Any, context: Any) -> Any:  # noqa: N802
        def body() -> Any:
            name = self._checkpoint_name(request.dir, context)
            checkpointer = self._own_checkpointer(context)
            try:
                checkpointer.commit(name, _manifest_of(request.json))
            except CheckpointPathError as exc:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"pserver {self.config.endpoint}: commit {name}: {exc}")
            except CheckpointError as exc:  # a manifest that does not fit the part on disk, or no such part
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"pserver {self.config.endpoint}: commit {name}: {exc}")
            except OSError as exc:
                context.abort(grpc.StatusCode.INTERNAL, f"pserver {self.config.endpoint}: commit {name}: {exc}")
            return rpc_pb2.VoidMessage()
        return self._handle(context, "CheckpointCommit", request.trainer_id, "checkpoint commit", body)

    def _rpc_CheckpointList(self, request: Any, context: Any) -> Any:  # noqa: N802
        def body() -> Any:
            restorer = self.config.restorer
            if restorer is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"pserver {self.config.endpoint} was not started to restore from a {{pserver}} template")
            return rpc_pb2.CheckpointMessage(json=json.dumps({**restorer.held(), "restored": restorer.step}))
        return self._handle(context, "CheckpointList", request.trainer_id, "checkpoint list", body)

    def _rpc_CheckpointRestore(self, request: Any, context: Any) -> Any:  # noqa: N802
        def body() -> Any:
            restorer = self.config.restorer
            if restorer is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"pserver {self.config.endpoint} was not started to restore from a {{pserver}} template")
            try:
                if request.trainer_id != 0:  # wait for trainer 0's agreed restore, bounded by the call's deadline
                    left = context.time_remaining()
                    try:
                        step = restorer.wait(request.trainer_id, max(0.0, min(left if left is not None else 60.0, 600.0) - 0.5))
                    except RestoreWaitRefused as exc:
                        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"pserver {self.config.endpoint}: {exc}")
                    if step is None:
                        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"pserver {self.config.endpoint}: trainer 0 agreed no checkpoint to restore in time")
                    return rpc_pb2.CheckpointMessage(dir=checkpoint_name(step), json=json.dumps({"step": step}),
                                                     trainer_state=restorer.trainer_state)
                name = self._checkpoint_name(request.dir, context, empty_ok=True)
                manifest = None
                if name:  # the request itself, checked before the restore is tried (a refused one fails no waiter)
                    try:
                        manifest = _manifest_of(request.json)
                        check_manifest_form(manifest, tuple(f"ps{i}" for i in range(restorer.parts)))
                        check_state_names(request.trainer_state)
                    except CheckpointError as exc:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"pserver {self.config.endpoint}: restore {name}: {exc}")
                step = restorer.restore(self.scope, name, manifest, self._commit_for_restore, request.trainer_state)
                if step and not self.config.sync_mode and self.config.lr_decay_block >= 0:
                    self._run(self.config.lr_decay_block, "the lr-decay block")  # as after a restore at startup
            except CheckpointError as exc:
                # (no such part here, another plan's, a part that does not read back: not the pserver's own fault)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"pserver {self.config.endpoint}: restore {request.dir[:60]}: {exc}")
            if name:
                self._log(f"pserver {self.config.endpoint}: restored {len(restorer.layout)} var(s) from {name} "
                          f"in its own dir {restorer.root} (step {step}, agreed with trainer 0)")
            else:
                self._log(f"pserver {self.config.endpoint}: starts from scratch (no checkpoint complete in every "
                          "pserver's dir; agreed with trainer 0)")
            return rpc_pb2.CheckpointMessage(dir=name, json=json.dumps({"step": step}))
        return self._handle(context, "CheckpointRestore", request.trainer_id, "checkpoint restore", body)

    def _own_checkpointer(self, context: Any) -> Any:
        checkpointer = self.config.checkpointer
        if checkpointer is None or checkpointer.shared:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"pserver {self.config.endpoint} has no checkpoint dir of its own ({{pserver}} template)")
        return checkpointer

    def _commit_for_restore(self, name: str, manifest: Mapping[str, Any]) -> Path:
        """The restore's commit: into the restore dir (the manifest copy a pserver lacked
        when trainer 0 died between two pservers' commits)."""
        from ops.rpc.checkpoint import Checkpointer  # noqa: PLC0415 - a plain helper object

        restorer = self.config.restorer
        keep = self.config.checkpointer.keep if self.config.checkpointer is not None else 1 << 30
        own = Checkpointer(restorer.root, restorer.part, tuple(f"ps{i}" for i in range(restorer.parts)), restorer.layout,
                           restorer.plan_text, keep, shared=False)
        return own.commit(name, manifest)


def check_state_names(files: Mapping[str, bytes]) -> None:
    """Trainer 0's relayed state names LoDTensor files of a checkpoint's `trainer0/`: plain
    file names (a var's name, `/` and `%` escaped), nothing else."""
    for name in files:
        if not name or "/" in name or name in (".", "..") or len(name) > 1024:
            raise CheckpointError(f"trainer state file name {name[:60]!r} is not a var's file name")


def trainer_state_files(job_dir: Path | str, name: str) -> dict[str, bytes]:
    """Trainer 0: its own state at checkpoint `name` in its own (job) dir, LoDTensor file
    bytes by file name; empty when that checkpoint holds none (no such params, or a dir
    that did not survive the restart)."""
    folder = confine(Path(job_dir), name) / TRAINER_STATE
    if not folder.is_dir():
        return {}
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


def _manifest_of(text: str) -> dict[str, Any]:
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"the job manifest sent is not JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError("the job manifest sent is not a JSON object")
    return manifest


# ------------------------------------------------------------------ trainers


def save(client: Any, endpoints: Sequence[str], template: Path | str, name: str, plan_text: str, keep: int) -> Path:
    """Trainer 0: checkpoint `name` into the pservers' own dirs, every step over RPC (see
    the module docstring); the job manifest's folder in trainer 0's own dir."""
    from ops.rpc.checkpoint import write_job_manifest  # noqa: PLC0415

    client.checkpoint_notify(list(endpoints), name)
    replies = client.checkpoint_call("CheckpointPart", endpoints, rpc_pb2.CheckpointMessage(
        trainer_id=client.trainer_id, dir=name))
    infos = {f"ps{i}": _json_of(reply.json, f"pserver {ep}'s PART.json of {name}")
             for i, (ep, reply) in enumerate(zip(endpoints, replies, strict=True))}
    folder = write_job_manifest(template, name, len(endpoints), plan_text, keep, infos=infos)
    text = (folder / MANIFEST).read_text()
    client.checkpoint_call("CheckpointCommit", endpoints, rpc_pb2.CheckpointMessage(
        trainer_id=client.trainer_id, dir=name, json=text))
    return folder


def agree_restore(client: Any, endpoints: Sequence[str], *, if_any: bool = False) -> int:
    """Every trainer, before its startup program: the step the pservers restore (trainer 0
    chooses it and has them restore; the others wait for that). 0: from scratch."""
    return agreed_restore(client, endpoints, if_any=if_any)[0]


def agreed_restore(client: Any, endpoints: Sequence[str], *, if_any: bool = False,
                   job_dir: Path | str | None = None) -> tuple[int, dict[str, bytes]]:
    """`agree_restore`, and trainer 0's own state at the step (LoDTensor file bytes by file
    name): trainer 0 reads it from `job_dir` (its own dir) and sends it with its restore;
    the other trainers receive it in the pservers' answers."""
    message = rpc_pb2.CheckpointMessage(trainer_id=client.trainer_id)
    if client.trainer_id != 0:
        replies = client.checkpoint_call("CheckpointRestore", endpoints, message)
        steps = {_json_of(r.json, "a restore's answer")["step"] for r in replies}
        if len(steps) != 1:
            raise CheckpointError(f"the pservers restored different steps: {sorted(steps)}")
        states = [dict(r.trainer_state) for r in replies]
        if any(state != states[0] for state in states):
            raise CheckpointError("the pservers answered different trainer 0 states for the agreed step")
        return int(steps.pop()), states[0] if states else {}
    lists = [_json_of(r.json, f"pserver {ep}'s checkpoints") for ep, r in
             zip(endpoints, client.checkpoint_call("CheckpointList", endpoints, message), strict=True)]
    everywhere = set.intersection(*(set(h["parts"]) for h in lists)) if lists else set()
    committed = {s: ep for ep, h in zip(endpoints, lists, strict=True) for s in h["committed"]}
    agreed = sorted((s for s in committed if s in everywhere), reverse=True)
    name, text, state = "", "", {}
    if agreed:
        name = checkpoint_name(agreed[0])
        text = client.checkpoint_call("CheckpointPart", [committed[agreed[0]]], rpc_pb2.CheckpointMessage(
            trainer_id=client.trainer_id, dir=name, manifest=True))[0].json
        state = trainer_state_files(job_dir, name) if job_dir is not None else {}
    elif not (if_any and not committed):  # a launcher's restart before any checkpoint completed: from scratch
        held_text = "; ".join(f"{h['part']} at {ep}: manifests {h['committed'] or 'none'}, parts {h['parts'] or 'none'}"
                              for ep, h in zip(endpoints, lists, strict=True))
        raise CheckpointError(f"no checkpoint of this plan is complete in every pserver's own dir ({held_text})")
    replies = client.checkpoint_call("CheckpointRestore", endpoints, rpc_pb2.CheckpointMessage(
        trainer_id=client.trainer_id, dir=name, json=text, trainer_state=state))
    steps = {_json_of(r.json, "a restore's answer")["step"] for r in replies}
    if steps != {agreed[0] if agreed else 0}:
        raise CheckpointError(f"the pservers restored steps {sorted(steps)}, not {name or 'from scratch'}")
    return int(steps.pop()), state


def _json_of(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"{what} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{what} is not a JSON object")
    return value


__all__ = ["RESTORE_METHODS", "OwnDirRpc", "PartRestorer", "RestoreWaitRefused", "agree_restore", "agreed_restore",
           "check_state_names", "held", "save", "trainer_state_files"]
