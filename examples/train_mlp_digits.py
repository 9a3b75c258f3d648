"""Train the MLP on scikit-learn's bundled digits (8x8 images, 10 classes), in whatever
role the environment gives: locally, or as a pserver or trainer under `pstranspile launch`.

    python3 examples/train_mlp_digits.py                       # local training
    pstranspile launch --pservers 2 --trainers 2 -- python3 examples/train_mlp_digits.py

The network is `examples/mlp.py`'s (fc 256 relu, fc 128 relu, fc 10, softmax
cross-entropy, Adam), on 64 inputs instead of 784. The data set ships inside
scikit-learn (no download); a fixed shuffle keeps 360 images for testing. Every process
walks the same global batches; each trainer trains on its share (`Role.shard`).
Trainer 0 (or the local run) prints the test accuracy before and after training and,
with `--out FILE`, writes them and the losses as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

try:
    import transpiler  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transpiler.frontend import ParamAttr, Program, data, layers, optimizer, program_guard, unique_name
from transpiler.runtime.role import Role
from transpiler.runtime.session import Session
from transpiler.runtime.script import run_script

FEATURES, CLASSES, TEST_SIZE = 64, 10, 360


def _forward(img):
    h1 = layers.fc(input=img, size=256, act="relu", param_attr=ParamAttr(name="h1.w"), bias_attr=ParamAttr(name="h1.b"))
    h2 = layers.fc(input=h1, size=128, act="relu", param_attr=ParamAttr(name="h2.w"), bias_attr=ParamAttr(name="h2.b"))
    return layers.fc(input=h2, size=CLASSES, param_attr=ParamAttr(name="out.w"), bias_attr=ParamAttr(name="out.b"))


def build(learning_rate: float) -> tuple[Program, Program, str]:
    """(main, startup, loss var name) of the training program."""
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        img = data(name="img", shape=[None, FEATURES], dtype="float32")
        label = data(name="label", shape=[None, 1], dtype="int64")
        loss = layers.mean(layers.softmax_with_cross_entropy(logits=_forward(img), label=label))
        optimizer.Adam(learning_rate=learning_rate).minimize(loss)
    return main, startup, loss.name


def build_eval() -> tuple[Program, str]:
    """A forward-only program over the same parameters, and its logits' name."""
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        logits = _forward(data(name="img", shape=[None, FEATURES], dtype="float32"))
    return main, logits.name


def load_digits(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): pixels scaled to [0, 1], labels `[n, 1]` int64."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64).reshape(-1, 1)
    order = np.random.default_rng(seed).permutation(len(x))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return x[train], y[train], x[test], y[test]


def batches(x: np.ndarray, y: np.ndarray, batch: int, epochs: int, seed: int) -> Iterator[dict[str, np.ndarray]]:
    """Global batches, the same sequence in every process (full batches only)."""
    rng = np.random.default_rng(seed + 1)
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for start in range(0, len(x) - batch + 1, batch):
            pick = order[start : start + batch]
            yield {"img": x[pick], "label": y[pick]}


def accuracy(session: Session, program: Program, logits: str, x: np.ndarray, y: np.ndarray) -> float:
    (out,) = session.evaluate(program, {"img": x}, [logits])
    return float(np.mean(np.argmax(out, axis=1) == y.reshape(-1)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="the global batch (all trainers together)")
    parser.add_argument("--lr", type=float, default=0.003, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write accuracies and losses here (JSON; trainer 0 or local)")
    args = parser.parse_args(argv)

    role = Role.from_env()
    main_program, startup, loss_name = build(args.lr)
    eval_program, logits = build_eval()
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    with Session(main_program, startup, role=role, seed=args.seed) as session:
        if role.is_pserver:
            session.serve()
            return 0
        session.start()
        before = accuracy(session, eval_program, logits, x_test, y_test)
        losses = []
        for batch in batches(x_train, y_train, args.batch, args.epochs, args.seed):
            (loss,) = session.run(role.shard(batch), loss=loss_name)
            losses.append(float(np.asarray(loss).reshape(-1)[0]))
        after = accuracy(session, eval_program, logits, x_test, y_test)
    if role.trainer_id == 0:
        print(f"{role.name}: test accuracy before {before:.3f}, after {after:.3f} ({len(losses)} steps, last loss {losses[-1]:.4f})")
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            report = {"role": role.name, "before": before, "after": after, "steps": len(losses), "losses": losses,
                      "sync_mode": role.sync_mode}
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
