"""Train a small BERT-style encoder that Paddle 2.6 built, in whatever role the environment
gives: locally, or as a pserver or trainer under `pstranspile launch`.

    python3 examples/train_bert_small.py                       # local training
    pstranspile launch --pservers 2 --trainers 2 -- python3 examples/train_bert_small.py

The programs are the fixture `tests/fixtures/paddle_programs/bert_small_adam_3ps_sync`:
Paddle 2.6's `TransformerEncoder` code (word + position embeddings, LayerNorm, dropout 0.1,
2 layers of 4-head self-attention and a gelu FFN, the first token pooled through tanh, a
2-class head, Adam), built by `tools/make_paddle_fixtures.py`; every op runs on our numpy
kernels (matmul_v2, layer_norm, dropout, gelu, slice, ...). The task is synthetic and
learnable: a sequence of 32 token ids is class 1 when most of its tokens come from the
lower half of the vocabulary. A fixed training set (`--examples`) is walked in the same
global batches by every process, each trainer on its share (`Role.shard`); the dropout
masks of the trainers' shares are the ones local training would draw for the whole batch.
`--lr` sets the learning rate the program's startup initialises (Paddle built it with
1e-4). Trainer 0 (or the local run) prints the loss and the held-out accuracy before and
after training and, with `--out FILE`, writes them and the losses as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
try:
    import transpiler  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from transpiler.errors import PsTranspilerError
from transpiler.ir import OpRole, Program
from transpiler.runtime.role import Role
from transpiler.runtime.script import run_script
from transpiler.runtime.session import Session

FIXTURE = ROOT / "tests" / "fixtures" / "paddle_programs" / "bert_small_adam_3ps_sync"
LOSS = "mean_0.tmp_0"
TEST_SIZE = 256


def load(lr: float) -> tuple[Program, Program]:
    """The fixture's programs, the learning rate's initialiser set to `lr`."""
    main, startup = Program.load(FIXTURE / "main.pb"), Program.load(FIXTURE / "startup.pb")
    lr_vars = {name for op in main.global_block().ops if op.type == "adam" for name in op.input("LearningRate")}
    inits = [op for op in startup.global_block().ops if op.type == "fill_constant" and set(op.output("Out")) & lr_vars]
    if not inits:
        raise PsTranspilerError(f"{FIXTURE}: no fill_constant initialises the learning rate {sorted(lr_vars)}")
    for op in inits:  # Paddle's fill_constant reads `str_value` first
        op.set_attr("value", float(lr))
        op.set_attr("str_value", repr(float(lr)))
    return main, startup


def eval_program(main: Program) -> tuple[Program, str]:
    """The forward pass alone (dropout in `is_test`), and the logits' name."""
    program = main.clone()
    block = program.global_block()
    block.remove_ops([op for op in block.ops if int(op.attr("op_role", 0)) & (OpRole.Backward | OpRole.Optimize)])
    for op in block.ops:
        if op.type == "dropout":
            op.set_attr("is_test", True)
    (loss_op,) = [op for op in block.ops if op.type == "softmax_with_cross_entropy"]
    return program, loss_op.input("Logits")[0]


def data(program: Program, count: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """`count` examples: ids, positions and labels (1: most tokens below vocab / 2)."""
    block = program.global_block()
    seq = block.var("src_ids").shape[1]
    vocab = next(block.var(op.input("W")[0]).shape[0] for op in block.ops
                 if op.type == "lookup_table_v2" and op.input("Ids") == ("src_ids",))
    rng = np.random.default_rng(seed)
    low_share = rng.uniform(0.2, 0.8, size=(count, 1))  # each sequence draws its own mix
    low = rng.uniform(size=(count, seq)) < low_share
    ids = np.where(low, rng.integers(0, vocab // 2, (count, seq)), rng.integers(vocab // 2, vocab, (count, seq)))
    label = (low.sum(axis=1, keepdims=True) * 2 > seq).astype(np.int64)
    pos = np.broadcast_to(np.arange(seq, dtype=np.int64), (count, seq)).copy()
    return {"src_ids": ids.astype(np.int64), "pos_ids": pos, "label": label}, label


def batches(examples: dict[str, np.ndarray], batch: int, steps: int, seed: int) -> Iterator[dict[str, np.ndarray]]:
    """`steps` global batches, the same sequence in every process."""
    rng = np.random.default_rng(seed + 1)
    count = len(examples["label"])
    order = rng.permutation(count)
    at = 0
    for _ in range(steps):
        if at + batch > count:
            order, at = rng.permutation(count), 0
        pick = order[at: at + batch]
        at += batch
        yield {name: value[pick] for name, value in examples.items()}


def evaluate(session: Session, program: Program, logits: str, test: dict[str, np.ndarray]) -> tuple[float, float]:
    """(mean loss, accuracy) on the held-out examples."""
    out, loss = session.evaluate(program, test, [logits, LOSS])
    accuracy = float(np.mean(np.argmax(out, axis=1) == test["label"].reshape(-1)))
    return float(np.asarray(loss).reshape(-1)[0]), accuracy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=32, help="the global batch (all trainers together)")
    parser.add_argument("--examples", type=int, default=4096, help="the training set's size")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write losses and accuracies here (JSON; trainer 0 or local)")
    args = parser.parse_args(argv)

    role = Role.from_env()
    main_program, startup = load(args.lr)
    test_program, logits = eval_program(main_program)
    train, _ = data(main_program, args.examples, args.seed)
    test, _ = data(main_program, TEST_SIZE, args.seed + 100)
    with Session(main_program, startup, role=role, seed=args.seed, progress_every=10) as session:
        if role.is_pserver:
            session.serve()
            return 0
        session.start()
        before = evaluate(session, test_program, logits, test)
        losses = []
        for batch in batches(train, args.batch, args.steps, args.seed):
            (loss,) = session.run(role.shard(batch), loss=LOSS)
            losses.append(float(np.asarray(loss).reshape(-1)[0]))
        after = evaluate(session, test_program, logits, test)
    if role.trainer_id == 0:
        first, last = float(np.mean(losses[:10])), float(np.mean(losses[-10:]))
        print(f"{role.name}: training loss {first:.4f} -> {last:.4f} (mean of the first / last 10 of {len(losses)} "
              f"steps); held-out loss {before[0]:.4f} -> {after[0]:.4f}, accuracy {before[1]:.3f} -> {after[1]:.3f}")
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            report = {"role": role.name, "losses": losses, "first_loss": first, "last_loss": last,
                      "test_loss": [before[0], after[0]], "test_accuracy": [before[1], after[1]], "steps": len(losses)}
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
