"""Train the small ResNet Paddle 2.6 built (tests/fixtures/paddle_programs/resnet_small_momentum_3ps_sync:
ResNet-50's op types on 32x32 images) on scikit-learn's bundled digits, in whatever role the
environment gives: locally, or as a pserver or trainer under `pstranspile launch`.

    python3 examples/train_resnet_small.py                       # local training
    pstranspile launch --pservers 2 --trainers 2 -- python3 examples/train_resnet_small.py

The programs are Paddle's own bytes (conv2d, batch_norm, pool2d, flatten_contiguous_range,
matmul_v2, Momentum lr 0.1), loaded as they are. The digits (8x8, 10 classes, no download)
are scaled up to 32x32 (each pixel a 4x4 block) on 3 identical channels; a fixed shuffle keeps
360 images for testing. Every process walks the same global batches; each trainer trains on
its share (`Role.shard`) and, as in Paddle, keeps its own batch-norm moving statistics.
Trainer 0 (or the local run) prints the mean training loss of each epoch and the test
accuracy before and after, measured by the forward ops alone with batch norm in `is_test`
mode (the moving statistics), and with `--out FILE` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

try:
    import transpiler  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transpiler.ir import OpRole, Program
from transpiler.runtime.role import Role
from transpiler.runtime.session import Session
from transpiler.runtime.script import run_script

CASE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "paddle_programs" / "resnet_small_momentum_3ps_sync"
LOSS, TEST_SIZE, SIDE = "mean_0.tmp_0", 360, 32


def inference_program(main: Program) -> tuple[Program, str]:
    """The forward ops up to the logits, batch norm reading its moving statistics (what
    Paddle's `clone(for_test=True)` gives), and the logits' name."""
    program = main.clone()
    block = program.global_block()
    (loss_op,) = [op for op in block.ops if op.type == "softmax_with_cross_entropy"]
    (logits,) = loss_op.input("Logits")
    ops = block.ops
    head = {id(op) for op in ops[: ops.index(loss_op)]}  # the loss and everything after it go
    block.remove_ops([op for op in ops if id(op) not in head or int(op.attr("op_role", 0)) != int(OpRole.Forward)])
    for op in block.ops:
        if op.type == "batch_norm":
            op.set_attr("is_test", True)
    return program, logits


def load_images(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): [n, 3, 32, 32] float32 in [0, 1], labels [n, 1] int64."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    scale = SIDE // 8
    images = np.kron(digits.images / 16.0, np.ones((scale, scale)))  # [n, 32, 32]
    x = np.repeat(images[:, None], 3, axis=1).astype(np.float32)
    y = digits.target.astype(np.int64).reshape(-1, 1)
    order = np.random.default_rng(seed).permutation(len(x))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return x[train], y[train], x[test], y[test]


def accuracy(session: Session, program: Program, logits: str, x: np.ndarray, y: np.ndarray) -> float:
    (out,) = session.evaluate(program, {"image": x}, [logits])
    return float(np.mean(np.argmax(out, axis=1) == y.reshape(-1)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="the global batch (all trainers together)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the losses and accuracies here (JSON; trainer 0 or local)")
    args = parser.parse_args(argv)

    role = Role.from_env()
    main_program, startup = Program.load(CASE / "main.pb"), Program.load(CASE / "startup.pb")
    eval_program, logits = inference_program(main_program)
    x_train, y_train, x_test, y_test = load_images(args.seed)
    rng = np.random.default_rng(args.seed + 1)
    with Session(main_program, startup, role=role, seed=args.seed, progress_every=10) as session:
        if role.is_pserver:
            session.serve()
            return 0
        session.start()
        before = accuracy(session, eval_program, logits, x_test, y_test)
        epoch_losses = []
        for _ in range(args.epochs):
            order, losses = rng.permutation(len(x_train)), []
            for start in range(0, len(order) - args.batch + 1, args.batch):
                pick = order[start:start + args.batch]
                (loss,) = session.run(role.shard({"image": x_train[pick], "label": y_train[pick]}), loss=LOSS)
                losses.append(float(np.asarray(loss).reshape(-1)[0]))
            epoch_losses.append(float(np.mean(losses)))
        after = accuracy(session, eval_program, logits, x_test, y_test)
    if role.trainer_id == 0:
        trend = ", ".join(f"{loss:.3f}" for loss in epoch_losses)
        print(f"{role.name}: mean loss per epoch {trend}; test accuracy before {before:.3f}, after {after:.3f}")
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            report = {"role": role.name, "epoch_losses": epoch_losses, "before": before, "after": after,
                      "steps": session.steps}
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
