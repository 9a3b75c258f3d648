"""What the exact global norm costs: the cross-pserver sum of `clip_mode="exact"`.

    OPENBLAS_NUM_THREADS=1 python3 benchmarks/norm_exchange.py [--steps 200] [--warmup 20] [--repeats 3]

The Paddle 2.6-built MLP with `ClipGradByGlobalNorm(0.01)` (tests/fixtures/paddle_programs/
mlp_clip_global_sgd_3ps: x[64] -> fc 512 relu -> fc 1, fc_0.w_0 cut in 3 blocks), 3 pservers
x 2 trainers on this machine, `--steps` timed steps after `--warmup`: trainer 0's ms per
step with the clip on the trainers (`clip_mode="trainer"`, Paddle 1.8's way: no exchange,
not local training's result) and on the pservers (`"exact"`), and from each pserver's exit
line the exchange itself: ms per step inside `pserver_allreduce_sum` (sending its partial
to the two others and waiting for theirs, so it includes waiting for the slowest pserver)
and bytes sent per step. The modes alternate; the fastest and the median of `--repeats`
runs are shown.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transpiler.runtime.launch import LaunchConfig, launch  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "paddle_programs" / "mlp_clip_global_sgd_3ps"
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
COST = re.compile(r"(\d+) cross-pserver sum\(s\), ([0-9.]+) ms and (\d+) bytes sent each")


def run(mode: str, steps: int, warmup: int, folder: Path) -> dict:
    loss = json.loads((FIXTURE / "case.json").read_text())["loss"]
    command = (sys.executable, str(ROOT / "examples" / "train_program.py"), "--main", str(FIXTURE / "main.pb"),
               "--startup", str(FIXTURE / "startup.pb"), "--loss", loss, "--steps", str(steps),
               "--warmup", str(warmup), "--batch", "64", "--clip-mode", mode)
    config = LaunchConfig(command=command, pservers=3, trainers=2, sync_mode=True, env=ONE_THREAD,
                          log_dir=folder / "logs", rpc_timeout=60.0, status_every=600.0, exit_grace=30.0)
    with open(folder / "launch.txt", "w") as out:
        result = launch(config, out=out)
    if not result.ok:
        raise SystemExit(f"{mode}: the job failed: {result.failure}")
    texts = [p.read_text(errors="replace") for p in sorted((folder / "logs").glob("*")) if p.is_file()]
    timing = next(json.loads(line[len("timing: "):]) for text in texts for line in text.splitlines()
                  if line.startswith("timing: "))
    costs = [COST.search(line) for text in texts for line in text.splitlines() if COST.search(line)]
    return {
        "ms_per_step": 1000 * timing["seconds"] / timing["steps"],
        "exchange_ms": statistics.mean(float(m[2]) for m in costs) if costs else 0.0,
        "exchange_bytes": statistics.mean(int(m[3]) for m in costs) if costs else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"trainer": [], "exact": []}
    with tempfile.TemporaryDirectory(prefix="norm_exchange_") as tmp:
        for k in range(args.repeats):
            for mode in runs:
                folder = Path(tmp) / f"{mode}_{k}"
                folder.mkdir()
                runs[mode].append(run(mode, args.steps, args.warmup, folder))
    print(f"3 pservers x 2 trainers, global batch 64, {args.steps} steps after {args.warmup} "
          f"(fastest / median of {args.repeats})")
    print(f"{'clip_mode':10} {'ms/step':>16} {'exchange ms/step':>18} {'exchange bytes/step':>20}")
    for mode, results in runs.items():
        step = sorted(r["ms_per_step"] for r in results)
        ex = sorted(r["exchange_ms"] for r in results)
        print(f"{mode:10} {step[0]:7.2f} / {statistics.median(step):6.2f} {ex[0]:8.2f} / {statistics.median(ex):6.2f}"
              f" {results[0]['exchange_bytes']:20.0f}")


if __name__ == "__main__":
    main()
