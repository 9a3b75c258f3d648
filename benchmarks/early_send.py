"""Early sends or early receives on and off (issue 30, `PSTRANSPILE_EARLY_SEND`,
`PSTRANSPILE_EARLY_RECV` with `--vary recv`): our runtime alone, on the Paddle-built
workloads of `vs_paddle18.py`, 2 pservers x 2 trainers sync on 127.0.0.1.

    python benchmarks/early_send.py [--vary send|recv] [--case deep2048 ...] [--steps 30] [--warmup 10] [--repeat 3] [--choice off --choice auto]

Fluid 1.8.5 (its venv, `tools/paddle_env.py`) builds the programs once; then, per case,
the runs alternate between the choices (off, auto, off, auto, ...) so that the shared
machine's load falls on all of them alike, and the table gives each choice's median
steps/s and CPU ms/step (all 4 processes), and the ratio to the first choice. Cases:
`vs_paddle18.py`'s (`--case`, repeatable; default: mlp64, wide64, wide256, deep2048).
Exits 0 with one line when Paddle 1.8.5 cannot be installed here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vs_paddle18 as harness  # noqa: E402

from ops.rpc.client import EARLY_CHOICES, EARLY_ENV, RECV_CHOICES, RECV_ENV  # noqa: E402
from tools.paddle_env import PaddleUnavailable, ensure  # noqa: E402

DEFAULT_CASES = ("mlp64", "wide64", "wide256", "deep2048")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vary", choices=("send", "recv"), default="send",
                        help=f"the setting compared: {EARLY_ENV} (send, the default) or {RECV_ENV} (recv)")
    parser.add_argument("--case", choices=[c.key for c in harness.CASES if not c.local], action="append")
    parser.add_argument("--choice", choices=sorted(set(EARLY_CHOICES) | set(RECV_CHOICES)), action="append",
                        help="settings to compare (repeatable; default: off, auto); ratios are to the first")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run (times the case's share)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="keep programs and logs here")
    args = parser.parse_args(argv)
    choices = args.choice or ["off", "auto"]
    variable = EARLY_ENV if args.vary == "send" else RECV_ENV
    cases = [c for c in harness.CASES if c.key in (args.case or DEFAULT_CASES)]
    try:
        python = ensure("1.8.5", log=lambda line: print(line, file=sys.stderr))
    except PaddleUnavailable as error:
        print(f"early_send: skipped: Paddle 1.8.5 is unavailable here ({error})")
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="early_send_") as tmp:
        work = args.keep or Path(tmp)
        harness.build(python, work)
        for case in cases:
            steps = max(1, round(args.steps * case.steps_share))
            runs: dict[str, list[harness.Measurement]] = {c: [] for c in choices}
            for rep in range(args.repeat):
                for choice in choices:
                    logs = work / "logs" / f"{case.key}-{choice}-{rep}"
                    logs.mkdir(parents=True, exist_ok=True)
                    os.environ[variable] = choice
                    try:
                        got = harness.run_ours(work / case.workload, case, steps, args.warmup, logs)
                    except harness.RunFailed as error:
                        print(f"early_send: {error}", file=sys.stderr)
                        return 1
                    runs[choice].append(got)
                    print(f"  {case.key} {choice} run {rep + 1}: {got.steps_per_s:.2f} steps/s, {got.cpu_ms:.0f} CPU ms/step, "
                          f"other load {got.elsewhere:.2f} cores", file=sys.stderr, flush=True)
            rows.append((case, {c: (statistics.median(m.steps_per_s for m in ms), statistics.median(m.cpu_ms for m in ms))
                                for c, ms in runs.items()}))
    first = choices[0]
    print(f"{'Early sends' if args.vary == 'send' else 'Early receives'} ({variable}), ours only, 2 pservers x 2 trainers sync, median of {args.repeat} alternating runs")
    print()
    print("| workload | " + " | ".join(f"{c}: steps/s, CPU ms/step" for c in choices) + " | "
          + " | ".join(f"{c}/{first} steps/s" for c in choices[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(choices) - 1))
    for case, medians in rows:
        cells = [f"{s:.2f}, {cpu:.0f}" for s, cpu in medians.values()]
        ratios = [f"{medians[c][0] / medians[first][0]:.2f}" for c in choices[1:]]
        print(f"| {case.label} | " + " | ".join(cells + ratios) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
