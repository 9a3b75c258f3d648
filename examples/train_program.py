"""Train any saved (main.pb, startup.pb) pair on synthetic batches, in whatever role the
environment gives: locally, or as one pserver or trainer under `pstranspile launch`.

    python3 examples/train_program.py --main M.pb --startup S.pb --loss mean_0.tmp_0 --steps 20
    pstranspile launch --pservers 2 --trainers 2 -- python3 examples/train_program.py --main M.pb ...

Batch `k` is a pure function of `--seed` and `k` (`synthetic_batch`): every trainer makes
the same global batch and trains on its own share (`Role.shard`), so in sync mode the
trainers together see what local training sees. `--save DIR` writes the parameters a
trainer started from (what the pservers initialised) and ended with to
`DIR/trainer_<id>.npz` (`DIR/local.npz` locally); `--init FILE` starts from the
`init/<param>` arrays of such a file instead of the startup program's values. The
end-to-end tests train locally with `--init trainer_0.npz` and compare. `--die-at-step K --die-trainer I` makes trainer I kill itself
(SIGKILL) after K steps, to test what the pservers do when a trainer vanishes.
Checkpoints: `--checkpoint-dir D --checkpoint-every N [--keep-checkpoints K]` (every
process gets the same flags: the pservers write into D, trainer 0 asks every N steps);
`--restore D` resumes the job from D's newest complete checkpoint (the pservers load it,
whatever pserver count wrote it; the trainers skip the steps it holds); `--warm-start D`
starts from LoDTensor files of whole vars (`pstranspile fetch`, `save_persistables`);
`--pull-to D` has trainer 0 (or local training) write `Session.pull()` there at the end.
`--kill-at-step K --kill ROLE:I --pid-dir P` (the recovery test): every process writes
its pid to `P/<role>.<i>`, and trainer 0, about to run step K, SIGKILLs that process.
`--chaos K:ROLE:I[:ckpt:MS],...` (the chaos test) schedules several such kills: before step
K, or `MS` milliseconds after trainer 0 starts asking for the checkpoint of step K (a kill
during the checkpoint's write). Every kill happens once per pid dir (a marker file
`P/killed.<K>.<role>.<i>`), so a job that `launch --max-restarts` restarts from an earlier
checkpoint does not meet it again.
`--warmup K` trains K more steps first and prints, at the end, one `timing: {json}` line
for the `--steps` after them: wall seconds, this process's CPU seconds, its peak RSS
(`peak_rss`, VmHWM bytes, read right after the last step), and the wall-clock start and end (so a harness such as `benchmarks/vs_paddle18.py` can match its CPU samples
of other processes to the timed window).
`--as-trainers N` (local runs) trains as N sync trainers and their pservers would, in one
process and without RPC (`AsTrainers`): the reference for a program whose forward pass
depends on the batch it sees (batch norm normalises over each trainer's share, not the
whole batch). `--min-block-size N` is the transpiler's (every process of a job must pass it).
`--float64` trains float64 copies of the programs (`transpiler.api.as_float64`; every
process of a job must pass it). `--permute` (local runs) feeds each batch's examples in
another fixed order: a mean loss does not depend on the order, so the difference it
makes is float32 rounding alone, the control the end-to-end proof measures against.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

try:
    import transpiler  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ops.rpc.fetch import write_vars
from ops.tensor import LoDTensor
from transpiler.api import as_float64
from transpiler.ir import DType, OpRole, Program
from transpiler.runtime.role import TRAINER, Role
from transpiler.runtime.session import Session, parameter_names
from transpiler.runtime.script import run_script


def feed_vars(program: Program) -> list[str]:
    """Vars block 0 reads but nothing writes and no one initialises: the data."""
    block = program.global_block()
    written = {name for op in block.ops for name in op.output_names}
    return [
        name
        for name, var in block.vars.items()
        if not var.persistable and name not in written and block.readers(name) and var.dtype is not None
    ]


LOOKUPS = ("lookup_table", "lookup_table_v2")


@dataclass(frozen=True)
class FeedSpec:
    """How one feed var's synthetic values are drawn: `ids_below` rows of the table a lookup
    reads (LoD sequences when `lod`), `classes` for an int64 label, else normal floats."""

    name: str
    shape: tuple[int, ...]  # -1 where the batch goes
    dtype: np.dtype
    ids_below: int | None = None
    lod: bool = False
    classes: int | None = None


_FEED_SPECS: weakref.WeakKeyDictionary[Program, tuple[int, tuple[FeedSpec, ...]]] = weakref.WeakKeyDictionary()


def feed_specs(program: Program) -> tuple[FeedSpec, ...]:
    """The program's feeds and how to draw them, worked out once per version of block 0
    (a scan of its ops: per step that would cost a third as much as drawing the numbers)."""
    version = program.global_block().version
    cached = _FEED_SPECS.get(program)
    if cached is None or cached[0] != version:
        cached = _FEED_SPECS[program] = (version, tuple(_feed_spec(program, name) for name in feed_vars(program)))
    return cached[1]


def _feed_spec(program: Program, name: str) -> FeedSpec:
    block = program.global_block()
    var = block.var(name)
    shape, dtype = tuple(var.shape), var.dtype.to_numpy()
    lookups = [op for op in block.readers(name) if op.type in LOOKUPS and name in op.input("Ids")]
    if lookups:
        rows = block.var(lookups[0].input("W")[0]).shape[0]
        return FeedSpec(name, shape, dtype, ids_below=rows, lod=bool(var.lod_level))
    if var.dtype == DType.INT64:
        reader = block.readers(name)[0]
        logits = (reader.input("Logits") or reader.input("X"))[0]
        return FeedSpec(name, shape, dtype, classes=block.var(logits).shape[-1])
    return FeedSpec(name, shape, dtype)


def synthetic_batch(program: Program, batch: int, seed: int, step: int) -> dict[str, Any]:
    """Batch `step` for `program`: ids for id slots (LoD sequences when the slot has a LoD
    level), class ids for int64 labels, normal floats (sd 0.1) else."""
    rng = np.random.default_rng([seed, step])
    out: dict[str, Any] = {}
    for spec in feed_specs(program):
        shape = [batch if d < 0 else d for d in spec.shape]
        if spec.ids_below is not None:
            lengths = rng.integers(1, 4, batch) if spec.lod else np.ones(batch, np.int64)
            ids = rng.integers(0, spec.ids_below, (int(lengths.sum()), *shape[1:])).astype(np.int64)
            out[spec.name] = LoDTensor.from_lengths(ids, [lengths.tolist()]) if spec.lod else ids
        elif spec.classes is not None:
            out[spec.name] = rng.integers(0, spec.classes, size=shape).astype(np.int64)
        else:
            out[spec.name] = (rng.standard_normal(shape) * 0.1).astype(spec.dtype)
    return out


def shard(batch: Mapping[str, Any], role: Role, program: Program | None = None) -> dict[str, Any]:
    """`Role.shard`, and a LoD slot's share is the sequences of this trainer's examples;
    a slot whose batch dim (its declared -1) is not the first in `program` (time-major
    RNN input, [layers, batch, hidden] initial states) is cut along that dim."""
    if not role.is_trainer or role.trainers == 1:
        return dict(batch)
    plain = {k: v for k, v in batch.items() if not isinstance(v, LoDTensor)}
    later = {k: _batch_axis(program, k) for k in plain} if program is not None else {}
    later = {k: axis for k, axis in later.items() if axis > 0}
    out = role.shard({k: v for k, v in plain.items() if k not in later})
    for name, axis in later.items():
        rows = plain[name].shape[axis]
        lo, hi = rows * role.trainer_id // role.trainers, rows * (role.trainer_id + 1) // role.trainers
        out[name] = np.take(plain[name], np.arange(lo, hi), axis=axis)
    for name, value in batch.items():
        if isinstance(value, LoDTensor):
            offsets = value.lod[0]
            n = offsets.size - 1
            lo, hi = n * role.trainer_id // role.trainers, n * (role.trainer_id + 1) // role.trainers
            out[name] = LoDTensor(value.array[offsets[lo] : offsets[hi]], [offsets[lo : hi + 1] - offsets[lo]])
    return out


def _batch_axis(program: Program, name: str) -> int:
    var = program.global_block().find_var(name)
    shape = () if var is None or var.shape is None else tuple(var.shape)
    return shape.index(-1) if -1 in shape else 0


def permuted(batch: Mapping[str, Any], seed: int, step: int) -> dict[str, Any]:
    """The batch with its examples in another order (the same for every slot)."""
    if any(isinstance(v, LoDTensor) for v in batch.values()):
        raise SystemExit("--permute: a LoD slot's sequences cannot be permuted here")
    sizes = {len(v) for v in batch.values()}
    if len(sizes) != 1:
        raise SystemExit(f"--permute: the slots disagree on the batch size ({sorted(sizes)})")
    order = np.random.default_rng([seed, step, 1]).permutation(sizes.pop())
    return {name: np.asarray(value)[order] for name, value in batch.items()}


def peak_rss() -> int | None:
    """This process's peak resident set so far (VmHWM, bytes), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None


