"""A CTR model: several id slots sharing one embedding table, sum-pooled, two fc layers, Adagrad.

    python3 examples/ctr.py OUT_DIR [--local-table] [--dense] [--table-optimizer adam]

Each slot is a LoD int64 id sequence (`slot0`, `slot1`, `slot2`) looked up in the one
100000×16 table `emb` (`lookup_table`, `is_sparse=True`, `is_distributed=True` unless
`--local-table` / `--dense`), `sequence_pool(sum)`, `concat`, fc 32 relu, fc 2
softmax, `cross_entropy` on `click`, `mean`, Adagrad(0.01).

As in Fluid 1.x, a distributed table is updated by a plain `sgd` op whatever the
optimizer (it has no Adagrad moment), built before the other optimizer ops;
`--table-optimizer` trains it with another optimizer (`TABLE_OPTIMIZERS`, lr 0.01) and
its accumulators instead, which the transpiler keeps on the pservers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import transpiler  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transpiler.frontend import ParamAttr, Program, layers, optimizer, program_guard, unique_name
from transpiler.frontend.io import report, save_programs

SLOTS = 3
TABLE = (100000, 16)  # rows, width
TABLE_OPTIMIZERS = {
    "sgd": lambda: optimizer.SGD(learning_rate=0.01),
    "adam": lambda: optimizer.Adam(learning_rate=0.01),
    "lazy-adam": lambda: optimizer.Adam(learning_rate=0.01, lazy_mode=True),
    "adagrad": lambda: optimizer.Adagrad(learning_rate=0.01),
    "momentum": lambda: optimizer.Momentum(learning_rate=0.01, momentum=0.9),
    "rmsprop": lambda: optimizer.RMSProp(learning_rate=0.01, momentum=0.5),
    "ftrl": lambda: optimizer.Ftrl(learning_rate=0.01, l1=1e-4, l2=1e-4),
}


def build(
    is_sparse: bool = True, is_distributed: bool = True, table: tuple[int, int] = TABLE,
    table_optimizer: str | None = None,
) -> tuple[Program, Program]:
    """The CTR programs with a `table` = (rows, width) embedding, a distributed one trained
    by `table_optimizer` (a key of `TABLE_OPTIMIZERS`; None: Fluid's sgd)."""
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        pooled = []
        for i in range(SLOTS):
            ids = layers.data(name=f"slot{i}", shape=[1], dtype="int64", lod_level=1)
            emb = layers.embedding(
                input=ids, size=list(table), is_sparse=is_sparse, is_distributed=is_distributed, param_attr=ParamAttr(name="emb")
            )
            pooled.append(layers.sequence_pool(input=emb, pool_type="sum"))
        features = layers.concat(pooled, axis=1)
        hidden = layers.fc(
            input=features, size=32, act="relu", param_attr=ParamAttr(name="ctr_fc.w"), bias_attr=ParamAttr(name="ctr_fc.b")
        )
        predict = layers.fc(
            input=hidden, size=2, act="softmax", param_attr=ParamAttr(name="ctr_out.w"), bias_attr=ParamAttr(name="ctr_out.b")
        )
        click = layers.data(name="click", shape=[1], dtype="int64")
        loss = layers.mean(layers.cross_entropy(input=predict, label=click))
        adagrad = optimizer.Adagrad(learning_rate=0.01)
        if table_optimizer is not None:
            adagrad.distributed_table_optimizer = TABLE_OPTIMIZERS[table_optimizer]()
        adagrad.minimize(loss)
    return main, startup


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ctr.py", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--local-table", action="store_true", help="is_distributed=False: a sparse table sliced like a param")
    parser.add_argument("--dense", action="store_true", help="is_sparse=False (dense grads; implies --local-table)")
    parser.add_argument("--table-optimizer", choices=sorted(TABLE_OPTIMIZERS),
                        help="train the distributed table with this optimizer (default: Fluid's sgd)")
    args = parser.parse_args(argv)
    main, startup = build(is_sparse=not args.dense, is_distributed=not (args.local_table or args.dense),
                          table_optimizer=args.table_optimizer)
    report(save_programs(args.out_dir, main, startup))
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
