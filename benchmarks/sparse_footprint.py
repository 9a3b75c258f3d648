"""What a distributed table costs a trainer: its peak memory beside the table's size and
beside local training, and the bytes it sends per step beside the batch's unique ids.

    python3 benchmarks/sparse_footprint.py [--rows 1000000] [--steps 20]

1. **Memory.** `examples/train_ctr.py` (the CTR example, a `rows` x 16 fp32
   distributed table), 2 pservers x 2 trainers under `pstranspile launch`, sync, global
   batch 64, and the same script trained locally (which holds the whole table). Each
   process reports its resident set before its first step and its peak
   (`ru_maxrss`); the difference is what training added.
2. **Bytes per step** (trainer 0's `RpcClient.stats`: the serialised messages it sent
   and received per step, gRPC framing not counted):
   (a) the same batches against a 100k-row and a `rows`-row table;
   (b) batches whose ids come from the 10, 100 or 1000 most popular ids
   (`--unique-ids`), global batch 512, against the `rows`-row table; beside the unique
   ids in trainer 0's half of each batch.

Every process runs with one BLAS thread.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
SCRIPT = str(ROOT / "examples" / "train_ctr.py")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MIB = 2**20


def launched(tmp: Path, *flags: str) -> list[dict]:
    """Run 2 x 2 under launch; each trainer's saved arrays."""
    from transpiler.runtime.launch import LaunchConfig, launch

    config = LaunchConfig(command=(sys.executable, SCRIPT, "--quiet", "--save", str(tmp / "params"), *flags),
                          pservers=2, trainers=2, env=ONE_THREAD, log_dir=tmp / "logs", status_every=3600.0)
    tmp.mkdir(parents=True, exist_ok=True)
    with open(tmp / "launch.txt", "w") as out:
        result = launch(config, out=out)
    if not result.ok:
        raise SystemExit(f"the job failed: {result.failure} (logs in {tmp / 'logs'})")
    return [dict(np.load(tmp / "params" / f"trainer_{i}.npz")) for i in range(2)]


def local(tmp: Path, *flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINING_ROLE", "PADDLE_"))} | ONE_THREAD
    subprocess.run([sys.executable, SCRIPT, "--quiet", "--save", str(tmp / "local"), *flags], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return dict(np.load(tmp / "local" / "local.npz"))


def unique_ids_per_step(rows: int, steps: int, batch: int, unique: int | None) -> float:
    """Mean unique ids in trainer 0's half of each global batch."""
    import train_ctr

    from transpiler.runtime.role import TRAINER, Role

    main, _ = train_ctr.build_ctr("distributed", rows)
    data = train_ctr.ClickData(main, 0, unique)
    role = Role(TRAINER, 0, 2, ("a:1", "b:2"))
    counts = []
    for step in range(steps):
        part = train_ctr.shard(data.batch(step, batch), role)
        ids = np.concatenate([part[slot].array.reshape(-1) for slot in data.slots])
        counts.append(np.unique(ids).size)
    return float(np.mean(counts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    rows, steps = args.rows, str(args.steps)
    table = rows * 16 * 4

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        common = ("--rows", str(rows), "--steps", steps, "--batch", "64")
        trainers = launched(tmp / "dist", *common)
        ref = local(tmp / "local", *common)
        print(f"1. memory: {rows:,} x 16 fp32 table = {table / MIB:.1f} MiB ({table / 1e6:.0f} MB); "
              f"2 pservers x 2 trainers, {steps} steps, batch 64")
        print(f"   {'process':<10} {'RSS at start':>13} {'peak RSS':>10} {'growth':>9}")
        for name, saved in (("trainer 0", trainers[0]), ("trainer 1", trainers[1]), ("local", ref)):
            start, peak = saved["rss_kb"] / 1024
            print(f"   {name:<10} {start:>9.1f} MiB {peak:>6.1f} MiB {peak - start:>5.1f} MiB")

        print("2a. bytes per step, the same batches (batch 64, Zipf ids) against two table sizes (trainer 0)")
        print(f"   {'table rows':>11} {'unique ids':>11} {'sent/step':>12} {'received/step':>14}")
        for height in (100_000, rows):
            saved = trainers[0] if height == rows else launched(tmp / f"rows{height}", "--rows", str(height),
                                                                   "--steps", steps, "--batch", "64")[0]
            sent, received = saved["traffic"].mean(axis=0)
            ids = unique_ids_per_step(height, args.steps, 64, None)
            print(f"   {height:>11,} {ids:>11.1f} {sent:>10,.0f} B {received:>12,.0f} B")

        print(f"2b. bytes per step against the {rows:,}-row table, batch 512, ids from the K most popular (trainer 0)")
        print(f"   {'K':>5} {'unique ids':>11} {'sent/step':>12} {'received/step':>14} {'sent per id':>12}")
        for unique in (10, 100, 1000):
            saved = launched(tmp / f"u{unique}", "--rows", str(rows), "--steps", steps, "--batch", "512",
                             "--unique-ids", str(unique))[0]
            sent, received = saved["traffic"].mean(axis=0)
            ids = unique_ids_per_step(rows, args.steps, 512, unique)
            print(f"   {unique:>5} {ids:>11.1f} {sent:>10,.0f} B {received:>12,.0f} B {sent / ids:>10,.0f} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