def held_params(session: Session) -> dict[str, np.ndarray]:
    """The params this process holds (not a prefetched table's `fake_init` placeholder)."""
    held = []
    for name in parameter_names(session.main):
        value = session.scope.find_var(name)
        if isinstance(value, LoDTensor) and not (value.array.size and 0 in value.array.strides):
            held.append(name)
    return session.params(held)


class AsTrainers:
    """`--as-trainers N`: local training as N sync trainers and their pservers would train.

    Every step, each trainer's share of the batch (`shard`, as each trainer takes it) runs
    forward and backward in a scope of its own, which keeps what a trainer keeps to itself
    (batch norm's moving mean and variance: persistable, written by the forward pass, on
    no pserver); each param's N grads are summed in trainer order and scaled by 1/N, as a
    sync pserver's `sum` and `scale` do; then the optimizer ops run once on the shared
    params. `held(i)` is what trainer i holds: the shared params, its own moving stats."""

    def __init__(self, session: Session, trainers: int) -> None:
        main = session.main
        self.compute, self.update = main.clone(), main.clone()
        for program, keep_updates in ((self.compute, False), (self.update, True)):
            block = program.global_block()
            block.remove_ops([op for op in block.ops if _is_update(op) != keep_updates])
        self.grads = sorted({g for op in self.update.global_block().ops for g in op.input("Grad")})
        self.session = session
        self.roles = [Role(TRAINER, i, trainers) for i in range(trainers)]
        self.scopes = [session.scope.new_scope() for _ in range(trainers)]

    def run(self, batch: Mapping[str, Any], loss: str) -> None:
        session, losses = self.session, []
        for role, scope in zip(self.roles, self.scopes, strict=True):
            (value,) = session.executor.run(self.compute, feed=shard(batch, role, session.main), fetch_list=[loss], scope=scope)
            losses.append(float(np.asarray(value).reshape(-1)[0]))
        for grad in self.grads:
            values = [scope.find_var(grad) for scope in self.scopes]
            if not all(isinstance(v, LoDTensor) for v in values):
                raise SystemExit(f"--as-trainers: {grad} is not a dense tensor (sparse grads are not supported here)")
            parts = [v.array for v in values]
            total = parts[0].copy()
            for part in parts[1:]:
                total += part
            session.scope.set_var(grad, LoDTensor(total * total.dtype.type(1.0 / len(parts))))
        session.executor.run(self.update, scope=session.scope)
        session.steps += 1
        session.report(float(np.mean(losses)))

    def held(self, trainer: int) -> dict[str, np.ndarray]:
        scope = self.scopes[trainer]
        return {name: np.array(scope.find_var(name).array) for name in held_params(self.session)}


