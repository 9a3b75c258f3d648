"""Partitioners compared (docs/partitioners.md): what each pserver holds and serves.

    python3 benchmarks/partition.py                 # the load figures (seconds)
    python3 benchmarks/partition.py --measure       # and steps/s of real sync jobs (minutes)

1. Load, from the partitions each partitioner makes (`paddle`, `angel`, `column`) on 8
   pservers, for two workloads:
   - Angel's `[3, 10,000,000]` fp32 matrix (dense, SGD): a step moves every partition
     (its grad in, the param out);
   - a `[1,000,000, 64]` fp32 table, as a table a trainer pulls rows of and pushes their
     grads to: a step of B = 4096 ids drawn Zipf(1.1) (id = popularity rank, so the hot
     ids are the low ones), each unique id's row served (pulled and pushed) by every
     partition holding a piece of it, 8 bytes of id each way.
   Per pserver: bytes held, bytes served per step and rows served per step (mean of 20
   steps); the max and max/mean over pservers.
2. `--measure`: sync training of `examples/train_ctr.py --variant local-table --rows 1000000
   --width 64` (its rows prefetched from the table's blocks; ids Zipf-like, scattered over
   the table), 2 trainers x 4 pservers, per partitioner: steady steps/s of trainer 0.
   `--variant distributed` measures the distributed table instead (`is_distributed`:
   `id % 4` under `paddle`, auto-grown pieces cut by the partitioner otherwise).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from transpiler.ir.types import DType  # noqa: E402
from transpiler.partition import AngelPartitioner, ColumnPartitioner, ParamInfo, Partition  # noqa: E402
from transpiler.plan import slice_sizes  # noqa: E402
from transpiler.runtime.metrics import read_metrics  # noqa: E402

SERVERS = 8
BATCH_IDS = 4096
STEPS = 20


def paddle_partitions(info: ParamInfo, servers: int) -> tuple[list[Partition], list[int]]:
    """Paddle's slicing (min_block_size 8192) and round robin, for one param."""
    sizes = slice_sizes(info.shape, servers, 8192)
    width = info.cols
    parts, row = [], 0
    for size in sizes:
        rows = size // width
        parts.append(Partition(row, row + rows, 0, width))
        row += rows
    return parts, [i % servers for i in range(len(parts))]


def cut(name: str, info: ParamInfo, servers: int) -> tuple[list[Partition], list[int]]:
    if name == "paddle":
        return paddle_partitions(info, servers)
    partitioner = {"angel": AngelPartitioner, "column": ColumnPartitioner}[name]()
    partitioner.servers = servers
    partitioner.reset()
    parts = partitioner.partitions(info)
    return parts, partitioner.assign(parts)


def zipf_batches(rows: int, rng: np.random.Generator) -> list[np.ndarray]:
    """STEPS batches of the unique ids of BATCH_IDS Zipf(1.1) draws below `rows`."""
    out = []
    for _ in range(STEPS):
        ids = rng.zipf(1.1, BATCH_IDS * 2) - 1
        ids = ids[ids < rows][:BATCH_IDS]
        out.append(np.unique(ids))
    return out


def load(name: str, info: ParamInfo, servers: int, batches: list[np.ndarray] | None) -> dict:
    parts, where = cut(name, info, servers)
    item = info.dtype.itemsize
    held = np.zeros(servers)
    served = np.zeros(servers)
    rows_served = np.zeros(servers)
    for part, server in zip(parts, where, strict=True):
        held[server] += part.numel * item
        if batches is None:  # dense: the whole partition in and out each step
            served[server] += 2 * part.numel * item
            rows_served[server] += part.rows
            continue
        for ids in batches:
            n = np.count_nonzero((ids >= part.start_row) & (ids < part.end_row))
            served[server] += 2 * n * (part.cols * item + 8) / len(batches)
            rows_served[server] += n / len(batches)

    def stat(values: np.ndarray) -> dict:
        mean = float(values.mean())
        return {"per_pserver": [round(float(v)) for v in values], "max": round(float(values.max())),
                "max_over_mean": round(float(values.max()) / mean, 3) if mean else None}

    return {"partitions": len(parts), "pservers_used": int(np.count_nonzero(held)), "held_bytes": stat(held),
            "served_bytes_per_step": stat(served), "rows_served_per_step": stat(rows_served)}


