"""Train the CTR example on a synthetic click data set, in whatever role the environment
gives: locally, or as one pserver or trainer under `pstranspile launch`.

    python3 examples/train_ctr.py --rows 1000000 --steps 200
    pstranspile launch --pservers 2 --trainers 2 -- python3 examples/train_ctr.py --rows 1000000

The model is `examples/ctr.py`'s (3 LoD id slots on one embedding table, sum-pooled,
fc 32 relu, fc 2 softmax; Adagrad, the distributed table by sgd, or by
`--table-optimizer adam|lazy-adam|adagrad|momentum|rmsprop|ftrl` with its accumulators
on the pservers); `--variant` picks the table: `distributed` (sharded `id % M` over the pservers, rows created on first
touch, prefetched), `local-table` (sliced like a param, prefetched from its blocks) or
`dense`. `--main/--startup` trains a saved program of the same kind instead (id slots
that feed `lookup_table`s, an int64 label).

The data (`ClickData`): example `j` of global batch `k` is a pure function of `--seed`,
`k` and `j`. Each slot holds 1-4 ids (one when the slot has no LoD), drawn from a
Zipf-like distribution over the table (rank `r` has weight ~ r^-1.3; rank `r` is id
`r * 2147483647 % rows`, so popular ids are scattered over the table and its shards);
the click is 1 when the sum of the example's hidden id weights (a fixed pseudo-random
value in [-0.5, 0.5) per id) plus a little noise is positive. The embedding can learn
those weights, so the loss drops. `--unique-ids K` draws every batch's ids from the K
most popular ids instead (a knob for the bytes-per-step measurement); `--zipf A` sets the
exponent and `--hot-first` makes rank `r` id `r` (the hot ids the first rows, what
`benchmarks/planner.py` trains).

Every trainer makes the same global batch and trains on its share of the examples (the
sequences of an LoD slot with them), so in sync mode the trainers together see what
local training sees. `--save DIR` writes `DIR/trainer_<id>.npz` (`DIR/local.npz`
locally) with the dense params the run started from and ended with (`init/<p>`,
`final/<p>`), the ids every step touches (`ids/<table>`) with their rows before and
after training (`init_rows/<table>`, `final_rows/<table>`: a trainer whose table lives
on the pservers prefetches them through the real RPC, which creates them on first
touch before any step), the losses, the bytes each step sent and received, and the
process's baseline and peak RSS. `--init FILE` (local runs) starts from such a file:
its dense params, and its rows written into the table (other rows keep the startup's
random values; they are never read). `--checkpoint DIR` asks the pservers to save
their table shards at the end into their checkpoint dir DIR (every process is given
it; the notice names `<table>_<i>` inside it: pserver `i` writes `DIR/<table>_<i>`).
`--replay` (trainers under `launch`) replays each step's pserver traffic without the
model's compute (`transpiler.replay.sparse_replay`: the batch's ids prefetched, random
grads of those rows and of the dense params sent, the barriers; no loss): what
`benchmarks/planner.py` measures the pservers with. The last line gives the process's CPU
ms per step (the first quarter of the steps, at most 5, left out).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

try:
    import transpiler  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ctr
from ops.tensor import LoDTensor
from transpiler.ir import DType, OpRole, Program
from transpiler.ir.precision import as_float64
from transpiler.runtime.role import Role
from transpiler.runtime.session import Session, parameter_names
from transpiler.runtime.script import run_script

LOOKUPS = ("lookup_table", "lookup_table_v2")
SPREAD = 2147483647  # a prime: rank r is id r * SPREAD % rows, popular ids all over the table
ZIPF = 1.3


# ------------------------------------------------------------------ programs


def build_ctr(variant: str, rows: int, width: int = 16, table_optimizer: str | None = None) -> tuple[Program, Program]:
    """`examples/ctr.py`'s programs with a `rows` x `width` table."""
    return ctr.build(is_sparse=variant != "dense", is_distributed=variant == "distributed", table=(rows, width),
                     table_optimizer=table_optimizer)


def loss_name(program: Program) -> str:
    """The output of the forward loss op (`op_role` Forward|Loss)."""
    for op in program.global_block().ops:
        role = int(op.attr("op_role", 0))
        if role & OpRole.Loss and not role & OpRole.Backward:
            return op.output_names[0]
    raise SystemExit("train_ctr.py: the program has no loss op (op_role forward|loss)")


# ------------------------------------------------------------------ the data set


