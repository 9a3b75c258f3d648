"""Real models' local training step, ours beside Paddle 2.6's own executor on Paddle's own
programs, interleaved in one run, and where our time goes per op type.

    python3 benchmarks/models_vs_paddle26.py [--rounds 5] [--models resnet50,resnet_small,bert_base,bert_small,gpt]

Models (`MODELS`: Paddle 2.6's programs in tests/fixtures/paddle_programs/, float32):
`resnet50` (resnet50_momentum_4ps_sync, 224x224) at batch 2; `resnet_small`
(resnet_small_momentum_3ps_sync, 32x32) at batch 32; `bert_base` (bert_adam_2ps_noslice_sync:
BERT-base, 12 layers, hidden 768, seq 128) at batch 1; `bert_small` (bert_small_adam_3ps_sync:
2 layers, hidden 64, seq 32) at batch 8; `gpt` (gpt_adam_3ps_sync: 2 layers, hidden 64,
seq 16, vocab 1000) at batch 8. Another model is one more entry.

Each system runs in a worker process of its own (Paddle in its 2.6.2 venv,
tools/paddle_env.py; ours in this interpreter), both single-threaded (OMP / MKL /
OpenBLAS at 1 thread), each loading the same main.pb / startup.pb, running the startup
program and a few warm-up steps, then, round after round and alternating between the two,
the model's steps (forward, backward, optimizer) on the same batch (examples/train_program.py's
`synthetic_batch`). A round reports wall and CPU seconds per step; the table shows each
system's median over the rounds and ours / Paddle's (CPU time: on a machine other
processes keep busy, wall time measures them too). After the timed rounds our worker runs
the steps again with each kernel timed (`swap_kernel`) and prints the op types that take
the most time ("(outside kernels)": the executor's own work, feeding and fetching). Exits
0 with one line when Paddle 2.6.2's venv is absent.
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "paddle_programs"
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "CPU_NUM": "1",
              "MKL_DEBUG_CPU_TYPE": "5", "GLOG_minloglevel": "2", "FLAGS_use_mkldnn": "0"}
LOSS = "mean_0.tmp_0"


@dataclass(frozen=True)
class Model:
    fixture: str  # a folder of tests/fixtures/paddle_programs
    batch: int
    steps: int  # timed steps per round
    warmup: int = 2


MODELS = {
    "resnet50": Model("resnet50_momentum_4ps_sync", batch=2, steps=3, warmup=1),
    "resnet_small": Model("resnet_small_momentum_3ps_sync", batch=32, steps=10, warmup=5),
    "bert_base": Model("bert_adam_2ps_noslice_sync", batch=1, steps=2),
    "bert_small": Model("bert_small_adam_3ps_sync", batch=8, steps=10),
    "gpt": Model("gpt_adam_3ps_sync", batch=8, steps=10),
}


# ------------------------------------------------------------------ the workers


class Worker:
    """The loop both systems' workers run: `step N` -> one JSON line of seconds per step;
    `profile N` (ours) -> seconds per step by op type."""

    def __init__(self, step, profile=None) -> None:
        self.step, self.profile = step, profile

    def serve(self) -> None:
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                return
            count = int(words[1])
            if words[0] == "profile" and self.profile is not None:
                print(json.dumps(self.profile(count)), flush=True)
                continue
            wall, cpu = time.perf_counter(), time.process_time()
            loss = None
            for _ in range(count):
                loss = self.step()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            print(json.dumps({"wall": wall / count, "cpu": cpu / count, "loss": loss}), flush=True)


def paddle_worker(folder: Path, feed_file: Path) -> None:
    import numpy.random  # noqa: F401  (before paddle: Paddle's bundled zlib breaks a later import)

    import paddle

    paddle.enable_static()
    main = paddle.static.Program.parse_from_string((folder / "main.pb").read_bytes())
    startup = paddle.static.Program.parse_from_string((folder / "startup.pb").read_bytes())
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(startup)
    with np.load(feed_file) as saved:
        feed = {k: saved[k] for k in saved.files}

    def step():
        (loss,) = exe.run(main, feed=feed, fetch_list=[LOSS])
        return float(np.asarray(loss).reshape(-1)[0])

    print(json.dumps({"ready": paddle.__version__}), flush=True)
    Worker(step).serve()


def ours_worker(folder: Path, feed_file: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from ops.executor import Executor
    from ops.kernels import registry
    from ops.scope import Scope
    from transpiler.ir import Program

    main, startup = Program.load(folder / "main.pb"), Program.load(folder / "startup.pb")
    exe, scope = Executor(seed=0), Scope()
    exe.run(startup, scope=scope)
    with np.load(feed_file) as saved:
        feed = {k: saved[k] for k in saved.files}

    def step():
        (loss,) = exe.run(main, feed=feed, fetch_list=[LOSS], scope=scope)
        return float(np.asarray(loss).reshape(-1)[0])

    def profile(count: int) -> dict[str, float]:
        spent: dict[str, float] = defaultdict(float)
        originals = {}
        for op_type in sorted({op.type for op in main.global_block().ops}):
            spec = registry.get_kernel(op_type)

            def timed(ctx, _fn=spec.fn, _name=op_type):
                start = time.process_time()
                _fn(ctx)
                spent[_name] += time.process_time() - start

            originals[op_type] = registry.swap_kernel(op_type, timed)
        try:
            start = time.process_time()
            for _ in range(count):
                step()
            total = time.process_time() - start
        finally:
            for spec in originals.values():
                registry.restore_kernel(spec)
        spent["(outside kernels)"] = max(0.0, total - sum(spent.values()))
        return {k: v / count for k, v in spent.items()}

    print(json.dumps({"ready": "ours"}), flush=True)
    Worker(step, profile).serve()


# ------------------------------------------------------------------ the harness


class Process:
    def __init__(self, argv: list[str], log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINING_ROLE", "PADDLE_"))}
        env.update(ONE_THREAD)
        self.log = open(log, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.ready = self.read(600)

    def read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # skip what the system prints on stdout besides our JSON
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {self.proc.args[:3]} exited (log: {self.log.name})")
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"worker {self.proc.args[:3]} timed out")

    def ask(self, command: str, timeout: float = 1800) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()


def make_feed(folder: Path, batch: int, out: Path) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    sys.path.insert(0, str(ROOT))
    from train_program import synthetic_batch

    from transpiler.ir import Program

    feed = synthetic_batch(Program.load(folder / "main.pb"), batch, 0, 0)
    np.savez(out, **{k: np.asarray(v) for k, v in feed.items()})


def bench(model: str, python: Path, rounds: int, work: Path) -> dict:
    spec = MODELS[model]
    case, batch, steps = spec.fixture, spec.batch, spec.steps
    folder = FIXTURES / case
    feed = work / f"{model}.npz"
    make_feed(folder, batch, feed)
    me = str(Path(__file__).resolve())
    ours = Process([sys.executable, me, "--worker", "ours", str(folder), str(feed)], work / f"{model}.ours.log")
    paddle = Process([str(python), me, "--worker", "paddle", str(folder), str(feed)], work / f"{model}.paddle.log")
    try:
        for proc in (ours, paddle):
            proc.ask(f"step {spec.warmup}")  # warm-up
        times: dict[str, list[dict]] = {"ours": [], "paddle": []}
        for _ in range(rounds):
            for name, proc in (("ours", ours), ("paddle", paddle)):
                times[name].append(proc.ask(f"step {steps}"))
        ops = ours.ask(f"profile {steps}")
    finally:
        ours.close()
        paddle.close()
    result = {"model": model, "fixture": case, "batch": batch, "steps_per_round": steps, "rounds": rounds,
              "paddle_version": paddle.ready.get("ready")}
    for name, runs in times.items():
        result[name] = {k: statistics.median(r[k] for r in runs) for k in ("wall", "cpu")}
    result["ratio_cpu"] = result["ours"]["cpu"] / result["paddle"]["cpu"]
    result["ratio_wall"] = result["ours"]["wall"] / result["paddle"]["wall"]
    result["ours_ops"] = dict(sorted(ops.items(), key=lambda kv: -kv[1]))
    return result


def report(result: dict, top: int) -> None:
    ours, paddle = result["ours"], result["paddle"]
    print(f"{result['model']} ({result['fixture']}, batch {result['batch']}, median of {result['rounds']} rounds of "
          f"{result['steps_per_round']} steps): ours {ours['cpu'] * 1e3:.1f} ms CPU / {ours['wall'] * 1e3:.1f} ms wall "
          f"per step, Paddle {result['paddle_version']} {paddle['cpu'] * 1e3:.1f} ms CPU / {paddle['wall'] * 1e3:.1f} "
          f"ms wall: ours / Paddle = {result['ratio_cpu']:.2f}x CPU, {result['ratio_wall']:.2f}x wall")
    total = sum(result["ours_ops"].values()) or 1.0
    for op_type, seconds in list(result["ours_ops"].items())[:top]:
        print(f"    {op_type:<32} {seconds * 1e3:9.2f} ms  {100 * seconds / total:5.1f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--top", type=int, default=12, help="op types to list per model")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--worker", choices=("ours", "paddle"), help=argparse.SUPPRESS)
    parser.add_argument("worker_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        folder, feed = (Path(a) for a in args.worker_args)
        (ours_worker if args.worker == "ours" else paddle_worker)(folder, feed)
        return 0

    sys.path.insert(0, str(ROOT))
    from tools.paddle_env import installed

    python = installed("2.6.2")
    if python is None:
        print("models_vs_paddle26: Paddle 2.6.2's venv is not here (python3 tools/paddle_env.py 2.6.2 makes it); skipped")
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_models_") as tmp:
        for model in args.models.split(","):
            if model not in MODELS:
                parser.error(f"unknown model {model!r}; models: {', '.join(MODELS)}")
            results.append(bench(model, python, args.rounds, Path(tmp)))
            report(results[-1], args.top)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
