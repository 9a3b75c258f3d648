"""A real pserver's resident memory after warm-up against the cost model's.

    python3 benchmarks/pserver_rss.py [--steps 40] [--json]

Jobs, each under `pstranspile launch`, 2 pservers x 2 trainers, sync, `--steps` steps:

- `baseline`: `examples/train_ctr.py --variant local-table --rows 1000 --width 64 ...`, a
  pserver holding ~0.5 MB: the process baseline (Python, numpy, gRPC, the runtime) is its
  median RSS less its model;
- `mlp`: `examples/train_program.py` on the `mlp_adam_2ps` fixture (784-256-128-10, Adam);
- `ctr-table`: `examples/train_ctr.py --variant local-table --rows 1000000 --width 64
  --zipf 1.1 --hot-first --batch 512` (a `[1M, 64]` fp32 table prefetched from its blocks,
  Adagrad).

(A tiny `train_program.py` job is no baseline: the `fluid18_basic_sgd_2ps` pserver's RSS
stayed ~20 MB above the MLP's, its step buffers kept by `ops.rpc.malloc`.)

While a job runs, every pserver's VmRSS is read from /proc every 0.2 s (the pservers are
the launch's descendants with `TRAINING_ROLE=PSERVER`); the figure is the median of the
samples of the second half of the job (after warm-up; min and max beside it). The model:
the baseline plus `transpiler.cost.resident_bytes` of the job's plan (params, optimizer
state, grads as a step holds them, the step copies a sparse Adagrad keeps), against the
median; and its peak (plus the copies the largest sparse Adagrad block makes while it
runs, param and moment) against the max. The target: within 15%.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

PSERVERS, TRAINERS = 2, 2
FIXTURES = REPO / "tests" / "fixtures" / "paddle_programs"


def program_job(fixture: str) -> list[str]:
    loss = json.loads((FIXTURES / fixture / "case.json").read_text())["loss"]
    return ["train_program.py", "--main", str(FIXTURES / fixture / "main.pb"), "--startup",
            str(FIXTURES / fixture / "startup.pb"), "--loss", loss, "--batch", "64"]


CTR = ["train_ctr.py", "--variant", "local-table", "--width", "64", "--zipf", "1.1", "--hot-first", "--batch", "512"]
# name: (the command after `python3 examples/`, the process baseline job it is measured beside)
JOBS = {
    "baseline": ([*CTR, "--rows", "1000"], None),
    "mlp": (program_job("mlp_adam_2ps"), "baseline"),
    "ctr-table": ([*CTR, "--rows", "1000000"], "baseline"),
}


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def pserver_rss(pid: int) -> tuple[str, int] | None:
    """(endpoint, RSS bytes) of a pserver process, None for any other."""
    try:
        environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        if environ.get("TRAINING_ROLE") != "PSERVER":
            return None
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return environ.get("PADDLE_CURRENT_ENDPOINT", str(pid)), int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def run_job(name: str, steps: int) -> dict[str, list[int]]:
    """Per pserver endpoint: (min, median, max) VmRSS bytes over the second half of the job."""
    script, *args = JOBS[name][0]
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "transpiler", "launch", "--pservers", str(PSERVERS), "--trainers",
                   str(TRAINERS), "--log-dir", f"{tmp}/logs", "-q", "--timeout", "600", "--",
                   sys.executable, str(REPO / "examples" / script), *args, "--steps", str(steps)]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        job = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        samples: dict[str, list[int]] = {}
        while job.poll() is None:
            for pid in descendants(job.pid):
                found = pserver_rss(pid)
                if found is not None:
                    samples.setdefault(found[0], []).append(found[1])
            time.sleep(0.2)
        if job.returncode != 0:
            raise SystemExit(f"{name}: the job failed\n{job.stderr.read()[-3000:]}")
    out = {}
    for ep, series in sorted(samples.items()):
        late = series[len(series) // 2:]
        out[ep] = [min(late), int(statistics.median(late)), max(late)]
    return out


def model(name: str) -> dict[str, dict[str, int]]:
    """`resident_bytes` per pserver of the job's plan (the job's own transpile, same flags),
    and the transient copies of its largest sparse-copying block (`peak_extra`)."""
    import numpy as np

    from transpiler.api import transpile
    from transpiler.cost import IdStats, resident_bytes, sparse_step_copies
    from transpiler.ir import Program
    from ops.catalogue.optimizer_ops import optimizer_slots

    command = JOBS[name][0]
    stats = {}
    if command[0] == "train_program.py":
        main, startup = Program.load(Path(command[2])), Program.load(Path(command[4]))
    else:
        import train_ctr

        rows = int(command[command.index("--rows") + 1])
        main, startup = train_ctr.build_ctr("local-table", rows, 64)
        sample = (np.random.default_rng(0).zipf(1.1, 200_000) - 1) % rows
        stats = {"emb": IdStats.from_sample(sample, rows, round(512 / TRAINERS * 3 * 2.5))}
    eps = [f"127.0.0.1:{7200 + i}" for i in range(PSERVERS)]
    plan = transpile(main, startup, pservers=eps, trainers=TRAINERS).plan
    out = {}
    for ep in eps:
        parts = resident_bytes(plan, ep, stats)
        peak = 0
        for param in plan.params:
            if param.sparse and sparse_step_copies(param.optimizer, plan.sync_mode):
                arrays = 1 + len(optimizer_slots(param.optimizer).sliced)
                for block in param.blocks_on(ep):
                    peak = max(peak, arrays * block.rows * (block.cols or param.shape[1]) * param.dtype.itemsize)
        out[ep] = {**parts, "peak_extra": peak}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    measured = {name: run_job(name, args.steps) for name in JOBS}
    predicted = {name: model(name) for name in JOBS}
    baselines = {}
    for name, (_, base) in JOBS.items():
        if base is None:  # the process's own memory: the tiny job's median RSS less its model
            baselines[name] = max(rss[1] - sum(v for k, v in parts.items() if k != "peak_extra")
                                  for rss, parts in zip(measured[name].values(), predicted[name].values(), strict=True))
    rows = []
    for name, (_, base) in JOBS.items():
        if base is None:
            continue
        for (ep, rss), parts in zip(measured[name].items(), predicted[name].values(), strict=True):
            resting = baselines[base] + sum(v for k, v in parts.items() if k != "peak_extra")
            rows.append({"job": name, "pserver": ep, "rss_min_median_max": rss, "baseline_bytes": baselines[base],
                         "model_bytes": resting, "model_peak_bytes": resting + parts["peak_extra"],
                         "model_parts": parts, "model_vs_median_rss": round(resting / rss[1], 3),
                         "peak_vs_max_rss": round((resting + parts["peak_extra"]) / rss[2], 3)})
    if args.json:
        print(json.dumps({"baselines": baselines, "measured": measured, "rows": rows}, indent=1))
        return 0
    mib = 1 << 20
    print("process baselines (a tiny job's median RSS less its model): "
          + ", ".join(f"{k} {v / mib:.1f} MiB" for k, v in baselines.items()))
    print(f"{'job':<10} {'rss min/median/max MiB':>24} {'model MiB':>10} {'model/median':>12} {'peak MiB':>9} "
          f"{'peak/max':>8}  model parts (MiB, beside the baseline)")
    for r in rows:
        parts = ", ".join(f"{k} {v / mib:.1f}" for k, v in r["model_parts"].items())
        rss = "/".join(f"{v / mib:.0f}" for v in r["rss_min_median_max"])
        print(f"{r['job']:<10} {rss:>24} {r['model_bytes'] / mib:>10.1f} {r['model_vs_median_rss']:>12.3f} "
              f"{r['model_peak_bytes'] / mib:>9.1f} {r['peak_vs_max_rss']:>8.3f}  {parts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
