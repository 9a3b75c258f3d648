"""Slicing arithmetic (the floor rule, whole rows) and the plan's reports."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transpiler.errors import TranspileError
from transpiler.ir import DType
from transpiler.plan import ParamPlan, Plan, make_blocks, slice_sizes


@pytest.mark.parametrize(
    ("shape", "pservers", "min_block", "expected"),
    [
        ((1000, 1000), 2, 8192, [500_000, 500_000]),  # fc_w of Paddle's TestBasicModel
        ((1000,), 2, 8192, [1000]),  # fc_b: below min_block_size, not cut
        ((1000, 64), 2, 8192, [32_000, 32_000]),  # the lookup-table tests' [1000, 64]
        ((1000, 1000), 2, 1_048_576, [1_000_000]),  # TestBasicModelWithLargeBlockSize
        ((1000, 10), 3, 8192, [10_000]),  # floor(10000/8192) = 1: the seeds' w1 stays whole
        ((784, 256), 2, 8192, [392 * 256, 392 * 256]),  # the MLP fixture's h1.w
        ((10, 3), 4, 1, [9, 9, 9, 3]),  # rounding up to whole rows leaves a short last block
        ((7,), 3, 1, [3, 3, 1]),
        ((5, 4), 10, 1, [4, 4, 4, 4, 4]),  # never more blocks than rows
    ],
)
def test_slice_sizes(shape, pservers, min_block, expected):
    assert slice_sizes(shape, pservers, min_block) == expected


def test_floor_not_ceil_for_the_block_count():
    # 16383 elements: ceil(16383/8192) = 2 would make a block smaller than 8192.
    assert slice_sizes((16383,), 4, 8192) == [16383]
    assert slice_sizes((16384,), 4, 8192) == [8192, 8192]


def test_min_block_size_must_be_positive():
    with pytest.raises(TranspileError, match="min_block_size"):
        slice_sizes((10,), 2, 0)


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple),
    pservers=st.integers(1, 8),
    min_block=st.integers(1, 500),
)
def test_slicing_invariants(shape, pservers, min_block):
    sizes = slice_sizes(shape, pservers, min_block)
    numel = math.prod(shape)
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    assert sum(sizes) == numel
    assert 1 <= len(sizes) <= pservers
    assert all(size % row == 0 for size in sizes)
    assert all(size == sizes[0] for size in sizes[:-1]) and sizes[-1] <= sizes[0]
    if len(sizes) > 1:
        assert sizes[0] >= min_block
    blocks = make_blocks("w", shape, sizes)
    assert [b.row_offset for b in blocks] == [sum(s // row for s in sizes[:i]) for i in range(len(sizes))]
    assert sum(b.numel for b in blocks) == numel
    assert [b.name for b in blocks] == (["w"] if len(sizes) == 1 else [f"w.block{i}" for i in range(len(sizes))])


def test_load_report_and_imbalance():
    plan = Plan(("a:1", "b:2"), trainers=2, sync_mode=True, slice_var_up=True, split_method="round_robin",
                min_block_size=1)
    param = ParamPlan("w", "w@GRAD", (4, 2), DType.FP32, "sgd", make_blocks("w", (4, 2), [6, 2]), ["a:1", "b:2"])
    plan.params.append(param)
    load = plan.load_by_endpoint()
    assert [(r["endpoint"], r["blocks"], r["elements"], r["bytes"]) for r in load] == [("a:1", 1, 6, 24), ("b:2", 1, 2, 8)]
    assert load[0]["share"] == pytest.approx(0.75)
    assert plan.imbalance() == pytest.approx(1.5)
    data = plan.to_json()
    assert data["params"][0]["blocks"][1] == {
        "name": "w.block1", "grad": "w@GRAD.block1", "index": 1, "endpoint": "b:2", "row_offset": 3, "rows": 1,
        "shape": [1, 2],
    }
    assert plan.trainer_grad_name(param, 1, 0) == "w@GRAD.block1.trainer_0"


def test_by_endpoint_is_on_for_every_endpoint_in_one_walk():
    plan = Plan(("a:1", "b:2", "c:3"), trainers=1, sync_mode=True, slice_var_up=True, split_method="hash_name",
                min_block_size=1)
    plan.params.append(ParamPlan("w", "w@GRAD", (4, 2), DType.FP32, "sgd", make_blocks("w", (4, 2), [2, 2, 2, 2]),
                                 ["b:2", "a:1", "b:2", "a:1"]))
    plan.params.append(ParamPlan("v", "v@GRAD", (3,), DType.FP32, "sgd", make_blocks("v", (3,), [3]), ["a:1"]))
    placed = plan.by_endpoint()
    assert set(placed) == {"a:1", "b:2"}  # c:3 holds nothing
    for endpoint in plan.endpoints:
        assert placed.get(endpoint, []) == plan.on(endpoint)
    assert [(p.param, b.index) for p, b in placed["a:1"]] == [("w", 1), ("w", 3), ("v", 0)]


def test_trainer_grad_names_are_trainer_grad_name_for_every_trainer():
    param = ParamPlan("w", "w@GRAD", (4, 2), DType.FP32, "sgd", make_blocks("w", (4, 2), [6, 2]), ["a:1", "b:2"])
    whole = ParamPlan("v", "v@GRAD", (3,), DType.FP32, "sgd", make_blocks("v", (3,), [3]), ["a:1"])
    for sync_mode, trainers in ((True, 3), (True, 1), (False, 2)):
        plan = Plan(("a:1", "b:2"), trainers=trainers, sync_mode=sync_mode, slice_var_up=True,
                    split_method="round_robin", min_block_size=1)
        for p, index in ((param, 0), (param, 1), (whole, 0)):
            assert plan.trainer_grad_names(p, index) == [plan.trainer_grad_name(p, index, k) for k in range(trainers)]
    assert plan.trainer_grad_names(param, 1) == ["w@GRAD.block1", "w@GRAD.block1"]  # async: one grad, no suffix
