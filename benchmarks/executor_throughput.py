"""Executor throughput: training steps per second of a fixture program.

    python3 benchmarks/executor_throughput.py [--case mlp_adam_2ps] [--batch 64] [--steps 200]

Runs the case's startup program, then its main program (forward, backward, optimizer)
on one random batch repeatedly, and prints steps/s and the time per op type.

On a machine other processes keep busy, run with OPENBLAS_NUM_THREADS=1: a multi-threaded
BLAS fighting for cores can make `mul` ten times slower than single-threaded.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ops.executor import Executor  # noqa: E402
from ops.kernels import get_kernel  # noqa: E402
from ops.scope import Scope  # noqa: E402
from ops.tensor import LoDTensor  # noqa: E402
from transpiler.ir import DType, Program  # noqa: E402

CASES = ROOT / "tests" / "fixtures" / "paddle_programs"


def make_feed(program: Program, batch: int, rng: np.random.Generator) -> dict[str, object]:
    block = program.global_block()
    written = {n for op in block.ops for n in op.output_names}
    feed: dict[str, object] = {}
    for name, var in block.vars.items():
        readers = block.readers(name)
        if var.persistable or name in written or not readers or var.dtype is None:
            continue
        shape = [batch if d < 0 else d for d in var.shape]
        reader = readers[0]
        if var.dtype == DType.INT64:
            if reader.type.startswith("lookup_table"):
                height = block.var(reader.input("W")[0]).shape[0]
                if var.lod_level:
                    lengths = rng.integers(1, 4, size=batch)
                    feed[name] = LoDTensor.from_lengths(
                        rng.integers(0, height, size=(int(lengths.sum()), 1)), [lengths.tolist()]
                    )
                    continue
                feed[name] = rng.integers(0, height, size=shape)
            else:
                classes = block.var((reader.input("Logits") or reader.input("X"))[0]).shape[-1]
                feed[name] = rng.integers(0, classes, size=shape)
        else:
            feed[name] = rng.standard_normal(shape).astype(var.dtype.to_numpy())
    return feed


def profile(exe: Executor, main: Program, feed: dict, scope: Scope, steps: int) -> dict[str, float]:
    """Seconds per op type over `steps` runs, by wrapping each kernel with a timer."""
    from ops.kernels import registry

    spent: dict[str, float] = defaultdict(float)
    originals = {}
    for op in main.global_block().ops:
        spec = get_kernel(op.type)
        if op.type in originals:
            continue
        originals[op.type] = spec

        def timed(ctx, _fn=spec.fn, _name=op.type):
            start = time.perf_counter()
            _fn(ctx)
            spent[_name] += time.perf_counter() - start

        registry.swap_kernel(op.type, timed)
    try:
        for _ in range(steps):
            exe.run(main, feed=feed, scope=scope)
    finally:
        for spec in originals.values():
            registry.restore_kernel(spec)
    return dict(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="mlp_adam_2ps")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    startup = Program.load(CASES / args.case / "startup.pb")
    main_program = Program.load(CASES / args.case / "main.pb")
    exe, scope = Executor(seed=0), Scope()
    exe.run(startup, scope=scope)
    feed = make_feed(main_program, args.batch, np.random.default_rng(0))
    for _ in range(5):  # warm up
        exe.run(main_program, feed=feed, scope=scope)
    start = time.perf_counter()
    for _ in range(args.steps):
        exe.run(main_program, feed=feed, scope=scope)
    elapsed = time.perf_counter() - start
    print(f"{args.case}: batch {args.batch}, {len(main_program.global_block())} ops/step")
    print(f"  {args.steps / elapsed:.1f} steps/s ({1000 * elapsed / args.steps:.2f} ms/step)")
    spent = profile(exe, main_program, feed, scope, max(1, args.steps // 4))
    total = sum(spent.values())
    print(f"  kernel time {1000 * total / max(1, args.steps // 4):.2f} ms/step; by op type:")
    for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {name:34s} {100 * seconds / total:5.1f}%")


if __name__ == "__main__":
    main()
