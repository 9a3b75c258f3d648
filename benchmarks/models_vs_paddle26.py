"""Real models' local training step, ours beside Paddle 2.6's CPU executor, on Paddle's own programs.

    python benchmarks/models_vs_paddle26.py [--rounds 3] [--case resnet_small ...]

Each case (the `CASES` table: a Paddle-built fixture, a fixed batch, how to draw its feed)
trains locally (no pservers) on the same main.pb / startup.pb and the same feed in both:

* ours: `python benchmarks/models_vs_paddle26.py --worker CASE ...`, a process of our runtime
  (`Executor`); after the timed steps `PROFILED_STEPS` more run with every kernel timed
  (`swap_kernel`), which gives where our time goes per op type ("outside kernels": the
  executor's own work, feeding and fetching);
* Paddle 2.6.2: benchmarks/paddle26_step.py in its venv (tools/paddle_env.py), the same
  programs parsed from the same bytes, Paddle's `static.Executor` on CPU.

Both run one thread (`PADDLE_SPEED_ENV`: OMP/MKL/OpenBLAS 1, the machine has 2 cores shared
with other work) and time whole steps (`Executor.run`, feed to fetched loss) after a warmup.
Runs alternate (Paddle, ours, Paddle, ours, ...; `--rounds` each) and the table shows each
side's median ms/step over all timed steps of all rounds, wall and CPU (the process's own
CPU time: the steadier figure while the rest of the machine competes for the cores), and
ours / Paddle's. Rows for other
models are one more entry in `CASES`. Exits 0 with one line when Paddle 2.6.2 is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.paddle_env import PADDLE_SPEED_ENV, installed  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "paddle_programs"
PROFILED_STEPS = 3  # after the timed steps, with every kernel timed: where the time goes


def images(side: int, classes: int) -> Callable[[int, np.random.Generator], dict[str, np.ndarray]]:
    def feed(batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"image": rng.standard_normal((batch, 3, side, side)).astype(np.float32),
                "label": rng.integers(0, classes, size=(batch, 1)).astype(np.int64)}

    return feed


@dataclass(frozen=True)
class Case:
    fixture: str  # a folder of tests/fixtures/paddle_programs
    batch: int
    feed: Callable[[int, np.random.Generator], dict[str, np.ndarray]]
    warmup: int
    steps: int
    loss: str = "mean_0.tmp_0"


CASES = {
    "resnet50": Case("resnet50_momentum_4ps_sync", batch=2, feed=images(224, 1000), warmup=1, steps=3),
    "resnet_small": Case("resnet_small_momentum_3ps_sync", batch=32, feed=images(32, 10), warmup=5, steps=30),
}


# ------------------------------------------------------------------ ours (worker)


def worker(name: str, feed_npz: str) -> None:
    """Our side of one round: JSON with per-step seconds and per-op-type seconds of one step."""
    from ops.executor import Executor
    from ops.kernels import registry
    from ops.scope import Scope
    from transpiler.ir import Program

    case = CASES[name]
    main = Program.load(FIXTURES / case.fixture / "main.pb")
    startup = Program.load(FIXTURES / case.fixture / "startup.pb")
    feed = dict(np.load(feed_npz))
    exe, scope = Executor(seed=0), Scope()
    exe.run(startup, scope=scope)
    seconds, cpu, losses = [], [], []
    for step in range(case.warmup + case.steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        (loss,) = exe.run(main, feed=feed, fetch_list=[case.loss], scope=scope)
        if step >= case.warmup:
            seconds.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
        losses.append(float(np.asarray(loss).reshape(-1)[0]))
    by_op: dict[str, float] = defaultdict(float)

    def timed(op_type: str, fn):
        def run(ctx) -> None:
            t0 = time.perf_counter()
            fn(ctx)
            by_op[op_type] += time.perf_counter() - t0

        return run

    types = {op.type for op in main.global_block().ops}
    originals = [registry.swap_kernel(t, timed(t, registry.get_kernel(t).fn)) for t in sorted(types)]
    try:
        start = time.perf_counter()
        for _ in range(PROFILED_STEPS):
            exe.run(main, feed=feed, fetch_list=[case.loss], scope=scope)
        profiled = time.perf_counter() - start
    finally:
        for spec in originals:
            registry.restore_kernel(spec)
    by_op["(outside kernels)"] = profiled - sum(by_op.values())
    print(json.dumps({"seconds": seconds, "cpu": cpu, "loss": [losses[0], losses[-1]], "by_op": dict(by_op),
                      "profiled": profiled}))


# ------------------------------------------------------------------ the driver


def run_json(command: list[str], env: dict[str, str]) -> dict:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:3])} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--feed", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.feed)
        return 0
    paddle = installed("2.6.2")
    if paddle is None:
        print("models_vs_paddle26: Paddle 2.6.2 is not installed (python3 tools/paddle_env.py 2.6.2 makes it); skipped")
        return 0
    env = {**os.environ, **PADDLE_SPEED_ENV, "PYTHONPATH": str(ROOT)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.case or list(CASES):
            case = CASES[name]
            folder = FIXTURES / case.fixture
            feed_npz = Path(tmp) / f"{name}.npz"
            np.savez(feed_npz, **case.feed(case.batch, np.random.default_rng(0)))
            ours, theirs, by_op = defaultdict(list), defaultdict(list), defaultdict(float)
            for _ in range(max(1, args.rounds)):
                paddle_run = run_json([str(paddle), str(ROOT / "benchmarks" / "paddle26_step.py"),
                                       str(folder / "main.pb"), str(folder / "startup.pb"), str(feed_npz), case.loss,
                                       str(case.warmup), str(case.steps)], env)
                mine = run_json([sys.executable, __file__, "--worker", name, "--feed", str(feed_npz)], env)
                for side, run in ((theirs, paddle_run), (ours, mine)):
                    side["wall"] += run["seconds"]
                    side["cpu"] += run["cpu"]
                for op_type, seconds in mine["by_op"].items():
                    by_op[op_type] += seconds / mine["profiled"] / max(1, args.rounds)
            rows.append((name, case, {k: statistics.median(v) * 1e3 for k, v in ours.items()},
                         {k: statistics.median(v) * 1e3 for k, v in theirs.items()}, by_op))
    print(f"local training step, one thread each, medians over {args.rounds} alternating rounds (ms/step; CPU is the "
          "steadier figure on a shared machine)")
    print(f"{'case':14s} {'batch':>5s} {'ours wall':>9s} {'Paddle':>8s} {'ratio':>6s} {'ours CPU':>9s} {'Paddle':>8s} "
          f"{'ratio':>6s}  where our step goes")
    for name, case, ours, theirs, by_op in rows:
        top = sorted(by_op.items(), key=lambda kv: -kv[1])[:6]
        where = ", ".join(f"{t} {share:.0%}" for t, share in top)
        print(f"{name:14s} {case.batch:5d} {ours['wall']:9.1f} {theirs['wall']:8.1f} {ours['wall'] / theirs['wall']:5.2f}x "
              f"{ours['cpu']:9.1f} {theirs['cpu']:8.1f} {ours['cpu'] / theirs['cpu']:5.2f}x  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