def _is_update(op) -> bool:
    """An optimizer or lr-schedule op: what a pserver runs."""
    return bool(int(op.attr("op_role", 0)) & (OpRole.Optimize | OpRole.LRSched))


def kill(pid_dir: Path, who: str, step: int, when: str = "before step") -> None:
    """SIGKILL process `who` (`role:i`) by the pid it wrote (waiting for it, bounded), once
    per pid dir: a restarted job that reaches the step again does not kill again."""
    marker = pid_dir / f"killed.{step}.{who.replace(':', '.')}"
    if marker.exists():
        return
    path = pid_dir / who.replace(":", ".")
    for _ in range(300):
        if path.is_file() and path.read_text().strip():
            break
        time.sleep(0.1)
    marker.write_text(f"{when} {step}\n")
    print(f"trainer 0: kill -9 {who} {when} {step}", flush=True)
    try:
        os.kill(int(path.read_text()), signal.SIGKILL)
    except ProcessLookupError:  # it died already (the job is failing anyway)
        print(f"trainer 0: {who} was gone already", flush=True)


@dataclass(frozen=True)
class Kill:
    """One scheduled kill: `who` before step `step`, or `delay` s into checkpoint `step`."""

    step: int
    who: str
    delay: float | None = None  # None: before the step; else seconds after the checkpoint request starts


