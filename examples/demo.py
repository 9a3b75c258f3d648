"""`make demo`: the MLP on scikit-learn's digits, 2 pservers x 2 trainers, end to end.

    python3 examples/demo.py [OUT_DIR]        # default build/demo

1. builds the training program (`examples/train_mlp_digits.py`), picks two free ports,
   transpiles it for 2 pservers x 2 trainers and writes the programs and the plan to
   `OUT_DIR/programs/` (inspect them with `pstranspile dump`);
2. launches 2 pservers and 2 trainers of `train_mlp_digits.py` on this machine
   (`transpiler.runtime.launch`, sync mode; one log per process in `OUT_DIR/logs/`), each
   process transpiling for its own role exactly as step 1 did;
3. prints the test accuracy before and after training (trainer 0's report,
   `OUT_DIR/result.json`). Exits non-zero if any process failed.
"""

from __future__ import annotations

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
    out = Path(argv[0] if argv else "build/demo")
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
        endpoints=tuple(endpoints),
        log_dir=out / "logs",
        status_every=1.0,
    )
    print(f"demo: launching {PSERVERS} pservers and {TRAINERS} trainers (logs in {out / 'logs'})", flush=True)
    job = launch(config, out=sys.stdout)
    if not job.ok:
        print(f"demo: FAILED: {job.failure}")
        return 1
    facts = json.loads(report.read_text())
    print(
        f"demo: test accuracy before training {facts['before']:.3f}, after {facts['after']:.3f} "
        f"({facts['steps']} sync steps, last loss {facts['losses'][-1]:.4f}; {time.monotonic() - started:.1f} s in all)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
