"""`make demo-models`: real models Paddle 2.6 built, trained with `launch` on 2 pservers x 2
trainers on this machine, loss going down.

    python3 examples/demo_models.py [OUT_DIR]          # default build/demo-models

1. the small BERT-style encoder (`examples/train_bert_small.py`: the Paddle-built fixture
   `bert_small_adam_3ps_sync`, a synthetic token-majority task), sync mode;
2. the small ResNet (`examples/train_resnet_small.py`) when that example exists (it is
   another change's; skipped with a note otherwise), run the same way.

Each job's logs go to `OUT_DIR/<model>/logs/`; the BERT job's report to
`OUT_DIR/bert/result.json`. Exits non-zero if a job failed or the BERT loss did not go down.
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

from transpiler.runtime.launch import LaunchConfig, launch  # noqa: E402

PSERVERS, TRAINERS = 2, 2


def run_job(name: str, command: tuple[str, ...], out: Path) -> bool:
    config = LaunchConfig(command=command, pservers=PSERVERS, trainers=TRAINERS, sync_mode=True,
                          log_dir=out / name / "logs", status_every=30.0, rpc_timeout=120.0)
    print(f"demo-models: {name}: launching {PSERVERS} pservers and {TRAINERS} trainers (logs in {out / name / 'logs'})",
          flush=True)
    started = time.monotonic()
    job = launch(config, out=sys.stdout)
    if not job.ok:
        print(f"demo-models: {name}: FAILED: {job.failure}")
        return False
    print(f"demo-models: {name}: done in {time.monotonic() - started:.1f} s")
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="build/demo-models", help="where logs and reports go")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ok = True

    report = out / "bert" / "result.json"
    report.unlink(missing_ok=True)
    if run_job("bert", (sys.executable, str(EXAMPLES / "train_bert_small.py"), "--out", str(report)), out):
        facts = json.loads(report.read_text())
        went_down = facts["last_loss"] < facts["first_loss"]
        print(f"demo-models: bert: training loss {facts['first_loss']:.4f} -> {facts['last_loss']:.4f} over "
              f"{facts['steps']} sync steps, held-out accuracy {facts['test_accuracy'][0]:.3f} -> "
              f"{facts['test_accuracy'][1]:.3f}{'' if went_down else ' (the loss did NOT go down)'}")
        ok &= went_down
    else:
        ok = False

    resnet = EXAMPLES / "train_resnet_small.py"
    if resnet.is_file():
        ok &= run_job("resnet", (sys.executable, str(resnet)), out)
    else:
        print(f"demo-models: resnet: skipped ({resnet.name} is not here)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