def parse_chaos(text: str) -> list[Kill]:
    kills = []
    for spec in filter(None, (part.strip() for part in text.split(","))):
        fields = spec.split(":")
        if len(fields) == 3:
            kills.append(Kill(int(fields[0]), f"{fields[1]}:{int(fields[2])}"))
        elif len(fields) == 5 and fields[3] == "ckpt":
            kills.append(Kill(int(fields[0]), f"{fields[1]}:{int(fields[2])}", float(fields[4]) / 1000.0))
        else:
            raise ValueError(f"--chaos {spec!r}: expected K:ROLE:I or K:ROLE:I:ckpt:MS")
        if fields[1] not in ("pserver", "trainer"):
            raise ValueError(f"--chaos {spec!r}: the role is pserver or trainer")
    return kills


def kill_during_checkpoints(session: Session, pid_dir: Path, kills: list[Kill]) -> None:
    """Trainer 0: arm each `ckpt` kill when the checkpoint of its step starts."""
    timed = [k for k in kills if k.delay is not None]
    if not timed:
        return
    checkpoint = session.checkpoint

    def checkpoint_with_kills(step: int | None = None) -> None:
        now = session.steps if step is None else step
        for k in timed:
            if k.step == now:
                threading.Timer(k.delay, kill, (pid_dir, k.who, k.step, "during the checkpoint of step")).start()
        checkpoint(step)

    session.checkpoint = checkpoint_with_kills