class ClickData:
    """The synthetic click data set for a CTR program (see the module docstring)."""

    def __init__(self, program: Program, seed: int, unique_ids: int | None = None, zipf: float = ZIPF,
                 spread: bool = True) -> None:
        self.zipf, self.spread = zipf, spread
        block = program.global_block()
        self.seed = seed
        self.unique_ids = unique_ids
        self.slots: dict[str, str] = {}  # id slot -> its table
        for op in block.ops:
            if op.type in LOOKUPS:
                self.slots.setdefault(op.input("Ids")[0], op.input("W")[0])
        if not self.slots:
            raise SystemExit("train_ctr.py: the program has no lookup_table: no id slots to feed")
        self.lod = {slot: block.var(slot).lod_level for slot in self.slots}
        self.rows = {table: block.var(table).shape[0] for table in set(self.slots.values())}
        written = {name for op in block.ops for name in op.output_names}
        labels = [
            name for name, var in block.vars.items()
            if var.dtype == DType.INT64 and not var.persistable and name not in self.slots
            and name not in written and block.readers(name)
        ]
        if len(labels) != 1:
            raise SystemExit(f"train_ctr.py: expected one int64 label var besides the id slots, found {labels}")
        self.label = labels[0]

    @staticmethod
    def weight(ids: np.ndarray) -> np.ndarray:
        """The hidden click weight of each id, in [-0.5, 0.5) (a fixed hash, vectorised)."""
        return ((ids * 40503 + 977) % 1021) / 1021.0 - 0.5

    def _ids(self, rng: np.random.Generator, count: int, rows: int) -> np.ndarray:
        if self.unique_ids:
            rank = rng.integers(0, min(self.unique_ids, rows), count)
        else:
            rank = (rng.zipf(self.zipf, count) - 1) % rows
        return (rank.astype(np.int64) * (SPREAD if self.spread else 1)) % rows

    def batch(self, step: int, size: int) -> dict[str, Any]:
        """Global batch `step`: `size` examples (a dict of feeds)."""
        rng = np.random.default_rng([self.seed, step])
        feed: dict[str, Any] = {}
        score = np.zeros(size)
        for slot, table in self.slots.items():
            lengths = rng.integers(1, 5, size) if self.lod[slot] else np.ones(size, np.int64)
            ids = self._ids(rng, int(lengths.sum()), self.rows[table])
            np.add.at(score, np.repeat(np.arange(size), lengths), self.weight(ids))
            column = ids.reshape(-1, 1)
            feed[slot] = LoDTensor.from_lengths(column, [lengths.tolist()]) if self.lod[slot] else column
        noise = rng.standard_normal(size) * 0.1
        feed[self.label] = (score + noise > 0).astype(np.int64).reshape(-1, 1)
        return feed

    def touched(self, steps: int, size: int) -> dict[str, np.ndarray]:
        """Per table, every id the first `steps` global batches use (sorted, unique)."""
        found: dict[str, list[np.ndarray]] = {table: [] for table in self.rows}
        for step in range(steps):
            batch = self.batch(step, size)
            for slot, table in self.slots.items():
                value = batch[slot]
                found[table].append((value.array if isinstance(value, LoDTensor) else value).reshape(-1))
        return {table: np.unique(np.concatenate(parts)) for table, parts in found.items()}


