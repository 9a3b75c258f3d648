"""`make demo`: the MLP on scikit-learn's digits, 2 pservers x 2 trainers, end to end.

    python3 examples/demo.py [OUT_DIR]                 # default build/demo
    python3 examples/demo.py [OUT_DIR] --backend ray   # `make demo-ray`: the same job as Ray actors

1. builds the training program (`examples/train_mlp_digits.py`), picks two free ports,
   transpiles it for 2 pservers x 2 trainers and writes the programs and the plan to
   `OUT_DIR/programs/` (inspect them with `pstranspile dump`);
2. launches 2 pservers and 2 trainers of `train_mlp_digits.py` on this machine
   (`transpiler.runtime.launch`, sync mode; one log per process in `OUT_DIR/logs/`), each
   process transpiling for its own role exactly as step 1 did; with `--backend ray`, as
   actors on a local Ray instance (or the cluster at `--address`), whose pserver actors
   pick their own ports;
3. prints the test accuracy before and after training (trainer 0's report,
   `OUT_DIR/result.json`). Exits non-zero if any process failed;
4. summarizes the job's metrics file (`OUT_DIR/logs/metrics.jsonl`) and draws it into
   `OUT_DIR/logs/report.png` (what `pstranspile report OUT_DIR/logs` does; the picture
   needs matplotlib, the `plot` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent
try:
    import transpiler  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without installing
    sys.path.insert(0, str(EXAMPLES.parent))
sys.path.insert(0, str(EXAMPLES))

from train_mlp_digits import build  # noqa: E402

from transpiler.api import transpile  # noqa: E402
from transpiler.runtime.launch import LaunchConfig, free_endpoints, launch  # noqa: E402

PSERVERS, TRAINERS = 2, 2


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="build/demo", help="where programs, logs and result.json go")
    parser.add_argument("--backend", choices=("local", "ray"), default="local",
                        help="run the processes here (local) or as Ray actors (ray: `make demo-ray`)")
    parser.add_argument("--address", help="ray: the cluster to join (default: a local Ray instance on 127.0.0.1)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    main_program, startup, _ = build(learning_rate=0.003)
    endpoints = free_endpoints(PSERVERS)
    result = transpile(main_program, startup, pservers=endpoints, trainers=TRAINERS, trainer_id=0)
    written = result.save(out / "programs")
    print(f"demo: transpiled the digits MLP for {PSERVERS} pservers x {TRAINERS} trainers -> {out / 'programs'}")
    for param in result.plan.params:
        places = ", ".join(f"{b.name} {list(b.shape)} @ {ep}" for b, ep in zip(param.blocks, param.endpoints, strict=True))
        print(f"  {param.param}: {places}")
    print(f"  ({len(written)} files: trainer.pb, trainer_startup.pb, one main + startup per pserver, plan.json)")

    report = out / "result.json"
    report.unlink(missing_ok=True)
    config = LaunchConfig(
        command=(sys.executable, str(EXAMPLES / "train_mlp_digits.py"), "--out", str(report)),
        pservers=PSERVERS,
        trainers=TRAINERS,
        endpoints=tuple(endpoints) if args.backend == "local" else None,  # Ray's pserver actors pick their ports
        backend=args.backend,
        address=args.address,
        log_dir=out / "logs",
        status_every=1.0,
    )
    where = "on Ray" if args.backend == "ray" else "on this machine"
    print(f"demo: launching {PSERVERS} pservers and {TRAINERS} trainers {where} (logs in {out / 'logs'})", flush=True)
    job = launch(config, out=sys.stdout)
    if not job.ok:
        print(f"demo: FAILED: {job.failure}")
        return 1
    facts = json.loads(report.read_text())
    print(
        f"demo: test accuracy before training {facts['before']:.3f}, after {facts['after']:.3f} "
        f"({facts['steps']} sync steps, last loss {facts['losses'][-1]:.4f}; {time.monotonic() - started:.1f} s in all)"
    )
    show_report(out / "logs")
    return 0


def show_report(log_dir: Path) -> None:
    """Summarize the job's metrics file and draw it (`pstranspile report`), then point at the picture."""
    from transpiler.runtime.metrics import read_metrics
    from transpiler.runtime.report import PlotUnavailable, draw, summarize, summary_lines

    records = read_metrics(log_dir)
    print("\n".join(summary_lines(summarize(records))))
    try:
        picture = draw(records, log_dir / "report.png", title="make demo: the digits MLP, 2 pservers x 2 trainers")
    except PlotUnavailable as exc:
        print(f"demo: {exc} to draw the run (or run `pstranspile report {log_dir}` later)")
        return
    print(f"demo: loss, throughput, RPC traffic and pserver CPU per process: {picture}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
