"""Ray's overhead: the same job under the local `launch` and under `launch --backend ray`.

    python benchmarks/ray_overhead.py [--steps 300] [--repeat 3] [--pservers 2] [--trainers 2]
    make bench-ray

The job: `examples/train_program.py` on the MLP 784-512-512-10 (Adam, batch 64 per trainer),
M pservers x N trainers, sync, one BLAS thread per process. Runs alternate (local, Ray,
local, Ray, ...); the table shows each figure's median:

* Ray up: starting the local Ray instance (127.0.0.1 only), once, before the Ray runs
  (`launch --backend ray` without `--address` pays it every time; a cluster, never);
* job start: from `launch()` being called to trainer 0 starting its first step (placing
  the bundles, starting the actors or processes, each transpiling its programs, the
  trainers' initial fetch);
* steps/s: trainer 0's, over its `--steps` steps (its `timing:` line);
* job total: from `launch()` to its return (stopping the processes, removing the actors
  and the placement group included).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a loopback-only local instance

from transpiler.runtime.launch import LaunchConfig, launch  # noqa: E402

ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def one_run(backend: str, folder: Path, programs: tuple[Path, Path], args: argparse.Namespace) -> dict[str, float]:
    main_pb, startup_pb = programs
    command = (sys.executable, str(ROOT / "examples" / "train_program.py"), "--main", str(main_pb), "--startup",
               str(startup_pb), "--loss", "mean_0.tmp_0", "--steps", str(args.steps), "--warmup", "0",
               "--batch", str(64 * args.trainers))
    config = LaunchConfig(command=command, pservers=args.pservers, trainers=args.trainers, env=ONE_THREAD,
                          log_dir=folder / "logs", status_every=600.0, backend=backend)
    called = time.time()
    result = launch(config, out=io.StringIO())
    total = time.time() - called
    if not result.ok:
        raise SystemExit(f"{backend} run failed: {result.failure}")
    timing = next(json.loads(line[len("timing: "):]) for line in (folder / "logs" / "trainer.0.log").read_text().splitlines()
                  if line.startswith("timing: "))
    return {"job start s": timing["start"] - called, "steps/s": timing["steps"] / timing["seconds"], "job total s": total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pservers", type=int, default=2)
    parser.add_argument("--trainers", type=int, default=2)
    args = parser.parse_args()

    import mlp
    import ray

    with tempfile.TemporaryDirectory(prefix="ray-overhead-") as tmp:
        folder = Path(tmp)
        main_program, startup = mlp.build()
        programs = folder / "main.pb", folder / "startup.pb"
        main_program.save(programs[0])
        startup.save(programs[1])
        started = time.monotonic()
        ray.init(num_cpus=max(os.cpu_count() or 1, args.pservers + args.trainers), include_dashboard=False,
                 log_to_driver=False, logging_level="warning", _node_ip_address="127.0.0.1")
        ray_up = time.monotonic() - started
        runs: dict[str, list[dict[str, float]]] = {"local": [], "ray": []}
        try:
            for i in range(args.repeat):
                for backend in ("local", "ray"):
                    figures = one_run(backend, folder / f"{backend}{i}", programs, args)
                    runs[backend].append(figures)
                    print(f"  run {i + 1}/{args.repeat} {backend}: " + ", ".join(f"{k} {v:.3g}" for k, v in figures.items()),
                          flush=True)
        finally:
            ray.shutdown()
    print(f"\nMLP 784-512-512-10 Adam, {args.pservers} pservers x {args.trainers} trainers sync, {args.steps} steps, "
          f"median of {args.repeat}; Ray up (local instance, once): {ray_up:.1f} s")
    print(f"{'figure':<14}{'local launch':>14}{'ray':>10}{'ray/local':>11}")
    for key in ("job start s", "steps/s", "job total s"):
        local, on_ray = (statistics.median(r[key] for r in runs[b]) for b in ("local", "ray"))
        print(f"{key:<14}{local:>14.3g}{on_ray:>10.3g}{on_ray / local:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