def shard(batch: Mapping[str, Any], role: Role) -> dict[str, Any]:
    """This trainer's share of the examples, rows `[i*n/N, (i+1)*n/N)` (a LoD slot's
    sequences with them); the whole batch when local or alone."""
    if not role.is_trainer or role.trainers == 1:
        return dict(batch)
    out = {}
    for name, value in batch.items():
        if isinstance(value, LoDTensor) and value.lod:
            offsets = value.lod[0]
            n = offsets.size - 1
            lo, hi = n * role.trainer_id // role.trainers, n * (role.trainer_id + 1) // role.trainers
            part = value.array[offsets[lo] : offsets[hi]]
            out[name] = LoDTensor(part, [offsets[lo : hi + 1] - offsets[lo]])
        else:
            array = value.array if isinstance(value, LoDTensor) else value
            n = len(array)
            out[name] = array[n * role.trainer_id // role.trainers : n * (role.trainer_id + 1) // role.trainers]
    return out


# ------------------------------------------------------------------ table rows


def read_rows(session: Session, table: str, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of `table` as this process sees them: prefetched from the pservers when
    the trainer program fetches the table's rows, else read from the local value."""
    from ops.rpc.prefetch import fetch_by_modulo, fetch_by_sections

    if session.client is not None and session.result is not None:
        program = session.program.global_block()
        plan_table = session.result.plan.table
        for op in program.ops:
            if op.type == "prefetch" and plan_table is not None and plan_table.table == table:
                return fetch_by_modulo(session.client, op.attr("epmap"), op.input("X"), ids)
            if op.type == "distributed_lookup_table" and list(op.input("W")) == [table]:
                return fetch_by_sections(session.client, op.attr("endpoints"), op.attr("table_names"),
                                         op.attr("height_sections"), ids, op.attr("column_sections", None),
                                         op.attr("column_offsets", None))
    array = session.scope.find_var(table).array
    if array.size and 0 in array.strides:
        raise SystemExit(f"train_ctr.py: {table} is a fake_init placeholder here, and no op fetches its rows")
    return np.array(array[ids])


def write_rows(session: Session, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
    """Local runs: the table with `rows` at `ids` (a new array; other rows unchanged)."""
    value = np.array(session.scope.find_var(table).array)
    value[ids] = rows
    session.scope.set_var(table, LoDTensor(value))


# ------------------------------------------------------------------ memory


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_kb() -> int:
    """This process's resident set now (VmRSS, KiB)."""
    return _status_kb("VmRSS")


def peak_rss_kb() -> int:
    """This process's peak resident set (VmHWM, KiB). Not `ru_maxrss`: Linux carries that
    over `exec` from the forked parent, so a trainer started by a big process would report
    its parent's size."""
    return _status_kb("VmHWM")


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=("distributed", "local-table", "dense"), default="distributed")
    parser.add_argument("--rows", type=int, default=1_000_000, help="the table's rows (default 1,000,000)")
    parser.add_argument("--width", type=int, default=16, help="the table's row width (default 16)")
    parser.add_argument("--table-optimizer", choices=sorted(ctr.TABLE_OPTIMIZERS),
                        help="--variant distributed: train the table with this optimizer (default: Fluid's sgd)")
    parser.add_argument("--main", type=Path, help="train this saved program instead of building ctr.py's")
    parser.add_argument("--startup", type=Path, help="its startup program (default: startup.pb beside --main)")
    parser.add_argument("--float64", action="store_true", help="compute in float64")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="the global batch (all trainers together)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unique-ids", type=int, help="draw every batch's ids from the K most popular ids")
    parser.add_argument("--zipf", type=float, default=ZIPF, help=f"the ids' Zipf exponent (default {ZIPF})")
    parser.add_argument("--hot-first", action="store_true",
                        help="id = popularity rank (the hot ids are the first rows) instead of spread over the table")
    parser.add_argument("--save", type=Path, help="write params, touched rows, losses, traffic and memory here")
    parser.add_argument("--init", type=Path, help="local runs: start from the params and rows of this .npz")
    parser.add_argument("--checkpoint", type=Path, help="at the end, have the pservers save their table shards here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--replay", action="store_true",
                        help="trainers: replay the step's pserver traffic only (the batch's ids prefetched, random grads "
                             "of those rows and of the dense params sent; no forward or backward compute, no loss)")
    args = parser.parse_args(argv)
    if args.rows < 2 or args.steps < 0 or args.batch < 1:
        parser.error("--rows must be >= 2, --steps >= 0 and --batch >= 1")
    if args.replay and (args.save or args.init or args.checkpoint):
        parser.error("--replay trains nothing: no --save, --init or --checkpoint")
    if args.table_optimizer is not None and (args.variant != "distributed" or args.main is not None):
        parser.error("--table-optimizer is for ctr.py's distributed table (--variant distributed, no --main)")
    return args


def programs(args: argparse.Namespace) -> tuple[Program, Program]:
    if args.main is not None:
        main = Program.load(args.main)
        startup = Program.load(args.startup or args.main.with_name("startup.pb"))
    else:
        main, startup = build_ctr(args.variant, args.rows, args.width, args.table_optimizer)
    if args.float64:
        main, startup = as_float64(main), as_float64(startup)
    return main, startup


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    main_program, startup = programs(args)
    role = Role.from_env()
    data = ClickData(main_program, args.seed, args.unique_ids, args.zipf, not args.hot_first)
    loss = loss_name(main_program)
    tables = sorted(set(data.slots.values()))
    dense = [name for name in parameter_names(main_program) if name not in tables]
    out = open(os.devnull, "w") if args.quiet else None  # noqa: SIM115 - closed at exit
    with Session(main_program, startup, role=role, out=out, checkpoint_dir=args.checkpoint) as session:
        if role.is_pserver:
            session.serve()
            return 0
        baseline = rss_kb()
        session.start()
        touched = data.touched(args.steps, args.batch) if args.save or args.init else {}
        if args.init is not None:
            if role.is_distributed:
                raise SystemExit("train_ctr.py: --init is for local runs; trainers start from the pservers' values")
            saved = np.load(args.init)
            for name in dense:
                session.scope.set_var(name, LoDTensor(saved[f"init/{name}"]))
            for table in tables:
                write_rows(session, table, saved[f"ids/{table}"], saved[f"init_rows/{table}"])
        initial = session.params(dense)
        init_rows = {t: read_rows(session, t, ids) for t, ids in touched.items()}
        losses, traffic, cpu = [], [], []
        stats = session.client.stats if session.client is not None else None
        replayed = replay_of(session) if args.replay else None
        started = time.perf_counter()
        for step in range(args.steps):
            before = stats.snapshot() if stats is not None else {}
            cpu.append(time.process_time())
            if replayed is not None:
                replay_step(session, replayed, shard(data.batch(step, args.batch), role))
            else:
                value, = session.run(shard(data.batch(step, args.batch), role), loss=loss)
                losses.append(float(np.asarray(value).reshape(-1)[0]))
            if stats is not None:
                delta = stats.delta(stats.snapshot(), before)
                traffic.append((sum(r[1] for r in delta.values()), sum(r[2] for r in delta.values())))
        seconds = time.perf_counter() - started
        cpu.append(time.process_time())
        final = session.params(dense)
        final_rows = {t: read_rows(session, t, ids) for t, ids in touched.items()}
        if args.checkpoint is not None and role.is_trainer and role.trainer_id == 0:
            checkpoint(session)
    peak = peak_rss_kb()
    who = f"trainer {role.trainer_id}" if role.is_trainer else "local"
    sent = np.mean([t[0] for t in traffic]) if traffic else 0.0
    print(f"{who}: {args.steps} steps in {seconds:.2f} s, loss {losses[0] if losses else float('nan'):.4f} -> "
          f"{losses[-1] if losses else float('nan'):.4f}; peak RSS {peak / 1024:.1f} MiB (at start "
          f"{baseline / 1024:.1f} MiB); sent {sent / 1024:.1f} KiB/step; CPU {cpu_ms_per_step(cpu):.2f} ms/step",
          flush=True)
    if args.save is not None:
        args.save.mkdir(parents=True, exist_ok=True)
        arrays = {f"init/{k}": v for k, v in initial.items()} | {f"final/{k}": v for k, v in final.items()}
        for table, ids in touched.items():
            arrays |= {f"ids/{table}": ids, f"init_rows/{table}": init_rows[table],
                       f"final_rows/{table}": final_rows[table]}
        arrays |= {"loss": np.asarray(losses), "traffic": np.asarray(traffic, np.int64).reshape(-1, 2),
                   "rss_kb": np.asarray([baseline, peak], np.int64)}
        name = f"trainer_{role.trainer_id}" if role.is_trainer else "local"
        np.savez(args.save / f"{name}.npz", **arrays)
    return 0


def cpu_ms_per_step(marks: list[float]) -> float:
    """This process's CPU ms per step from the CPU clock at each step's start and the
    loop's end, the first quarter (at most 5 steps: warm-up) left out; nan without steps."""
    warm = min(5, (len(marks) - 1) // 4)
    steps = len(marks) - 1 - warm
    return (marks[-1] - marks[warm]) / steps * 1e3 if steps > 0 else float("nan")


def replay_of(session: Session):
    """`--replay`: the trainer program reduced to its pserver traffic (`transpiler.replay.sparse_replay`)."""
    from transpiler.replay import sparse_replay

    if session.client is None:
        raise SystemExit("train_ctr.py: --replay replays a trainer's pserver traffic; run it under `launch`")
    return sparse_replay(session.program, seed=session.role.trainer_id)


def replay_step(session: Session, replayed, feed: Mapping[str, Any]) -> None:
    """One replayed step, counted and reported (no loss) as `Session.run` does a step."""
    session.executor.run(replayed.program, feed=replayed.feed(feed), scope=session.scope)
    session.steps += 1
    if session.steps % session.progress_every == 0 or session.steps == 1:
        session.report(None)


def checkpoint(session: Session) -> None:
    """Ask every pserver holding the distributed table to save its shard (Paddle's
    `checkpoint_notify`, the names relative: pserver `i` writes `<its dir>/<table>_<i>`)."""
    plan = session.result.plan if session.result is not None else None
    if plan is None or plan.table is None:
        raise SystemExit("train_ctr.py: --checkpoint needs a distributed table sharded id % M (--variant distributed, "
                         "the paddle partitioner) and pservers; a table cut by another partitioner is saved in the "
                         "job's checkpoints (Session(checkpoint_dir=...))")
    targets = [(ep, f"{plan.table.table}_{i}") for i, ep in enumerate(plan.table.endpoints)]
    session.client.checkpoint_notify_each(targets, plan.table.table)


if __name__ == "__main__":
    sys.exit(run_script(main))
