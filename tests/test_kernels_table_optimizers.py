"""Optimizers on an auto-grown table (a pserver's shard of the distributed table) with
accumulators that follow its rows equal the same optimizer on the dense table, float64
element by element, over several steps in which rows are created (by a prefetch, by a
grad), touched, then left alone."""

from __future__ import annotations

import numpy as np
import pytest

from ops.testing import run_op
from ops.tensor import SelectedRows

HEIGHT, WIDTH, POOL = 40, 3, 8  # the table grows past its pool of 8 rows
RNG = np.random.default_rng(11)
LR = np.array([0.05])
PREFETCHED = [17, 3, 30]  # created before any step, never in a grad until step 3
STEPS = [[5, 17, 5], [9, 33], [], [3, 9, 21, 36, 12, 28, 1, 0, 39, 17], [5]]

# op -> (accumulator slot -> (output slot, initial value)), scalar inputs, attrs
CASES = {
    "sgd": ({}, {}, {}),
    "adagrad": ({"Moment": ("MomentOut", 0.1)}, {}, {"epsilon": 1e-6}),
    "ftrl": ({"SquaredAccumulator": ("SquaredAccumOut", 0.1), "LinearAccumulator": ("LinearAccumOut", 0.0)}, {},
             {"l1": 0.01, "l2": 0.01, "lr_power": -0.5}),
    "momentum": ({"Velocity": ("VelocityOut", 0.0)}, {}, {"mu": 0.9}),
    "rmsprop": ({"Moment": ("MomentOut", 0.0), "MeanSquare": ("MeanSquareOut", 0.0), "MeanGrad": ("MeanGradOut", 0.0)},
                {}, {"decay": 0.9, "momentum": 0.5, "epsilon": 1e-6, "centered": True}),
    "adam": ({"Moment1": ("Moment1Out", 0.0), "Moment2": ("Moment2Out", 0.0)},
             {"Beta1Pow": ("Beta1PowOut", 0.9), "Beta2Pow": ("Beta2PowOut", 0.999)}, {"lazy_mode": False}),
    "lazy adam": ({"Moment1": ("Moment1Out", 0.0), "Moment2": ("Moment2Out", 0.0)},
                  {"Beta1Pow": ("Beta1PowOut", 0.9), "Beta2Pow": ("Beta2PowOut", 0.999)}, {"lazy_mode": True}),
    # AdamW on a table: Adam's rule at lr * lr_ratio (the transpiler refuses a table that decays)
    "adamw": ({"Moment1": ("Moment1Out", 0.0), "Moment2": ("Moment2Out", 0.0)},
              {"Beta1Pow": ("Beta1PowOut", 0.9), "Beta2Pow": ("Beta2PowOut", 0.999)},
              {"with_decay": False, "lr_ratio": 0.5, "coeff": 0.3}),
}


def grow_with(fill: float):
    return lambda n: np.full((n, WIDTH), fill)


@pytest.mark.parametrize("case", CASES)
def test_a_table_and_its_accumulators_equal_the_dense_update(case):
    accs, scalars, attrs = CASES[case]
    op = case.split()[-1]
    pool = RNG.standard_normal((POOL + HEIGHT, WIDTH))
    table = SelectedRows([], pool[:POOL].copy(), HEIGHT, initializer=lambda n: pool[POOL:POOL + n].copy())
    table.lookup_index(PREFETCHED, grow=True)  # a prefetch creates rows before any step
    tables = {slot: SelectedRows([], np.full((2, WIDTH), fill), HEIGHT, initializer=grow_with(fill))
              for slot, (_, fill) in accs.items()}
    grads = [SelectedRows(ids, RNG.standard_normal((len(ids), WIDTH)), HEIGHT) for ids in STEPS]
    # every id the table will hold, in first-touch order, gets the pool row it will get
    order = list(dict.fromkeys([*PREFETCHED, *(i for g in grads for i in np.unique(g.rows))]))
    dense = np.zeros((HEIGHT, WIDTH))
    dense[order] = pool[: len(order)]
    untouched = [i for i in range(HEIGHT) if i not in order]
    dense[untouched] = RNG.standard_normal((len(untouched), WIDTH))
    dense_accs = {slot: np.full((HEIGHT, WIDTH), fill) for slot, (_, fill) in accs.items()}
    table_scalars = dense_scalars = {slot: np.array([fill]) for slot, (_, fill) in scalars.items()}
    start = dense.copy()
    for grad in grads:
        outs = ["ParamOut", *(o for o, _ in accs.values()), *(o for o, _ in scalars.values())]
        ran = run_op(op, {"Param": table, "Grad": grad, "LearningRate": LR, **tables, **table_scalars}, outs, attrs=attrs)
        assert ran["ParamOut"] is table and all(ran[accs[s][0]] is t for s, t in tables.items())
        table_scalars = {slot: ran[out] for slot, (out, _) in scalars.items()}
        ref = run_op(op, {"Param": dense, "Grad": grad, "LearningRate": LR, **dense_accs, **dense_scalars}, outs, attrs=attrs)
        dense = ref["ParamOut"]
        dense_accs = {slot: ref[out] for slot, (out, _) in accs.items()}
        dense_scalars = {slot: ref[out] for slot, (out, _) in scalars.items()}
    assert table.rows.tolist() == order
    np.testing.assert_array_equal(table.active_value(), dense[order])
    for slot, acc in tables.items():
        assert acc.rows.tolist() == order  # the same id at the same slot
        np.testing.assert_array_equal(acc.active_value(), dense_accs[slot][order])
    for slot, value in table_scalars.items():
        np.testing.assert_array_equal(value, dense_scalars[slot])
    np.testing.assert_array_equal(dense[untouched], start[untouched])  # rows a shard never creates stay put
    assert not np.array_equal(table.active_value()[: len(PREFETCHED)], start[PREFETCHED])


def test_an_accumulator_must_follow_its_table_from_the_start():
    table = SelectedRows([], np.zeros((4, 2)), 10)
    table.lookup_index([1, 2], grow=True)
    stray = SelectedRows([], np.zeros((4, 2)), 10)
    stray.lookup_index([2], grow=True)
    with pytest.raises(ValueError, match="not a prefix"):
        stray.follow(table)