def pause(marker: Path, step: int) -> None:
    """Say this step was reached (`<marker>.reached`) and wait for `<marker>.go`, bounded;
    once: a restarted job that reaches the step again does not pause."""
    reached, go = marker.with_name(marker.name + ".reached"), marker.with_name(marker.name + ".go")
    if reached.exists():
        return
    reached.write_text(f"{step}\n")
    print(f"trainer 0: paused before step {step}", flush=True)
    for _ in range(600):
        if go.exists():
            return
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--main", required=True, type=Path)
    parser.add_argument("--startup", required=True, type=Path)
    parser.add_argument("--loss", required=True, help="the loss var's name")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="the global batch (all trainers together)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, help="write start and end parameters here")
    parser.add_argument("--init", type=Path, help="start from the init/<param> arrays of this .npz (local runs)")
    parser.add_argument("--die-at-step", type=int)
    parser.add_argument("--die-trainer", type=int, default=0)
    parser.add_argument("--warmup", type=int, help="untimed steps first; then print a `timing:` line for --steps")
    parser.add_argument("--float64", action="store_true", help="train float64 copies of the programs")
    parser.add_argument("--clip-mode", choices=("trainer", "exact"),
                        help="where gradient clips run in distributed training (transpile's clip_mode)")
    parser.add_argument("--permute", action="store_true", help="local runs: each batch's examples in another order")
    parser.add_argument("--as-trainers", type=int, help="local runs: train as N sync trainers would (AsTrainers)")
    parser.add_argument("--min-block-size", type=int, help="the transpiler's min_block_size (every process)")
    parser.add_argument("--checkpoint-dir", type=Path, help="the pservers checkpoint here (local training too)")
    parser.add_argument("--checkpoint-every", type=int, help="trainer 0 asks for a checkpoint every N steps")
    parser.add_argument("--keep-checkpoints", type=int, default=3, help="keep the newest K complete checkpoints")
    parser.add_argument("--restore", type=Path, help="resume from this checkpoint dir's newest complete checkpoint")
    parser.add_argument("--warm-start", type=Path, help="start from the LoDTensor files of whole vars in this folder")
    parser.add_argument("--pull-to", type=Path, help="at the end, trainer 0 (or local) writes Session.pull() here")
    parser.add_argument("--kill-at-step", type=int, help="(tests) trainer 0 SIGKILLs --kill before this step")
    parser.add_argument("--kill", help="(tests) ROLE:I, e.g. pserver:1 or trainer:0")
    parser.add_argument("--chaos", default="", help="(tests) K:ROLE:I[:ckpt:MS],...: trainer 0 SIGKILLs ROLE:I before "
                        "step K, or MS ms into the checkpoint of step K; each once per --pid-dir")
    parser.add_argument("--pid-dir", type=Path, help="(tests) every process writes its pid to DIR/<role>.<i>")
    parser.add_argument("--pause-at-step", type=int, help="(tests) trainer 0 writes --pause-file.reached before this "
                        "step and waits (60 s at most) for --pause-file.go; once per --pause-file")
    parser.add_argument("--pause-file", type=Path)
    args = parser.parse_args(argv)

    try:
        kills = parse_chaos(args.chaos)
    except ValueError as exc:
        parser.error(str(exc))
    if args.kill_at_step is not None and args.kill:
        kills.append(Kill(args.kill_at_step, args.kill))
    if kills and args.pid_dir is None:
        parser.error("--chaos and --kill need --pid-dir")
    main_program, startup = Program.load(args.main), Program.load(args.startup)
    if args.float64:
        main_program, startup = as_float64(main_program), as_float64(startup)
    role = Role.from_env()
    if args.permute and role.is_distributed:
        parser.error("--permute is for local runs")
    if args.as_trainers is not None and (role.is_distributed or args.as_trainers < 1 or args.checkpoint_every
                                         or args.restore or args.permute):
        parser.error("--as-trainers N (N >= 1) is for local runs without checkpoints or --permute")
    if args.pid_dir is not None:
        args.pid_dir.mkdir(parents=True, exist_ok=True)
        me = f"pserver.{role.endpoints.index(role.current_endpoint)}" if role.is_pserver else f"trainer.{role.trainer_id}"
        (args.pid_dir / me).write_text(str(os.getpid()))
    options = {"checkpoint_dir": args.checkpoint_dir, "checkpoint_every": args.checkpoint_every,
               "keep_checkpoints": args.keep_checkpoints, "restore": args.restore, "init": args.warm_start}
    if args.min_block_size is not None:
        options["min_block_size"] = args.min_block_size
    if args.clip_mode is not None and role.is_distributed:
        options["clip_mode"] = args.clip_mode
    with Session(main_program, startup, role=role, **options) as session:
        if role.is_pserver:
            session.serve()
            return 0
        session.start()
        if args.init is not None:
            if role.is_distributed:
                parser.error("--init is for local runs; distributed trainers start from the pservers' params")
            saved = np.load(args.init)
            for key in saved.files:
                if key.startswith("init/"):
                    session.scope.set_var(key[len("init/"):], LoDTensor(saved[key]))
        if role.trainer_id == 0 and role.is_trainer:
            kill_during_checkpoints(session, args.pid_dir, kills)
        initial = held_params(session) if args.save is not None else {}  # copies: only what --save writes
        as_trainers = AsTrainers(session, args.as_trainers) if args.as_trainers else None
        warmup = args.warmup or 0
        start, cpu, wall = time.perf_counter(), time.process_time(), time.time()
        for step in range(session.steps, warmup + args.steps):  # a restored session starts at its step
            if step == warmup:
                start, cpu, wall = time.perf_counter(), time.process_time(), time.time()
            if args.die_at_step == step and role.trainer_id == args.die_trainer and role.is_trainer:
                print(f"trainer {role.trainer_id}: killing myself at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            for k in kills:
                if k.delay is None and k.step == step and role.trainer_id == 0 and role.is_trainer:
                    kill(args.pid_dir, k.who, step)
            if args.pause_at_step == step and role.trainer_id == 0 and args.pause_file is not None:
                pause(args.pause_file, step)
            batch = synthetic_batch(main_program, args.batch, args.seed, step)
            if args.permute:
                batch = permuted(batch, args.seed, step)
            if as_trainers is not None:
                as_trainers.run(batch, args.loss)
            else:
                session.run(shard(batch, role, main_program), loss=args.loss)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        peak = peak_rss()  # the training's (--save copies the params below)
        # copies, only for --save (after the peak: the timing line's is the training's, and a
        # process's own VmHWM at exit stays that too)
        final = {} if args.save is None else held_params(session) if as_trainers is None else as_trainers.held(0)
        per_trainer = {} if as_trainers is None or args.save is None else {
            f"final.trainer_{i}/{k}": v for i in range(args.as_trainers) for k, v in as_trainers.held(i).items()}
        if args.pull_to is not None and role.trainer_id == 0:
            write_vars(args.pull_to, session.pull())
    if args.warmup is not None:
        window = {"steps": args.steps, "seconds": seconds, "cpu": cpu, "start": wall, "end": wall + seconds,
                  "peak_rss": peak}
        print("timing: " + json.dumps(window), flush=True)
    if args.save is not None:
        args.save.mkdir(parents=True, exist_ok=True)
        name = f"trainer_{role.trainer_id}" if role.is_trainer else "local"
        arrays = {f"init/{k}": v for k, v in initial.items()} | {f"final/{k}": v for k, v in final.items()} | per_trainer
        np.savez(args.save / f"{name}.npz", **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