def measure(name: str, steps: int, variant: str = "local-table") -> float:
    """Steady steps/s of trainer 0 in a 2 x 4 sync job of train_ctr's prefetched table."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "transpiler", "launch", "--pservers", "4", "--trainers", "2",
                   "--partitioner", name, "--log-dir", f"{tmp}/logs", "-q", "--timeout", "300", "--",
                   sys.executable, str(REPO / "examples" / "train_ctr.py"), "--variant", variant,
                   "--rows", "1000000", "--width", "64", "--steps", str(steps), "--batch", "256"]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{name}: the job failed\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        records = read_metrics(f"{tmp}/logs")
    return steady_rate(name, records, min(5, steps // 4))[0]


def steady_rate(name: str, records: list[dict], warm: int) -> tuple[float, list[dict]]:
    """Trainer 0's steps/s in a job's metrics from step `warm` on (after the warm-up steps),
    and its step records in step order."""
    mine = sorted((r for r in records if r.get("role") == "trainer" and r.get("trainer") == 0 and r.get("step")),
                  key=lambda r: r["step"])
    if len(mine) < 2:
        raise SystemExit(f"{name}: trainer 0 reported {len(mine)} step(s) in metrics.jsonl")
    first = next(r for r in mine if r["step"] >= warm)
    last = mine[-1]
    return (last["step"] - first["step"]) / (last["elapsed"] - first["elapsed"]), mine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="also run the sync jobs (2 trainers x 4 pservers)")
    parser.add_argument("--steps", type=int, default=40, help="steps of each measured job (default 40)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--variant", choices=("local-table", "distributed"), default="local-table",
                        help="--measure: train_ctr.py's table (default local-table: prefetched blocks)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    matrix = ParamInfo("w", (3, 10_000_000), DType.FP32, "sgd")
    table = ParamInfo("emb", (1_000_000, 64), DType.FP32, "sgd", sparse=True)
    batches = zipf_batches(table.rows, rng)
    figures: dict = {"servers": SERVERS, "matrix": {}, "table": {}}
    for name in ("paddle", "angel", "column"):
        figures["matrix"][name] = load(name, matrix, SERVERS, None)
        figures["table"][name] = load(name, table, SERVERS, batches)
    if args.measure:
        figures["steps_per_s"] = {name: round(measure(name, args.steps, args.variant), 2) for name in ("paddle", "angel", "column")}
    if args.json:
        print(json.dumps(figures, indent=1))
        return 0
    for workload, title in (("matrix", "[3, 10M] fp32 matrix"), ("table", f"[1M, 64] fp32 table, {BATCH_IDS} Zipf(1.1) ids a step")):
        print(f"{title}, {SERVERS} pservers")
        print(f"  {'':<8} {'parts':>5} {'used':>4} {'held max MB':>11} {'max/mean':>8} {'served max MB/step':>18} "
              f"{'max/mean':>8} {'rows max/step':>13} {'max/mean':>8}")
        for name, f in figures[workload].items():
            held, served, rows = f["held_bytes"], f["served_bytes_per_step"], f["rows_served_per_step"]
            print(f"  {name:<8} {f['partitions']:>5} {f['pservers_used']:>4} {held['max'] / 1e6:>11.2f} "
                  f"{held['max_over_mean']:>8} {served['max'] / 1e6:>18.3f} {served['max_over_mean']:>8} "
                  f"{rows['max']:>13,} {rows['max_over_mean']:>8}")
    if args.measure:
        print(f"sync job, train_ctr.py {args.variant} [1M, 64], 2 trainers x 4 pservers, steps/s (trainer 0):")
        for name, value in figures["steps_per_s"].items():
            print(f"  {name:<8} {value:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
